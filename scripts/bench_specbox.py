"""Loopback load on the prewarm pool (specbox/pool.py) under its three policies.

Sessions arrive at a fixed QPS; each replays the tool calls of one recorded trace (the
bundled tb1 sample and the tau-bench airline traces, alternating). A call's decode takes
its recorded model latency (else its stream's tokens x --tpot-ms), times --time-scale,
capped at --max-decode-s; the ParseRouter is fed the call's real stream and, under the
speculative policy, its first event warms that tool's environment at the same fraction of
the decode. Then the call acquires an environment of its tool type, makes one request
and releases it. Tool types: the --types most frequent call labels, the rest "other".

Every tool type is a real process: ``specbox._demo_tool``, a *stand-in* for an MCP server
whose cold start is importing heavy modules (a --cold-s sleep plus --ballast-mb of
resident memory). Measured per (policy, QPS): P50/P99 time until the tool's environment
is ready (from the end of the decode) and end-to-end per call, cumulative provisioning
time, peak RSS of the environments (sampled every 50 ms), hits, cold starts and wasted
warm-ups.

    nice python scripts/bench_specbox.py --quick --json
"""

from __future__ import annotations

import argparse
import json
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

from replay import bundled_traces_path, load_traces
from specbox.pool import EnvironmentPool, demo_tool_spec
from specbox.routers import (
    NON_CALLS,
    ParseRouter,
    step_stream,
    tool_label,
)

TAU = Path("/work/shared/traces/tau-bench-gpt-4o-airline")


@dataclass
class Call:
    label: str
    decode_s: float
    fire_frac: float | None  # where the router fired this label, as a fraction of the decode


