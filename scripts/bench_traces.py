"""Time loading, summarising and converting a trace set, and the shell lexer on long words;
prints the figures.

python scripts/bench_traces.py [PATH...] [--json]   # default: the shared tb1 set, else the bundled sample

The lexer rows classify one ``cat WORD | wc -l`` command (aospec.effects.classify_command,
what ``traces stats`` and ``sweep`` run on every bash step) with a WORD of 1, 4 and 16 MiB:
plain, single-quoted, and double-quoted with an escape every 4 characters. Linear time
means each row takes about 4 times the one before (issue 20: stdlib shlex took 14 s at
1 MiB and did not finish at 4 MiB).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from aospec.replay import bundled_traces_path, load_traces, read_jsonl, trace_stats, write_jsonl

SHARED_TB1 = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "tb1-mini-swe-agent-claude-sonnet-4"


def _best(fn, repeat: int = 5) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def lexer_figures() -> dict[str, dict[str, float]]:
    """Seconds to classify ``cat WORD | wc -l`` per word shape and size (MiB)."""
    from aospec.effects import classify_command

    shapes = {"plain": "{w}", "single-quoted": "'{w}'", "double-quoted, escapes": '"{e}"'}
    out: dict[str, dict[str, float]] = {}
    for name, shape in shapes.items():
        out[name] = {}
        for mib in (1, 4, 16):
            n = mib << 20
            line = "cat " + shape.format(w="a" * n, e="ab\\\\c" * (n // 4)) + " | wc -l"
            t = time.perf_counter()
            classify_command.__wrapped__(line)  # not the cache
            out[name][str(mib)] = time.perf_counter() - t
    return out


def main(argv: list[str]) -> None:
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    paths = argv or [str(SHARED_TB1 if SHARED_TB1.is_dir() else bundled_traces_path())]
    t_load, traces = _best(lambda: load_traces(paths))
    t_stats, stats = _best(lambda: trace_stats(traces), repeat=1)  # first call: classifier cache cold
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "all.jsonl"
        t_write, _ = _best(lambda: write_jsonl(traces, out))
        t_read, _ = _best(lambda: read_jsonl(out))
        size = out.stat().st_size
    lexer = lexer_figures()
    if as_json:
        doc = {"paths": paths, "traces": stats.trials, "steps": stats.steps, "load_traces_s": t_load,
               "trace_stats_s": t_stats, "write_jsonl_s": t_write, "read_jsonl_s": t_read, "jsonl_bytes": size,
               "classify_long_word_s": lexer}  # fmt: skip
        print(json.dumps(doc, indent=2))
        return
    print(f"paths: {', '.join(paths)}")
    print(f"traces {stats.trials}, steps {stats.steps}")
    print(f"load_traces      {t_load * 1000:8.1f} ms (best of 5)")
    print(f"trace_stats      {t_stats * 1000:8.1f} ms (cold effect classifier)")
    print(f"write_jsonl      {t_write * 1000:8.1f} ms ({size / 1e6:.1f} MB)")
    print(f"read_jsonl       {t_read * 1000:8.1f} ms")
    for name, row in lexer.items():
        cells = "  ".join(f"{mib:>2} MiB {s * 1000:8.1f} ms" for mib, s in row.items())
        print(f"classify one long word, {name:22} {cells}")


if __name__ == "__main__":
    main(sys.argv[1:])
