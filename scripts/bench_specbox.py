"""Loopback load on the prewarm pool (specbox/pool.py) under its policies.

Sessions arrive at a fixed QPS; each replays the tool calls of one recorded trace (the
bundled tb1 sample and the tau-bench airline traces, alternating). A call's decode takes
its recorded model latency (else its stream's tokens x --tpot-ms), times --time-scale,
capped at --max-decode-s; the ParseRouter is fed the call's real stream and, under the
speculative policy, its first event warms that tool's environment at the same fraction of
the decode. Then the call acquires an environment of its tool type, makes one request
and releases it. Tool types: the --types most frequent call labels, the rest "other".

Every tool type is a real process. ``--env mcp`` (the default): a real MCP server
(``aospec.specbox._mcp_tool_server``, started by the official SDK's stdio client, initialized
and listed) that imports --imports at start (default numpy and scipy.stats); a call is
``lookup``, and one call in --large-every ``produce(--large-bytes)``, whose output
travels out of band (aospec.specbox.transport) and is read through once by the caller.
``--env demo``: the earlier stand-in (``aospec.specbox._demo_tool``: a --cold-s sleep plus
--ballast-mb of resident memory, one JSON object per line).

Policies: ``reserved`` (--reserved per type kept warm), ``on-demand``, ``speculative``
(router-event warm-ups, up to --max-warm idle or starting per type), ``speculative-floor``
(the same plus a floor of --floor warm per type) and ``speculative-markov`` (floor,
router, and at the end of each call, i.e. the start of the next decode, a warm-up of the
next tools the Markov prefetcher predicts with probability >= --markov-tau, at most --markov-budget). Sessions are the
held-out half of each set's tasks (``training.split_by_task``, seed 0); the prefetcher is
fitted on the other half. Every policy runs under the same host budget (--max-envs live
environments), start concurrency (--start-concurrency starts in flight, default the
cores) and idle timeout (--idle-s; reserved and floor environments are never evicted
below their number). A run's arrivals last --duration-s; calls still in flight
--drain-s after the last arrival are cut off and counted as *censored* (their time so far
enters the percentiles, which are then lower bounds).

Measured per (policy, QPS): P50/P99 time until the tool's environment is ready (from the
end of the decode) and end-to-end per call, cumulative provisioning time, peak RSS of the
environments' process trees (sampled every --sample-ms, and at each on-demand acquire),
hits, warm waits, cold starts and handoffs (an acquire that waited for a start took a
released environment; of the starts given up, those dropped while still queued and those
stopped as soon as they were up), wasted warm-ups, the most starts in flight and the time starts
queued for a slot, and the load average before and after.

    nice python scripts/bench_specbox.py --quick --out results/specbox.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aospec.replay import bundled_traces_path, load_traces
from aospec.specbox.markov import MarkovPrefetcher
from aospec.specbox.pool import EnvironmentPool, EnvSpec, demo_tool_spec
from aospec.specbox.routers import (
    NON_CALLS,
    ParseRouter,
    step_stream,
    tool_label,
)
from aospec.training.dataset import split_by_task

TAU = Path("/work/shared/traces/tau-bench-gpt-4o-airline")


@dataclass
class Call:
    label: str
    decode_s: float
    fire_frac: float | None  # where the router fired this label, as a fraction of the decode
    history: tuple[str, ...] = ()  # the trace's step labels before this call (Markov context)


def load_sessions(args: argparse.Namespace) -> tuple[list[list[Call]], MarkovPrefetcher]:
    """The replayed sessions (the held-out half of each set's tasks) and a Markov prefetcher
    fitted on the other half (never on what is replayed)."""
    paths = [bundled_traces_path()]
    if TAU.exists():
        paths.append(TAU)
    sets = [load_traces([p]) for p in paths]
    router = ParseRouter()
    markov = MarkovPrefetcher(lam=0.0, tau=args.markov_tau, budget=args.markov_budget)
    out: list[list[Call]] = []
    for all_traces in sets:
        train, traces, _ = split_by_task(all_traces, eval_fraction=0.5, seed=0)
        markov.fit(train)
        for trace in traces:
            calls: list[Call] = []
            labels: list[str] = []
            for step in trace.steps:
                label = tool_label(step.action)
                labels.append(label)
                if label in NON_CALLS:
                    continue
                deltas = step_stream(step)
                session = router.session()
                frac = None
                for i, d in enumerate(deltas):
                    if any(e.tool == label for e in session.feed(d)):
                        frac = (i + 1) / max(len(deltas), 1)
                        break
                decode = step.model_latency_s or len(deltas) * args.tpot_ms / 1000
                calls.append(Call(label, min(decode * args.time_scale, args.max_decode_s), frac, tuple(labels[:-1])))
                if len(calls) >= args.calls:
                    break
            if calls:
                out.append(calls)
    # alternate the sets' sessions
    random.Random(0).shuffle(out)
    return out, markov


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def make_specs(policy: str, names: list[str], args: argparse.Namespace) -> list[EnvSpec]:
    kw: dict[str, Any] = {"reserved": args.reserved, "max_warm": args.max_warm}
    if policy in ("speculative-floor", "speculative-markov"):
        kw["floor"] = args.floor
    base = "speculative" if policy.startswith("speculative") else policy
    if args.env == "demo":
        ballast = 16 if args.ballast_mb is None else args.ballast_mb
        return [demo_tool_spec(n, startup_s=args.cold_s, ballast_mb=ballast, policy=base, **kw) for n in names]  # type: ignore[arg-type]
    from aospec.specbox.mcp_env import mcp_tool_server_spec

    imports = [m for m in args.imports.split(",") if m]
    return [
        mcp_tool_server_spec(n, imports=imports, ballast_mb=args.ballast_mb or 0, policy=base, errlog=sys.stderr, **kw)  # type: ignore[arg-type]
        for n in names
    ]


def loadavg() -> list[float]:
    return list(os.getloadavg())


async def run_one(
    policy: str,
    qps: float,
    sessions: list[list[Call]],
    types: list[str],
    args: argparse.Namespace,
    markov: MarkovPrefetcher,
) -> dict[str, Any]:
    def tool_of(label: str) -> str:
        return label if label in types else "other"

    names = [*types, "other"]
    specs = make_specs(policy, names, args)
    load_before = loadavg()
    ready: list[float] = []
    e2e: list[float] = []
    decode: list[float] = []
    call_s: list[float] = []
    in_flight: dict[int, float] = {}
    large = 0
    peak_rss = 0
    n_sessions = max(1, int(qps * args.duration_s))
    chosen = [sessions[i % len(sessions)] for i in range(n_sessions)]
    async with EnvironmentPool(
        specs, idle_timeout_s=args.idle_s, max_envs=args.max_envs, start_concurrency=args.start_concurrency
    ) as pool:
        warm_target = sum(s.kept_warm for s in specs)
        if warm_target:
            await pool.wait_until(lambda: pool.count(state="idle") >= warm_target, 600)

        async def sample() -> None:
            nonlocal peak_rss
            while True:
                peak_rss = max(peak_rss, pool.rss_bytes())
                await anyio.sleep(args.sample_ms / 1000)

        async def one_call(k: int, call: Call, n: int) -> None:
            nonlocal peak_rss
            tool = tool_of(call.label)
            t0 = time.perf_counter()
            in_flight[n] = t0
            if policy == "speculative-markov":  # the previous call has ended: its likely successors
                for label, _ in markov.prefetch(call.history):
                    pool.warm_nowait(tool_of(label))
            if policy.startswith("speculative") and call.fire_frac is not None:
                await anyio.sleep(call.decode_s * call.fire_frac)
                pool.warm_nowait(tool)
                await anyio.sleep(call.decode_s * (1 - call.fire_frac))
            else:
                await anyio.sleep(call.decode_s)
            t1 = time.perf_counter()
            env = await pool.acquire(tool)
            t2 = time.perf_counter()
            if policy == "on-demand":  # short-lived environments: sample at their peak too
                peak_rss = max(peak_rss, pool.rss_bytes())
            try:
                await use(env, k, n, call)
                t3 = time.perf_counter()  # the result is in hand; stopping an on-demand server is not the caller's wait
            finally:
                releases.start_soon(pool.release, env)
            del in_flight[n]
            ready.append(t2 - t1)
            e2e.append(t3 - t0)
            decode.append(t1 - t0)
            call_s.append(t3 - t2)

        async def use(env: Any, k: int, n: int, call: Call) -> None:
            nonlocal large
            if args.env == "demo":
                await env.value.call(call.label, {"k": k}, id=k)
            elif args.large_every and n % args.large_every == 0:
                with await env.value.call("produce", {"size": args.large_bytes, "seed": k}) as out:
                    assert out.artifact is not None and out.size == args.large_bytes
                    out.view[::4096].tobytes()  # read it through (one byte a page)
                large += 1
            else:
                with await env.value.call("lookup", {"key": call.label}) as out:
                    assert not out.is_error

        counter = iter(range(1 << 30))
        active = 0

        async def session(calls: list[Call]) -> None:
            nonlocal active
            active += 1
            try:
                for k, call in enumerate(calls):
                    await one_call(k, call, next(counter))
            finally:
                active -= 1

        async with anyio.create_task_group() as releases, anyio.create_task_group() as outer:
            outer.start_soon(sample)
            async with anyio.create_task_group() as tg:
                for calls in chosen:
                    tg.start_soon(session, calls)
                    await anyio.sleep(1 / qps)
                with anyio.move_on_after(args.drain_s):
                    while active:
                        await anyio.sleep(0.05)
                censored_at = time.perf_counter()
                censored = [censored_at - t0 for t0 in in_flight.values()]
                tg.cancel_scope.cancel()
            outer.cancel_scope.cancel()
        stats = pool.stats.to_json()
    e2e_all = e2e + censored
    return {
        "policy": policy,
        "qps": qps,
        "sessions": n_sessions,
        "calls": len(ready),
        "censored": len(censored),
        "large_calls": large,
        "ready_p50_ms": round(pct(ready, 0.5) * 1000, 1),
        "ready_p99_ms": round(pct(ready + censored, 0.99) * 1000, 1),
        "e2e_p50_ms": round(pct(e2e_all, 0.5) * 1000, 1),
        "e2e_p99_ms": round(pct(e2e_all, 0.99) * 1000, 1),
        "e2e_mean_ms": round(statistics.fmean(e2e_all) * 1000, 1) if e2e_all else None,
        "decode_p50_ms": round(pct(decode, 0.5) * 1000, 1),
        "call_p50_ms": round(pct(call_s, 0.5) * 1000, 1),
        "call_p99_ms": round(pct(call_s, 0.99) * 1000, 1),
        "provisioning_s": round(stats["provisioning_s"], 2),
        "peak_rss_mb": round(peak_rss / 2**20, 1),
        "peak_live": stats["peak_live"],
        "hits": stats["hits"],
        "warm_waits": stats["warm_waits"],
        "cold_starts": stats["cold_starts"],
        "handoffs": stats["handoffs"],
        "unclaimed_starts": stats["unclaimed_starts"],
        "starts_dropped": stats["starts_dropped"],
        "unclaimed_stopped": stats["unclaimed_stopped"],
        "start_concurrency": pool.start_concurrency,
        "peak_starts_in_flight": stats["peak_starts_in_flight"],
        "start_queue_s": round(stats["start_queue_s"], 2),
        "warm_ups": stats["warm_ups"],
        "wasted_warm_ups": stats["wasted_warm_ups"],
        "evictions": stats["evictions"],
        "cold_start_cost_ms": {n: round((pool.cold_start_cost(n) or 0) * 1000, 1) for n in names},
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in results):
        rs = sorted((r for r in results if r["policy"] == policy), key=lambda r: r["qps"])
        for ax, key in zip(axes, ("e2e_p99_ms", "ready_p99_ms"), strict=True):
            ax.plot([r["qps"] for r in rs], [r[key] / 1000 for r in rs], marker="o", label=policy)
    for ax, title in zip(axes, ("end-to-end P99 (s)", "time until ready P99 (s)"), strict=True):
        ax.set_xlabel("QPS (sessions/s)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the results as one JSON document")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here and the P99 plot next to it (.png)")
    p.add_argument("--quick", action="store_true", help="QPS 1, 5, 10 for 6 s of arrivals each")
    p.add_argument("--qps", type=float, nargs="*", default=None)
    p.add_argument(
        "--policies",
        nargs="*",
        default=["reserved", "on-demand", "speculative", "speculative-floor", "speculative-markov"],
    )
    p.add_argument("--env", choices=["mcp", "demo"], default="mcp", help="real MCP servers, or the stand-in")
    p.add_argument("--duration-s", type=float, default=None, help="seconds of arrivals per run")
    p.add_argument("--drain-s", type=float, default=60.0, help="cut-off for calls after the last arrival")
    p.add_argument("--calls", type=int, default=3, help="calls per session (first N of a trace)")
    p.add_argument("--types", type=int, default=6, help="tool types (most frequent labels) + other")
    p.add_argument("--imports", default="numpy,scipy.stats", help="modules the MCP server imports at start")
    p.add_argument("--large-every", type=int, default=10, help="every Nth MCP call produces a large output")
    p.add_argument("--large-bytes", type=int, default=4 << 20)
    p.add_argument("--cold-s", type=float, default=0.5, help="the stand-in's simulated import time (demo)")
    p.add_argument("--ballast-mb", type=int, default=None, help="resident ballast (default 16 demo, 0 mcp)")
    p.add_argument("--reserved", type=int, default=2, help="environments kept warm per type (reserved)")
    p.add_argument("--markov-tau", type=float, default=0.3, help="prefetch threshold (speculative-markov)")
    p.add_argument("--markov-budget", type=int, default=2, help="tools prefetched at most (speculative-markov)")
    p.add_argument("--max-warm", type=int, default=2, help="idle or starting per type a warm-up may bring about")
    p.add_argument("--floor", type=int, default=1, help="environments kept warm per type (speculative-floor)")
    p.add_argument("--max-envs", type=int, default=48, help="live environments at most (every policy)")
    p.add_argument(
        "--start-concurrency", type=int, default=None, help="starts in flight at most (every policy; default: cores)"
    )
    p.add_argument("--idle-s", type=float, default=2.0, help="idle eviction above the kept-warm number")
    p.add_argument("--sample-ms", type=float, default=100.0, help="RSS sampling period")
    p.add_argument("--tpot-ms", type=float, default=20.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-decode-s", type=float, default=3.0)
    args = p.parse_args(argv)
    qps = args.qps or ([1.0, 5.0, 10.0] if args.quick else [1.0, 5.0, 10.0, 20.0])
    if args.duration_s is None:
        args.duration_s = 6.0 if args.quick else 20.0
    sessions, markov = load_sessions(args)
    counts = Counter(c.label for s in sessions for c in s)
    types = [label for label, _ in counts.most_common(args.types)]
    results = []
    for q in qps:
        for policy in args.policies:
            r = anyio.run(run_one, policy, q, sessions, types, args, markov)
            results.append(r)
            if not args.json:
                print(json.dumps(r), flush=True)
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"},
        "cpus": os.cpu_count(),
        "sessions_available": len(sessions),
        "tool_types": [*types, "other"],
        "router_fired_share": round(
            sum(c.fire_frac is not None for s in sessions for c in s) / max(1, sum(counts.values())), 3
        ),
        "results": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        plot(results, args.out.with_suffix(".png"))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