def load_sessions(args: argparse.Namespace) -> list[list[Call]]:
    paths = [bundled_traces_path()]
    if TAU.exists():
        paths.append(TAU)
    sets = [load_traces([p]) for p in paths]
    router = ParseRouter()
    out: list[list[Call]] = []
    for traces in sets:
        for trace in traces:
            calls: list[Call] = []
            for step in trace.steps:
                label = tool_label(step.action)
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
                calls.append(Call(label, min(decode * args.time_scale, args.max_decode_s), frac))
                if len(calls) >= args.calls:
                    break
            if calls:
                out.append(calls)
    # alternate the sets' sessions
    random.Random(0).shuffle(out)
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_one(
    policy: str, qps: float, sessions: list[list[Call]], types: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    def tool_of(label: str) -> str:
        return label if label in types else "other"

    names = [*types, "other"]
    specs = [
        demo_tool_spec(
            n, startup_s=args.cold_s, ballast_mb=args.ballast_mb, policy=policy, reserved=args.reserved, max_warm=2
        )
        for n in names
    ]
    ready: list[float] = []
    e2e: list[float] = []
    decode: list[float] = []
    call_s: list[float] = []
    peak_rss = 0
    n_sessions = max(1, int(qps * args.duration_s))
    chosen = [sessions[i % len(sessions)] for i in range(n_sessions)]
    async with EnvironmentPool(specs, idle_timeout_s=args.idle_s if policy == "speculative" else None) as pool:
        if policy == "reserved":
            await pool.wait_until(lambda: pool.count(state="idle") >= len(names) * args.reserved, 120)

        async def sample() -> None:
            nonlocal peak_rss
            while True:
                peak_rss = max(peak_rss, pool.rss_bytes())
                await anyio.sleep(0.05)

        async def session(calls: list[Call]) -> None:
            for k, call in enumerate(calls):
                tool = tool_of(call.label)
                t0 = time.perf_counter()
                if policy == "speculative" and call.fire_frac is not None:
                    await anyio.sleep(call.decode_s * call.fire_frac)
                    pool.warm_nowait(tool)
                    await anyio.sleep(call.decode_s * (1 - call.fire_frac))
                else:
                    await anyio.sleep(call.decode_s)
                t1 = time.perf_counter()
                env = await pool.acquire(tool)
                t2 = time.perf_counter()
                nonlocal peak_rss
                peak_rss = max(peak_rss, pool.rss_bytes())  # short-lived (on-demand) environments too
                try:
                    await env.value.call(call.label, {"k": k}, id=k)
                finally:
                    await pool.release(env)
                t3 = time.perf_counter()
                ready.append(t2 - t1)
                e2e.append(t3 - t0)
                decode.append(t1 - t0)
                call_s.append(t3 - t2)

        async with anyio.create_task_group() as outer:
            outer.start_soon(sample)
            async with anyio.create_task_group() as tg:
                for calls in chosen:
                    tg.start_soon(session, calls)
                    await anyio.sleep(1 / qps)
            outer.cancel_scope.cancel()
        stats = pool.stats.to_json()
    return {
        "policy": policy,
        "qps": qps,
        "sessions": n_sessions,
        "calls": len(ready),
        "ready_p50_ms": round(pct(ready, 0.5) * 1000, 1),
        "ready_p99_ms": round(pct(ready, 0.99) * 1000, 1),
        "e2e_p50_ms": round(pct(e2e, 0.5) * 1000, 1),
        "e2e_p99_ms": round(pct(e2e, 0.99) * 1000, 1),
        "e2e_mean_ms": round(statistics.fmean(e2e) * 1000, 1) if e2e else None,
        "decode_p50_ms": round(pct(decode, 0.5) * 1000, 1),
        "call_p50_ms": round(pct(call_s, 0.5) * 1000, 1),
        "call_p99_ms": round(pct(call_s, 0.99) * 1000, 1),
        "provisioning_s": round(stats["provisioning_s"], 2),
        "peak_rss_mb": round(peak_rss / 2**20, 1),
        "hits": stats["hits"],
        "warm_waits": stats["warm_waits"],
        "cold_starts": stats["cold_starts"],
        "warm_ups": stats["warm_ups"],
        "wasted_warm_ups": stats["wasted_warm_ups"],
        "evictions": stats["evictions"],
        "cold_start_cost_ms": {n: round((pool.cold_start_cost(n) or 0) * 1000, 1) for n in names},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="QPS 1, 5, 10 for 6 s each (about 2 minutes)")
    p.add_argument("--qps", type=float, nargs="*", default=None)
    p.add_argument("--policies", nargs="*", default=["reserved", "on-demand", "speculative"])
    p.add_argument("--duration-s", type=float, default=None, help="seconds of arrivals per run")
    p.add_argument("--calls", type=int, default=3, help="calls per session (first N of a trace)")
    p.add_argument("--types", type=int, default=6, help="tool types (most frequent labels) + other")
    p.add_argument("--cold-s", type=float, default=0.5, help="the stand-in server's simulated import time")
    p.add_argument("--ballast-mb", type=int, default=16)
    p.add_argument("--reserved", type=int, default=2, help="environments kept warm per type (reserved)")
    p.add_argument("--idle-s", type=float, default=2.0, help="idle eviction (speculative)")
    p.add_argument("--tpot-ms", type=float, default=20.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-decode-s", type=float, default=3.0)
    args = p.parse_args(argv)
    qps = args.qps or ([1.0, 5.0, 10.0] if args.quick else [1.0, 5.0, 10.0, 20.0])
    if args.duration_s is None:
        args.duration_s = 6.0 if args.quick else 20.0
    sessions = load_sessions(args)
    counts = Counter(c.label for s in sessions for c in s)
    types = [label for label, _ in counts.most_common(args.types)]
    results = []
    for q in qps:
        for policy in args.policies:
            r = anyio.run(run_one, policy, q, sessions, types, args)
            results.append(r)
            if not args.json:
                print(json.dumps(r), flush=True)
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "sessions_available": len(sessions),
        "tool_types": [*types, "other"],
        "router_fired_share": round(
            sum(c.fire_frac is not None for s in sessions for c in s) / max(1, sum(counts.values())), 3
        ),
        "results": results,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
