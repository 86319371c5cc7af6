#!/usr/bin/env python3
"""What the read tracer costs (docs/engine.md, "Read sets"): every command of the live
benchmark's tasks (scripts/bench_live/: a Python unittest run, gcc/make, pip installs from a
wheelhouse, a CSV script, and the reads and edits between them), run twice from the same
state, once in a traced fork (``trace_reads``: strace -f --seccomp-bpf around bubblewrap, as
speculative forks run) and once in a plain fork (as the committed step runs), in alternating
order, ``--reps`` times each; then the plain fork is committed and the next step runs.

Per task and overall: the plain and traced wall time and CPU (this process's children:
bubblewrap, strace and the command), the overhead, and what turning the log into a read set
took (``read_set``, off the committed path: it runs in the fork's task, at background
priority). Timing-sensitive: run it on a quiet machine; figures from a loaded one are noisy.

Usage:
  .venv/bin/python scripts/bench_readsets.py [--reps 3] [--tasks inventory-discount,...] [--json]

Run as root; the base is the live benchmark's (``--base``, built on first use).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aospec.runtime import Bind, SandboxConfig, open_sandbox
from aospec.runtime.readsets import tracer_support
from bench_live.tasks import MEASURED

# scripts/bench_live.py (its name is also the tasks package's): the base, environment and staging
_spec = importlib.util.spec_from_file_location("bench_live_script", Path(__file__).with_name("bench_live.py"))
assert _spec is not None and _spec.loader is not None
_live = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _live  # its dataclasses look their module up
_spec.loader.exec_module(_live)
BASE, ENV, stage = _live.BASE, _live.ENV, _live.stage


_TIMES = "__aospec_bench_times__"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(command: str) -> str:
    # the sandbox's processes are not this process's children once bubblewrap's init
    # reaps them: the shell running the command reports its children's CPU itself
    return f"{command}\n__rc=$?; echo {_TIMES}; times; exit $__rc"


def _sandbox_cpu(output: str) -> float:
    """The CPU (user + system) of the command's processes, from ``times``'s second line."""
    tail = output.rpartition(_TIMES)[2].split()
    if len(tail) < 4:
        raise SystemExit(f"bench_readsets: no CPU times in the command's output ({output[-200:]!r})")
    return sum(float(m) * 60 + float(sec) for m, sec in (t.rstrip("s").split("m") for t in tail[2:4]))


async def _once(sb: Any, command: str, *, traced: bool) -> tuple[Any, float, float, float, int, bool]:
    """(fork, wall s, CPU s, read_set s, trace lines, tracked) of one run in a new fork.
    CPU: the command's processes (``times``) plus this process's children (bubblewrap and,
    traced, strace)."""
    fork = await sb.fork()
    if traced:
        await fork.trace_reads()
    cpu0, t0 = _children_cpu(), time.perf_counter()
    result = await fork.run(_timed(command))
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0 + _sandbox_cpu(result.output)
    parse = 0.0
    lines = 0
    tracked = True
    if traced:
        t1 = time.perf_counter()
        tracked = await fork.read_set() is not None
        parse = time.perf_counter() - t1
        log = fork._trace.log  # the benchmark looks at the tracer's log size (not public API)
        lines = log.read_bytes().count(b"\n") if log.exists() else 0
    return fork, wall, cpu, parse, lines, tracked


async def measure(traj: Any, staged: dict[str, Path], base: str, reps: int) -> list[dict[str, Any]]:
    cfg = SandboxConfig(
        base=base,
        binds=(Bind(str(staged[traj.project]), f"/src/{traj.project}"),),
        env={**ENV, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout_s=300,
    )
    rows = []
    async with open_sandbox(cfg) as sb:
        await sb.run(f"mkdir -p /work && cp -a /src/{traj.project} /work/{traj.project} && touch -d @1700000000 /work")
        for i, (_, command) in enumerate(traj.steps):
            plain, traced = [], []
            keep = None
            for r in range(reps):
                for kind in ("plain", "traced") if r % 2 == 0 else ("traced", "plain"):
                    fork, *fig = await _once(sb, command, traced=kind == "traced")
                    (traced if kind == "traced" else plain).append(fig)
                    if kind == "plain" and keep is None:
                        keep = fork
                    else:
                        await fork.discard()
            assert keep is not None
            await sb.commit(keep)  # the step, as serial execution ran it
            rows.append(
                {
                    "task": traj.task,
                    "step": i,
                    "command": command,
                    "plain_s": statistics.median(f[0] for f in plain),
                    "traced_s": statistics.median(f[0] for f in traced),
                    "plain_cpu_s": statistics.median(f[1] for f in plain),
                    "traced_cpu_s": statistics.median(f[1] for f in traced),
                    "read_set_s": statistics.median(f[2] for f in traced),
                    "trace_lines": int(statistics.median(f[3] for f in traced)),
                    "tracked": all(f[4] for f in traced),
                }
            )
    return rows


def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, Any]:
    plain = sum(r["plain_s"] for r in rows)
    traced = sum(r["traced_s"] for r in rows)
    pcpu = sum(r["plain_cpu_s"] for r in rows)
    tcpu = sum(r["traced_cpu_s"] for r in rows)
    return {
        "what": key,
        "commands": len(rows),
        "plain_s": round(plain, 3),
        "traced_s": round(traced, 3),
        "wall_overhead": round(traced / plain - 1, 4) if plain else 0.0,
        "plain_cpu_s": round(pcpu, 3),
        "traced_cpu_s": round(tcpu, 3),
        "cpu_overhead": round(tcpu / pcpu - 1, 4) if pcpu else 0.0,
        "read_set_s": round(sum(r["read_set_s"] for r in rows), 3),
        "trace_lines": sum(r["trace_lines"] for r in rows),
        "untracked": sum(not r["tracked"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="runs of each command per kind (default 3)")
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: all measured tasks)")
    ap.add_argument("--base", default=BASE, help=f"sandbox base (default {BASE})")
    ap.add_argument("--json", action="store_true", help="one JSON document")
    args = ap.parse_args(argv)
    support = tracer_support()
    if not support.ok:
        print(f"bench_readsets: read sets are {support.detail}", file=sys.stderr)
        return 2
    names = args.tasks.split(",") if args.tasks else [t.task for t in MEASURED]
    trajs = [t for t in MEASURED if t.task in names]
    if not trajs or args.reps < 1:
        ap.error(f"choose tasks among {', '.join(t.task for t in MEASURED)} and --reps >= 1")
    from aospec.runtime.bases import build_base

    if args.base.startswith("debootstrap"):
        build_base(args.base)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aospec-bench-readsets-") as tmp:
        staged = stage(trajs, Path(tmp))
        for t in trajs:
            print(f"{t.id} ...", file=sys.stderr, flush=True)
            rows += anyio.run(measure, t, staged, args.base, args.reps)
    tasks = [summarize([r for r in rows if r["task"] == t.task], t.task) for t in trajs]
    doc = {"tracer": support.detail, "reps": args.reps, "tasks": tasks, "all": summarize(rows, "all"), "steps": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"tracer: {support.detail}; medians of {args.reps} runs per command and kind")
    head = ("what", "cmds", "plain", "traced", "wall +", "CPU plain", "CPU traced", "CPU +", "read_set", "lines")
    print("".join(f"{h:>12}" for h in head))
    for s in [*tasks, doc["all"]]:
        print(
            f"{s['what'][:12]:>12}{s['commands']:>12}{s['plain_s']:>11.2f}s{s['traced_s']:>11.2f}s"
            f"{s['wall_overhead']:>12.1%}{s['plain_cpu_s']:>11.2f}s{s['traced_cpu_s']:>11.2f}s"
            f"{s['cpu_overhead']:>12.1%}{s['read_set_s']:>11.2f}s{s['trace_lines']:>12}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
