"""Driver memory of a sweep against its size: streamed (what ``aospec sweep`` does) vs in memory.

A synthetic sweep: the bundled tb1 sample's ten traces repeated with distinct ids up to N
evaluation traces, drafters fit on the sample itself (``--train``: one fit per worker, so
the sweep's cost is the replays), replayed under ``--policies`` at ``--tpots`` by ``--jobs``
local worker processes. Each (mode, N) runs in a fresh interpreter, whose peak RSS
(``ru_maxrss`` of the driver alone: worker processes are not counted) is reported with the
RSS once the traces are built, so the growth is the sweep's own:

- ``stream``: :func:`aospec.replay.sweep.iter_sweep` into :class:`aospec.replay.report.ResultsFile`
  (appended and flushed per trace, sorted at the end from the file), then
  :func:`aospec.replay.metrics.summarize` over :func:`aospec.replay.report.read_results`, as
  ``aospec sweep`` does (plots aside).
- ``memory``: :func:`aospec.replay.sweep.run_sweep` (every result in a list), summarize, write
  results.jsonl: the pre-streaming path.

The copies share their steps with the ten originals, so the figures isolate what the
sweep keeps per trace; ``--distinct`` loads every copy afresh from the files instead, to show what the
loaded traces themselves cost when every evaluation trace is loaded in the driver.
``--files`` writes the N copies as N files and sweeps them, the traces loaded in the driver
(mode ``traces``: the CLI before evaluation traces travelled as references) or kept as
:class:`aospec.replay.sweep.TraceRef` (mode ``refs``: what ``aospec sweep`` does; the workers read
each trace when they replay it).

    python scripts/bench_sweep_memory.py --traces 500,1000,2000 --jobs 2
    python scripts/bench_sweep_memory.py --traces 1000 --modes stream --json
    python scripts/bench_sweep_memory.py --records 100000       # bytes per record, no replay
    python scripts/bench_sweep_memory.py --files --modes traces,refs --traces 2000 --policies serial
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(
    mode: str, n: int, policies_text: str, tpots: list[float], jobs: int, distinct: bool, files: str = ""
) -> dict[str, object]:
    from aospec.replay import bundled_traces_path, load_traces
    from aospec.replay.executors import local_executor
    from aospec.replay.metrics import summarize
    from aospec.replay.policies import parse_policies
    from aospec.replay.report import ResultsFile, read_results
    from aospec.replay.sweep import iter_sweep, run_sweep

    sample = load_traces([bundled_traces_path()])
    policies = parse_policies(policies_text)
    before = _rss_mb()
    traces: list = []
    if files:  # N distinct trace files on disk, as `aospec sweep DIR` reads them
        if mode == "refs":  # what `aospec sweep` keeps: one TraceRef per trace, steps read by the workers
            from aospec.replay.io import import_traces
            from aospec.replay.sweep import TraceRef

            traces = list(import_traces([files], keep=TraceRef.of).traces)
        else:  # every trace loaded in the driver (the CLI before TraceRef)
            traces = load_traces([files])
    for k in range(0 if files else n):
        if distinct and k % len(sample) == 0:
            fresh = load_traces([bundled_traces_path()])  # new objects, as loading N files makes
        t = (fresh if distinct else sample)[k % len(sample)]
        traces.append(dataclasses.replace(t, id=f"{t.id}~{k // len(sample)}"))
    baseline = _rss_mb()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        executor = local_executor(jobs)
        if mode != "memory":
            with ResultsFile(Path(out) / "results.jsonl") as f:
                for index, results in iter_sweep(
                    traces, policies, train_traces=sample, tpots_ms=tpots, executor=executor
                ):
                    f.add(index, results)
                path = f.finish()
            summaries = summarize(read_results(path))
            records = f.records
        else:
            results = run_sweep(traces, policies, train_traces=sample, tpots_ms=tpots, executor=executor)
            summaries = summarize(results)
            path = Path(out) / "results.jsonl"
            with path.open("w", encoding="utf-8") as g:
                for r in results:
                    g.write(json.dumps(r.to_json()) + "\n")
            records = len(results)
        size = path.stat().st_size
    return {
        "mode": mode,
        "traces": n,
        "records": records,
        "distinct_traces": distinct or bool(files),
        "jobs": jobs,
        "traces_rss_mb": round(baseline - before, 1),
        "baseline_rss_mb": round(baseline, 1),
        "peak_rss_mb": round(_peak_mb(), 1),
        "growth_mb": round(_peak_mb() - baseline, 1),
        "results_jsonl_mb": round(size / 2**20, 1),
        "wall_s": round(time.perf_counter() - started, 1),
        "mean_saving_aospec": next((s.mean_saving for s in summaries if s.policy != "serial"), None),
    }


def per_record(n: int) -> dict[str, object]:
    """Driver memory per result record, without replaying: ``n`` TraceResults (ten per
    trace id, distinct numbers) held in a list (the in-memory path) vs what the streamed
    path keeps of them (the summary's accumulators and the results file's offsets)."""
    import random

    from aospec.replay.metrics import _Group
    from aospec.replay.sweep import TraceResult

    rng = random.Random(0)

    def record(i: int) -> TraceResult:
        ns = [rng.randrange(10**9, 10**12) for _ in range(9)]
        return TraceResult(
            trace_id=f"task-{i // 100:05d}.{i // 10:07d}.2025-08-07__20-46-16", task=f"task-{i // 100:05d}",
            policy="aospec", tpot_ms=10.0, steps=20, actions_executed=19, serial_ns=ns[0], latency_ns=ns[1],
            decode_ns=ns[2], tool_ns=ns[3], wait_actor_ns=ns[4], wait_tool_ns=ns[5], ceiling_ns=ns[6],
            forks_launched=i % 97, forks_reused=i % 13, forks_wasted=i % 89, drafts_started=i % 71, drafts_hit=i % 7,
            wasted_tool_ns=ns[7], wasted_decode_ns=ns[8], unknown_tool_steps=0,
        )

    before = _rss_mb()
    held = [record(i) for i in range(n)]
    in_memory = _rss_mb() - before
    del held
    before = _rss_mb()
    group, spans = _Group(), {}
    for i in range(n):
        group.add(record(i))
        if i % 10 == 0:
            spans[i // 10] = (i * 700, 7000)
    streamed = _rss_mb() - before
    return {
        "records": n,
        "in_memory_mb": round(in_memory, 1),
        "streamed_mb": round(streamed, 1),
        "in_memory_bytes_per_record": round(in_memory * 2**20 / n),
        "streamed_bytes_per_record": round(streamed * 2**20 / n),
    }


def _write_files(out: Path, n: int) -> None:
    """N copies of the bundled sample's traces, one file each, with distinct ids."""
    from aospec.replay import bundled_traces_path, load_traces
    from aospec.replay.io import write_jsonl

    sample = load_traces([bundled_traces_path()])
    for k in range(n):
        t = sample[k % len(sample)]
        write_jsonl([dataclasses.replace(t, id=f"{t.id}~{k // len(sample)}")], out / f"{k:06d}.jsonl")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="500,1000,2000", help="comma-separated sweep sizes (evaluation traces)")
    ap.add_argument("--modes", default="stream,memory", help="stream, memory or both (comma-separated)")
    ap.add_argument("--policies", default="serial,aospec")
    ap.add_argument("--tpots", default="10", help="comma-separated ms per output token")
    ap.add_argument("--jobs", type=int, default=2, help="local worker processes (1: in the driver itself)")
    ap.add_argument("--distinct", action="store_true", help="deep-copy every trace (their own memory counts)")
    ap.add_argument("--files", action="store_true",
                    help="write N distinct trace files (one per trace) to a temporary directory and sweep them; "
                    "modes: traces (all loaded in the driver, as before TraceRef) and refs (what aospec sweep does)")
    ap.add_argument("--files-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON array")
    ap.add_argument("--records", type=int, default=0, metavar="N",
                    help="only measure N result records held in memory vs streamed (no replay)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    tpots = [float(x) for x in args.tpots.split(",") if x.strip()]
    if args.records:
        row = per_record(args.records)
        print(json.dumps(row) if args.json else "  ".join(f"{k} {v}" for k, v in row.items()))
        return 0
    if args.child:
        row = child(args.child[0], int(args.child[1]), args.policies, tpots, args.jobs, args.distinct, args.files_dir)
        print(json.dumps(row))
        return 0
    rows = []
    for n in [int(x) for x in args.traces.split(",") if x.strip()]:
        tmp = tempfile.TemporaryDirectory() if args.files else None
        if tmp is not None:
            _write_files(Path(tmp.name), n)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            cmd = [sys.executable, __file__, "--child", mode, str(n), "--policies", args.policies,
                   "--tpots", args.tpots, "--jobs", str(args.jobs)]
            if args.distinct:
                cmd.append("--distinct")
            if tmp is not None:
                cmd += ["--files-dir", tmp.name]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            if not args.json:
                print(
                    f"{row['mode']:>6}  traces {row['traces']:>6}  records {row['records']:>7}  "
                    f"traces RSS {row['traces_rss_mb']:>7.1f} MB  baseline {row['baseline_rss_mb']:>7.1f} MB  "
                    f"peak {row['peak_rss_mb']:>7.1f} MB  growth {row['growth_mb']:>6.1f} MB  "
                    f"results.jsonl {row['results_jsonl_mb']:>6.1f} MB  {row['wall_s']:>6.1f} s",
                    flush=True,
                )
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
