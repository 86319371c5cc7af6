"""Time loading, summarising and converting a trace set; prints the figures.

python scripts/bench_traces.py [PATH...]   # default: the shared tb1 set, else the bundled sample
"""

from __future__ import annotations

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


def main(argv: list[str]) -> None:
    paths = argv or [str(SHARED_TB1 if SHARED_TB1.is_dir() else bundled_traces_path())]
    t_load, traces = _best(lambda: load_traces(paths))
    t_stats, stats = _best(lambda: trace_stats(traces), repeat=1)  # first call: classifier cache cold
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "all.jsonl"
        t_write, _ = _best(lambda: write_jsonl(traces, out))
        t_read, _ = _best(lambda: read_jsonl(out))
        size = out.stat().st_size
    print(f"paths: {', '.join(paths)}")
    print(f"traces {stats.trials}, steps {stats.steps}")
    print(f"load_traces      {t_load * 1000:8.1f} ms (best of 5)")
    print(f"trace_stats      {t_stats * 1000:8.1f} ms (cold effect classifier)")
    print(f"write_jsonl      {t_write * 1000:8.1f} ms ({size / 1e6:.1f} MB)")
    print(f"read_jsonl       {t_read * 1000:8.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
