#!/usr/bin/env python3
"""What the read tracer costs (docs/engine.md, "Read sets"): every command of the live
benchmark's tasks (scripts/bench_live/: a Python unittest run, gcc/make, pip installs from a
wheelhouse, a CSV script, and the reads and edits between them), run from the same state in a
plain fork (as the committed step runs) and in a fork traced by each tracer (``trace_reads``,
as speculative forks run: ``ebpf``, bpftrace on the syscall tracepoints, and ``strace``,
strace -f --seccomp-bpf around bubblewrap), in rotating order, ``--reps`` times each; then the
plain fork is committed and the next step runs.

Per tracer, task and overall: the plain and traced wall time and CPU (the command's processes,
this process's children, this process itself, and the eBPF tracer's bpftrace), the overhead,
and what turning the trace into a read set took (``read_set``, off the committed path: it runs
in the fork's task, at background priority). Timing-sensitive: run it on a quiet machine;
figures from a loaded one are noisy.

``--committed`` also measures what the eBPF tracer costs what it does not trace: its probes
are attached to every system call on the host while bpftrace runs, so the committed step (a
plain fork) and every other process pay a little per call. Each task's commands run as
committed plain forks with bpftrace stopped and with it running, and a host process makes
``getppid`` and ``stat`` calls in a loop (ns per call), the two states in alternating order,
``--reps`` times; with bpftrace's start time and the CPU its start took.

``--start-under-load K`` measures only what the eBPF tracer's start (seconds of CPU compiling
and attaching its probes, once per process) costs a busy host: ``K`` CPU-bound processes each
burn ``--work`` CPU-seconds, without the tracer starting beside them, with it, and with it
started on tracefs's own ``available_events`` (``start-tracefs``: bpftrace re-reads that
generated file for every probe; aospec starts it on a snapshot), and asked for as a fork asks
(``asked``: the start waits for a core to spare), in rotating order, ``--reps`` times: how
much longer the busy processes took than their work, and when the tracer was ready.

Usage:
  .venv/bin/python scripts/bench_readsets.py [--reps 3] [--tasks inventory-discount,...] [--tracers ebpf,strace] [--committed] [--json]
  .venv/bin/python scripts/bench_readsets.py --start-under-load 2 [--work 20] [--reps 3] [--json]

Run as root; the base is the live benchmark's (``--base``, built on first use).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aospec.runtime import Bind, SandboxConfig, ebpf, open_sandbox, readsets
from aospec.runtime.readsets import EbpfCommandTrace, TracerSupport, tracer_support
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
    s = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + s.ru_utime + s.ru_stime + _service_cpu()


def _service_cpu() -> float:
    """The CPU the eBPF tracer's bpftrace has used (it is not reaped until the end)."""
    total = 0.0
    for pid in ebpf.service_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _use(kind: str) -> None:
    """Make ``kind`` (ebpf or strace) the tracer the next traced forks use."""
    base = tracer_support()
    readsets._support = TracerSupport(True, base.detail, base.strace, kind, base.ebpf)


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


async def _once(sb: Any, command: str, *, tracer: str | None) -> tuple[Any, float, float, float, int, bool]:
    """(fork, wall s, CPU s, read_set s, trace lines, tracked) of one run in a new fork,
    traced by ``tracer`` (None: plain). CPU: the command's processes (``times``) plus this
    process, its children (bubblewrap and strace) and the eBPF tracer."""
    fork = await sb.fork()
    if tracer is not None:
        _use(tracer)
        await fork.trace_reads()
    cpu0, t0 = _children_cpu(), time.perf_counter()
    result = await fork.run(_timed(command))
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0 + _sandbox_cpu(result.output)
    parse = 0.0
    lines = 0
    tracked = True
    if tracer is not None:
        trace = fork._trace  # the benchmark looks at the trace's size (not public API)
        t1 = time.perf_counter()
        tracked = await fork.read_set() is not None
        parse = time.perf_counter() - t1
        if isinstance(trace, EbpfCommandTrace):
            lines = len(trace.events()[0])
        else:
            lines = trace.log.read_bytes().count(b"\n") if trace.log.exists() else 0
    return fork, wall, cpu, parse, lines, tracked


@asynccontextmanager
async def _task_sandbox(traj: Any, staged: dict[str, Path], base: str) -> AsyncIterator[Any]:
    """A sandbox at the task's start: its project copied into /work, as the live benchmark
    stages it."""
    cfg = SandboxConfig(
        base=base,
        binds=(Bind(str(staged[traj.project]), f"/src/{traj.project}"),),
        env={**ENV, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout_s=300,
    )
    async with open_sandbox(cfg) as sb:
        await sb.run(f"mkdir -p /work && cp -a /src/{traj.project} /work/{traj.project} && touch -d @1700000000 /work")
        yield sb


async def measure(traj: Any, staged: dict[str, Path], base: str, reps: int, tracers: list[str]) -> list[dict[str, Any]]:
    rows = []
    kinds = ["plain", *tracers]
    async with _task_sandbox(traj, staged, base) as sb:
        for i, (_, command) in enumerate(traj.steps):
            figs: dict[str, list[Any]] = {k: [] for k in kinds}
            keep = None
            for r in range(reps):
                for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotating order
                    fork, *fig = await _once(sb, command, tracer=None if kind == "plain" else kind)
                    figs[kind].append(fig)
                    if kind == "plain" and keep is None:
                        keep = fork
                    else:
                        await fork.discard()
            assert keep is not None
            await sb.commit(keep)  # the step, as serial execution ran it
            row: dict[str, Any] = {
                "task": traj.task,
                "step": i,
                "command": command,
                "plain_s": statistics.median(f[0] for f in figs["plain"]),
                "plain_cpu_s": statistics.median(f[1] for f in figs["plain"]),
            }
            for t in tracers:
                row[f"{t}_s"] = statistics.median(f[0] for f in figs[t])
                row[f"{t}_cpu_s"] = statistics.median(f[1] for f in figs[t])
                row[f"{t}_read_set_s"] = statistics.median(f[2] for f in figs[t])
                row[f"{t}_trace_lines"] = int(statistics.median(f[3] for f in figs[t]))
                row[f"{t}_tracked"] = all(f[4] for f in figs[t])
            rows.append(row)
    return rows


async def committed(traj: Any, staged: dict[str, Path], base: str) -> tuple[float, float]:
    """(wall s, CPU s) of the task's commands run as serial execution runs them: each in a
    plain fork, committed, from the task's start."""
    wall = cpu = 0.0
    async with _task_sandbox(traj, staged, base) as sb:
        for _, command in traj.steps:
            fork, w, c, *_ = await _once(sb, command, tracer=None)
            wall, cpu = wall + w, cpu + c
            await sb.commit(fork)
    return wall, cpu


_SYSCALLS = """
import os, sys, time
n = int(sys.argv[1])
out = []
for call, arg in ((os.getppid, ()), (os.stat, ("/",))):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        call(*arg)
    out.append((time.perf_counter_ns() - t0) / n)
print(*out)
"""


def _syscall_ns(n: int) -> tuple[float, float]:
    """ns per ``getppid`` and per ``stat`` call of a host process (untraced) in a loop."""
    out = subprocess.run([sys.executable, "-c", _SYSCALLS, str(n)], capture_output=True, text=True, check=True)
    getppid, stat = map(float, out.stdout.split())
    return getppid, stat


def _start_tracer(support: TracerSupport) -> tuple[float, float]:
    """(wall s, CPU s) of starting the eBPF tracer (compiling and attaching its probes)."""
    assert support.ebpf is not None
    cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    ebpf.tracer(support.ebpf)
    wall = time.perf_counter() - t0
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, c.ru_utime + c.ru_stime - cpu0.ru_utime - cpu0.ru_stime + _service_cpu()


def measure_committed(
    trajs: list[Any], staged: dict[str, Path], base: str, reps: int, support: TracerSupport, calls: int
) -> dict[str, Any]:
    """The committed path and a host process with bpftrace stopped ("off") and running
    ("on"), alternating which goes first; medians over ``reps``, and the spread."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    starts: list[tuple[float, float]] = []
    for r in range(reps):
        for state in ("off", "on") if r % 2 == 0 else ("on", "off"):
            print(f"committed path, run {r + 1}/{reps}, tracer {state} ...", file=sys.stderr, flush=True)
            if state == "off":
                ebpf.stop_tracer()
            elif not ebpf.service_pids():
                starts.append(_start_tracer(support))
            assert bool(ebpf.service_pids()) == (state == "on")
            tasks = {t.task: anyio.run(committed, t, staged, base) for t in trajs}
            getppid, stat = _syscall_ns(calls)
            runs[state].append({"tasks": tasks, "getppid_ns": getppid, "stat_ns": stat})

    def med(state: str, pick: Any) -> float:
        return statistics.median(pick(x) for x in runs[state])

    def row(what: str, pick: Any, digits: int = 3) -> dict[str, Any]:
        off, on = med("off", pick), med("on", pick)
        return {
            "what": what,
            "off": round(off, digits),
            "on": round(on, digits),
            "overhead": round(on / off - 1, 4) if off else 0.0,
            "off_range": [
                round(min(pick(x) for x in runs["off"]), digits),
                round(max(pick(x) for x in runs["off"]), digits),
            ],
            "on_range": [
                round(min(pick(x) for x in runs["on"]), digits),
                round(max(pick(x) for x in runs["on"]), digits),
            ],
        }

    rows = []
    for t in trajs:
        rows.append(row(f"{t.task} wall s", lambda x, k=t.task: x["tasks"][k][0]))
        rows.append(row(f"{t.task} CPU s", lambda x, k=t.task: x["tasks"][k][1]))
    rows.append(row("all wall s", lambda x: sum(w for w, _ in x["tasks"].values())))
    rows.append(row("all CPU s", lambda x: sum(c for _, c in x["tasks"].values())))
    rows.append(row("getppid ns", lambda x: x["getppid_ns"], 1))
    rows.append(row("stat ns", lambda x: x["stat_ns"], 1))
    return {
        "reps": reps,
        "calls": calls,
        "rows": rows,
        "starts": [{"wall_s": round(w, 3), "cpu_s": round(c, 3)} for w, c in starts],
    }


_BURN = """
import sys, time
end = float(sys.argv[1])
while time.process_time() < end:
    pass
"""


def start_under_load(support: TracerSupport, load: int, work_s: float, reps: int) -> dict[str, Any]:
    """The eBPF tracer's start beside ``load`` processes burning ``work_s`` CPU-seconds each:
    with no start ("none"), with one ("start") and with one on tracefs's own
    ``available_events`` instead of a snapshot ("start-tracefs", as before 2026-12-07), the
    busy processes' wall time beyond their work (the slowest one) and the tracer's ready
    time; medians and ranges, the modes in an order rotated per repetition."""
    assert support.ebpf is not None
    modes = ("none", "start", "start-tracefs", "asked")
    runs: dict[str, list[tuple[float, float | None, float | None]]] = {m: [] for m in modes}
    try:
        for r in range(reps):
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                print(
                    f"tracer start beside {load} busy processes, run {r + 1}/{reps}: {m} ...",
                    file=sys.stderr,
                    flush=True,
                )
                ebpf.stop_tracer()
                t0 = time.perf_counter()
                procs: list[subprocess.Popen[bytes]] = []
                try:
                    procs += [subprocess.Popen([sys.executable, "-c", _BURN, str(work_s)]) for _ in range(load)]
                    ready: float | None = None
                    cpu: float | None = None
                    if m == "asked":
                        # as a fork asks for it: started once the host has a core to spare
                        ebpf.ready_tracer(support.ebpf)
                    elif m != "none":
                        ebpf.tracer(support.ebpf, snapshot=m == "start")
                        ready = time.perf_counter() - t0
                        cpu = _service_cpu()  # bpftrace's own CPU so far: its start
                    for p in procs:
                        p.wait()
                    busy_end = time.perf_counter()
                    if m == "asked":
                        starting = ebpf._starting
                        if starting is not None:
                            starting.join()
                        if ebpf.service_pids():
                            ready = time.perf_counter() - t0
                            cpu = _service_cpu()
                finally:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                            p.wait()
                late = busy_end - t0 - work_s
                runs[m].append((late, ready, cpu))
    finally:
        ebpf.stop_tracer()

    def stat(values: list[float]) -> dict[str, float] | None:
        if not values:
            return None
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    return {
        "load": load,
        "work_s": work_s,
        "reps": reps,
        "rows": [
            {
                "mode": m,
                "busy_late_s": stat([x[0] for x in runs[m]]),
                "ready_s": stat([x[1] for x in runs[m] if x[1] is not None]),
                "start_cpu_s": stat([x[2] for x in runs[m] if x[2] is not None]),
            }
            for m in modes
        ],
    }


def summarize(rows: list[dict[str, Any]], key: str, tracer: str) -> dict[str, Any]:
    plain = sum(r["plain_s"] for r in rows)
    traced = sum(r[f"{tracer}_s"] for r in rows)
    pcpu = sum(r["plain_cpu_s"] for r in rows)
    tcpu = sum(r[f"{tracer}_cpu_s"] for r in rows)
    return {
        "what": key,
        "tracer": tracer,
        "commands": len(rows),
        "plain_s": round(plain, 3),
        "traced_s": round(traced, 3),
        "wall_overhead": round(traced / plain - 1, 4) if plain else 0.0,
        "plain_cpu_s": round(pcpu, 3),
        "traced_cpu_s": round(tcpu, 3),
        "cpu_overhead": round(tcpu / pcpu - 1, 4) if pcpu else 0.0,
        "read_set_s": round(sum(r[f"{tracer}_read_set_s"] for r in rows), 3),
        "trace_lines": sum(r[f"{tracer}_trace_lines"] for r in rows),
        "untracked": sum(not r[f"{tracer}_tracked"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="runs of each command per kind (default 3)")
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: all measured tasks)")
    ap.add_argument("--base", default=BASE, help=f"sandbox base (default {BASE})")
    ap.add_argument("--json", action="store_true", help="one JSON document")
    ap.add_argument(
        "--tracers", default=None, help="comma-separated: ebpf, strace (default: each that works here, ebpf first)"
    )
    ap.add_argument(
        "--committed",
        action="store_true",
        help="also: the committed path and a host process with the eBPF tracer stopped and running",
    )
    ap.add_argument(
        "--calls", type=int, default=200_000, help="system calls of each kind in --committed's loop (default 200000)"
    )
    ap.add_argument(
        "--start-under-load",
        type=int,
        default=None,
        metavar="K",
        help="only: what the eBPF tracer's start costs K CPU-bound processes beside it",
    )
    ap.add_argument(
        "--work",
        type=float,
        default=20.0,
        help="CPU-seconds each busy process of --start-under-load burns (default 20)",
    )
    args = ap.parse_args(argv)
    support = tracer_support()
    if not support.ok:
        print(f"bench_readsets: read sets are {support.detail}", file=sys.stderr)
        return 2
    if args.start_under_load is not None:
        if support.ebpf is None or not support.ebpf.ok:
            ap.error("--start-under-load: the eBPF tracer does not run here")
        if args.start_under_load < 1 or args.work <= 0 or args.reps < 1:
            ap.error("--start-under-load K >= 1, --work > 0 and --reps >= 1")
        doc = start_under_load(support, args.start_under_load, args.work, args.reps)
        if args.json:
            print(json.dumps(doc, indent=2))
            return 0
        print(
            f"the eBPF tracer's start beside {doc['load']} processes burning {doc['work_s']:.0f} CPU-s each"
            f" (medians of {doc['reps']}, range in brackets)"
        )
        print(f"{'start':<14}{'busy processes late':>28}{'tracer ready':>28}{'its CPU':>24}")
        for row in doc["rows"]:
            cells = [
                "-" if row[k] is None else f"{row[k]['median']:.1f} s [{row[k]['min']:.1f}-{row[k]['max']:.1f}]"
                for k in ("busy_late_s", "ready_s", "start_cpu_s")
            ]
            print(f"{row['mode']:<14}{cells[0]:>28}{cells[1]:>28}{cells[2]:>24}")
        return 0
    usable = [
        t for t in ("ebpf", "strace") if (t == "ebpf" and support.kind == "ebpf") or (t == "strace" and support.strace)
    ]
    tracers = args.tracers.split(",") if args.tracers else usable
    if not tracers or any(t not in usable for t in tracers):
        ap.error(f"--tracers: choose among {', '.join(usable)} (the tracers that work here)")
    names = args.tasks.split(",") if args.tasks else [t.task for t in MEASURED]
    trajs = [t for t in MEASURED if t.task in names]
    if args.committed and (support.ebpf is None or not support.ebpf.ok):
        ap.error("--committed: the eBPF tracer does not run here")
    if args.calls < 1:
        ap.error("--calls: at least 1")
    if not trajs or args.reps < 1:
        ap.error(f"choose tasks among {', '.join(t.task for t in MEASURED)} and --reps >= 1")
    from aospec.runtime.bases import build_base

    if args.base.startswith("debootstrap"):
        build_base(args.base)
    start_s = start_cpu_s = None
    if "ebpf" in tracers and support.ebpf is not None:
        # once per process, before any command: not part of a command's cost
        start_s, start_cpu_s = (round(x, 3) for x in _start_tracer(support))
    rows: list[dict[str, Any]] = []
    on_committed = None
    with tempfile.TemporaryDirectory(prefix="aospec-bench-readsets-") as tmp:
        staged = stage(trajs, Path(tmp))
        for t in trajs:
            print(f"{t.id} ...", file=sys.stderr, flush=True)
            rows += anyio.run(measure, t, staged, args.base, args.reps, tracers)
        if args.committed:
            on_committed = measure_committed(trajs, staged, args.base, args.reps, support, args.calls)
    by = {
        tr: {
            "tasks": [summarize([r for r in rows if r["task"] == t.task], t.task, tr) for t in trajs],
            "all": summarize(rows, "all", tr),
        }
        for tr in tracers
    }
    first = tracers[0]
    doc = {
        "tracer": support.detail if first == support.kind else f"on: {first}",
        "tracers": tracers,
        "reps": args.reps,
        "ebpf_start_s": start_s,
        "ebpf_start_cpu_s": start_cpu_s,
        "committed": on_committed,
        "tasks": by[first]["tasks"],
        "all": by[first]["all"],
        "by_tracer": by,
        "steps": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"tracers: {', '.join(tracers)} ({support.detail}); medians of {args.reps} runs per command and kind")
    if start_s is not None:
        print(
            f"the eBPF tracer started in {start_s:.1f} s, using {start_cpu_s:.1f} s of CPU"
            " (once per process, not counted above)"
        )
    head = (
        "tracer",
        "what",
        "cmds",
        "plain",
        "traced",
        "wall +",
        "CPU plain",
        "CPU traced",
        "CPU +",
        "read_set",
        "lines",
    )
    print(f"{head[0]:>8}  {head[1]:<20}" + "".join(f"{h:>12}" for h in head[2:]))
    for tr in tracers:
        for s in [*by[tr]["tasks"], by[tr]["all"]]:
            print(
                f"{tr:>8}  {s['what']:<20}{s['commands']:>12}{s['plain_s']:>11.2f}s{s['traced_s']:>11.2f}s"
                f"{s['wall_overhead']:>12.1%}{s['plain_cpu_s']:>11.2f}s{s['traced_cpu_s']:>11.2f}s"
                f"{s['cpu_overhead']:>12.1%}{s['read_set_s']:>11.2f}s{s['trace_lines']:>12}"
            )
    if on_committed is not None:
        print(
            f"\nwhat the running eBPF tracer costs what it does not trace (medians of {args.reps} runs"
            f" per state, alternating; range in brackets):"
        )
        print(f"{'':<28}{'stopped':>26}{'running':>26}{'+':>9}")
        for c in on_committed["rows"]:
            cells = [f"{c[k]:.2f} [{c[k + '_range'][0]:.2f}-{c[k + '_range'][1]:.2f}]" for k in ("off", "on")]
            print(f"{c['what']:<28}{cells[0]:>26}{cells[1]:>26}{c['overhead']:>9.1%}")
        for st in on_committed["starts"]:
            print(f"bpftrace started again: {st['wall_s']:.1f} s, {st['cpu_s']:.1f} s of CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
