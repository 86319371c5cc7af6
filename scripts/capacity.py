#!/usr/bin/env python3
"""Capacity on paper, backed by the ledger (issue 14, section 3).

Replays traces (the bundled tb1 sample by default) under the ``aospec`` policy at a default
and a lean engine configuration, in virtual time, with the engine unchanged and three
counters around it: live speculative forks over (virtual) time, drafter calls, and the
engine's own statistics (forks launched, continuations started, tool and decode time,
wasted or not). Per session that gives rates; times N concurrent sessions, the forks,
memory, CPU and drafter throughput the sandbox fleet and the drafter servers need:

    python scripts/capacity.py                      # table, bundled sample, TPOT 5 ms
    python scripts/capacity.py --json               # the same numbers as JSON
    python scripts/capacity.py --measure            # also measure an overlay fork here (root)
    python scripts/capacity.py --eval DIR --tpot 1 --sessions 1000,10000,100000

What is measured and what is assumed (each a flag):

- measured from the replay: steps per session-second, forks launched per step, mean and
  peak live forks per session, drafter calls per step (observation and action), tool
  CPU (committed + wasted tool time per session-second; a running tool is counted as one
  busy core, an upper bound since many tools wait on I/O), speculative decode overhead
  (wasted decode / committed decode: extra load on the *actor's* model server);
- measured on this host with ``--measure`` (else the figures recorded in docs/scale.md):
  kernel memory of an idle overlay fork (Slab + Shmem + page tables delta per fork) and
  of a session's committed root;
- assumed: resident memory of a command running in a fork (``--command-rss-mib``), tokens
  per LM drafter call (``--draft-tokens``) and one drafter server's throughput
  (``--server-tok-s``, tokens/s with batching), which give the drafter servers needed
  when the drafters are language models rather than the CPU-cheap pattern/cache/history
  drafters the default policy uses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Idle fork and session root cost measured on the development host (overlay, busybox
#: base, tmpfs uppers; ``scripts/capacity.py --measure``). Kernel memory only.
MEASURED_FORK_KIB = 5.0
MEASURED_ROOT_KIB = 132.0

CONFIGS = {
    "default": "aospec",
    "lean": "aospec:fork_width=2:depth=1:branch_budget=2:max_live_forks=4:draft_candidates=4",
}


@dataclass
class SessionLedger:
    """One trace replayed under one configuration: what the engine and the counters saw."""

    trace_id: str
    config: str
    steps: int
    latency_ns: int
    serial_ns: int
    forks_launched: int
    forks_reused: int
    drafts_started: int
    tool_ns: int
    wasted_tool_ns: int
    decode_ns: int
    wasted_decode_ns: int
    obs_calls: int = 0
    action_calls: int = 0
    draft_tokens: int = 0
    live_fork_ns: int = 0  # integral of live forks over virtual time
    peak_live_forks: int = 0


@dataclass
class _LiveCounter:
    clock: Any
    live: int = 0
    peak: int = 0
    area_ns: int = 0
    _last: int = 0

    def change(self, d: int) -> None:
        now = self.clock.now_ns()
        self.area_ns += self.live * (now - self._last)
        self._last = now
        self.live += d
        self.peak = max(self.peak, self.live)


class _CountedSandbox:
    """A replay sandbox whose forks (at any depth) are counted while they live."""

    def __init__(self, inner: Any, counter: _LiveCounter, is_fork: bool) -> None:
        self._inner, self._counter, self._is_fork, self._open = inner, counter, is_fork, True

    @property
    def version(self) -> str:
        return str(self._inner.version)

    async def execute(self, action: Any) -> str:
        return str(await self._inner.execute(action))

    async def fork(self) -> _CountedSandbox:
        child = _CountedSandbox(await self._inner.fork(), self._counter, True)
        self._counter.change(+1)
        return child

    def _closed(self) -> None:
        if self._is_fork and self._open:
            self._open = False
            self._counter.change(-1)

    async def commit(self, fork: _CountedSandbox) -> None:
        await self._inner.commit(fork._inner)
        fork._closed()

    async def discard(self) -> None:
        await self._inner.discard()
        self._closed()


class _CountedObs:
    """An observation drafter whose calls and drafted tokens are counted."""

    def __init__(self, inner: Any, ledger: SessionLedger) -> None:
        self._inner, self._ledger = inner, ledger

    async def draft(self, history: Any, action: Any, n: int) -> Any:
        self._ledger.obs_calls += 1
        out = await self._inner.draft(history, action, n)
        self._ledger.draft_tokens += sum(d.tokens for d in out)
        return out


class _CountedStreamingObs(_CountedObs):
    """The same for a streaming drafter (the engine prefers ``draft_stream`` when present)."""

    async def draft_stream(self, history: Any, action: Any, n: int) -> Any:
        self._ledger.obs_calls += 1
        async for batch in self._inner.draft_stream(history, action, n):
            self._ledger.draft_tokens += sum(d.tokens for d in batch)
            yield batch


def _counted_obs(inner: Any, ledger: SessionLedger) -> _CountedObs:
    return (_CountedStreamingObs if hasattr(inner, "draft_stream") else _CountedObs)(inner, ledger)


class _CountedActions:
    def __init__(self, inner: Any, ledger: SessionLedger) -> None:
        self._inner, self._ledger = inner, ledger

    async def propose(self, history: Any, width: int, depth: int) -> Any:
        self._ledger.action_calls += 1
        out = await self._inner.propose(history, width, depth)
        self._ledger.draft_tokens += sum(d.tokens for d in out)
        return out


def replay_ledgers(traces: Sequence[Any], policies: Sequence[Any], tpot_ms: float) -> list[SessionLedger]:
    """Every trace under every policy at ``tpot_ms``, in virtual time, with the counters."""
    import anyio
    from aospec.replay.actor import ReplayActor, VirtualClock, ms_to_ns
    from aospec.replay.policies import DrafterFailures
    from aospec.replay.sandbox import ReplayWorld
    from aospec.replay.sweep import SweepJob
    from trio.testing import MockClock

    from aospec.engine import Engine

    job = SweepJob(list(traces), None, list(policies), [tpot_ms], {})
    out: list[SessionLedger] = []

    async def one(i: int, policy: Any) -> SessionLedger:
        trace = traces[i]
        drafters = job.fold(i)
        clock = VirtualClock()
        actor = ReplayActor(trace, tpot_ns=ms_to_ns(tpot_ms), clock=clock)
        world = ReplayWorld(trace, clock)
        obs, act = drafters.charged(policy, clock, trace, actor, world, DrafterFailures())
        led = SessionLedger(trace.id, policy.name, len(trace), 0, 0, 0, 0, 0, 0, 0, 0, 0)
        counter = _LiveCounter(clock)
        evd = drafters.evd(policy.config.kernel) if obs and policy.engine.rank != "likelihood" else None
        engine = Engine(
            actor,
            _CountedSandbox(world.sandbox(), counter, False),
            observation_drafters=[_counted_obs(o, led) for o in obs],
            action_drafters=[_CountedActions(a, led) for a in act],
            evd=evd,
            config=policy.engine,
            clock=clock,
            keep_events=False,
        )
        await engine.run(trace.history(0), steps=len(trace))
        counter.change(0)
        st = engine.statistics()
        led.latency_ns, led.serial_ns = st.latency_ns, sum(actor.decode_ns) + sum(world.tool_ns)
        led.forks_launched, led.forks_reused, led.drafts_started = st.forks_launched, st.forks_reused, st.drafts_started
        led.tool_ns, led.wasted_tool_ns = st.tool_ns, st.wasted_tool_ns
        led.decode_ns, led.wasted_decode_ns = st.decode_ns, st.wasted_decode_ns
        led.live_fork_ns, led.peak_live_forks = counter.area_ns, counter.peak
        return led

    async def main() -> None:
        for i in range(len(traces)):
            for p in policies:
                out.append(await one(i, p))

    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    return out


@dataclass
class PerSession:
    """Rates of one average session (sums over traces: time-weighted)."""

    config: str
    engine: dict[str, Any]
    traces: int
    steps: int
    session_s: float
    steps_per_s: float
    forks_per_step: float
    forks_per_s: float
    mean_live_forks: float
    peak_live_forks: int
    drafter_calls_per_step: float
    drafter_calls_per_s: float
    tool_cores: float
    speculative_tool_share: float
    actor_decode_overhead: float
    saving: float


def per_session(ledgers: Sequence[SessionLedger], engine: dict[str, Any]) -> PerSession:
    lat = sum(x.latency_ns for x in ledgers)
    steps = sum(x.steps for x in ledgers)
    forks = sum(x.forks_launched for x in ledgers)
    calls = sum(x.obs_calls + x.action_calls for x in ledgers)
    tool = sum(x.tool_ns for x in ledgers)
    wasted = sum(x.wasted_tool_ns for x in ledgers)
    serial = sum(x.serial_ns for x in ledgers)
    s = lat * 1e-9
    return PerSession(
        config=ledgers[0].config,
        engine=engine,
        traces=len(ledgers),
        steps=steps,
        session_s=s / len(ledgers),
        steps_per_s=steps / s,
        forks_per_step=forks / steps,
        forks_per_s=forks / s,
        mean_live_forks=sum(x.live_fork_ns for x in ledgers) / lat,
        peak_live_forks=max(x.peak_live_forks for x in ledgers),
        drafter_calls_per_step=calls / steps,
        drafter_calls_per_s=calls / s,
        tool_cores=(tool + wasted) / lat,
        speculative_tool_share=wasted / max(1, tool + wasted),
        actor_decode_overhead=sum(x.wasted_decode_ns for x in ledgers) / max(1, sum(x.decode_ns for x in ledgers)),
        saving=1 - lat / serial if serial else 0.0,
    )


@dataclass
class Fleet:
    config: str
    sessions: int
    live_forks_mean: float
    live_forks_provisioned: int
    forks_per_s: float
    fork_memory_gib: float
    memory_gib: float
    cpu_cores: float
    drafter_calls_per_s: float
    drafter_tok_s: float
    drafter_servers: int
    notes: list[str] = field(default_factory=list)


def fleet(ps: PerSession, n: int, args: argparse.Namespace, fork_kib: float, root_kib: float) -> Fleet:
    """What ``n`` concurrent sessions like ``ps`` need."""
    mean_forks = ps.mean_live_forks * n
    # provision for every session at its peak at once would be absurd; a fleet sees the mean
    # plus a few standard deviations (Poisson: sqrt) -- and never more than max_live_forks each
    provisioned = min(n * ps.peak_live_forks, math.ceil(mean_forks + 4 * math.sqrt(mean_forks)))
    # a live fork holds its kernel structures, and while its command runs, the command's memory;
    # the share of forks running a command is the tool-core share spent in forks
    running = min(provisioned, math.ceil(ps.tool_cores * n))
    fork_mem = provisioned * fork_kib * 1024 + running * args.command_rss_mib * 2**20
    mem = fork_mem + n * (root_kib * 1024 + args.session_rss_mib * 2**20)
    calls = ps.drafter_calls_per_s * n
    tok = calls * args.draft_tokens
    servers = max(1, math.ceil(tok / args.server_tok_s))
    notes = []
    if servers > 1:
        notes.append(
            f"{ps.config}: one drafter server ({args.server_tok_s:,.0f} tok/s) saturates at {args.server_tok_s / max(1e-9, tok / n):,.0f} sessions"
        )
    return Fleet(
        config=ps.config,
        sessions=n,
        live_forks_mean=mean_forks,
        live_forks_provisioned=provisioned,
        forks_per_s=ps.forks_per_s * n,
        fork_memory_gib=fork_mem / 2**30,
        memory_gib=mem / 2**30,
        cpu_cores=ps.tool_cores * n,
        drafter_calls_per_s=calls,
        drafter_tok_s=tok,
        drafter_servers=servers,
        notes=notes,
    )


# ---------------------------------------------------------------------- measuring a fork here


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0])
    return out


def _kernel_kib(m: dict[str, int]) -> int:
    return m.get("Slab", 0) + m.get("Shmem", 0) + m.get("PageTables", 0)


def measure_fork(n: int = 64, rounds: int = 3) -> dict[str, float]:
    """Kernel memory (Slab + Shmem + PageTables, KiB) of an idle overlay session root and of
    an idle fork (``n`` forks at once), mounts per fork, and a fork's wall time (ms): the
    median of ``rounds`` (the host's other work moves these counters too)."""
    import statistics
    import time

    import anyio
    from aospec.runtime import open_sandbox

    from aospec.types import Action

    def mounts() -> int:
        return Path("/proc/self/mountinfo").read_text().count("\n")

    async def once() -> dict[str, float]:
        m0, n0 = _kernel_kib(_meminfo()), mounts()
        async with open_sandbox(backend="overlay", base="busybox") as sb:
            await sb.execute(Action.bash("echo x > /tmp/x"))
            m1, n1 = _kernel_kib(_meminfo()), mounts()
            t = time.perf_counter()
            forks = [await sb.fork() for _ in range(n)]
            fork_ms = (time.perf_counter() - t) * 1000 / n
            m2, n2 = _kernel_kib(_meminfo()), mounts()
            for f in forks:
                await f.discard()
        return {
            "root_kib": float(m1 - m0),
            "fork_kib": (m2 - m1) / n,
            "root_mounts": float(n1 - n0),
            "mounts_per_fork": (n2 - n1) / n,
            "fork_ms": fork_ms,
        }

    runs = [anyio.run(once) for _ in range(rounds)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["forks"] = float(n)
    out["rounds"] = float(rounds)
    return out


# ---------------------------------------------------------------------- CLI


def _load_traces(args: argparse.Namespace) -> list[Any]:
    from aospec.replay import load_traces

    if args.eval:
        traces: list[Any] = []
        for d in args.eval:
            traces += list(load_traces(d))
        return traces
    data = Path(__file__).resolve().parents[1] / "replay" / "data" / "tb1-sample"
    return list(load_traces(data))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--eval", action="append", help="trace directory (repeatable; default: the bundled tb1 sample)")
    p.add_argument("--tpot", type=float, default=5.0, help="actor ms per output token (default 5)")
    p.add_argument("--sessions", default="1000,10000", help="concurrent sessions to size for (default 1000,10000)")
    p.add_argument("--measure", action="store_true", help="measure an overlay fork's memory here (root, overlayfs)")
    p.add_argument(
        "--command-rss-mib",
        type=float,
        default=16.0,
        help="memory of a command running in a fork (assumed; default 16)",
    )
    p.add_argument(
        "--session-rss-mib", type=float, default=4.0, help="host memory per session outside forks (default 4)"
    )
    p.add_argument(
        "--draft-tokens",
        type=float,
        default=64.0,
        help="tokens per drafter call for an LM drafter (assumed; default 64)",
    )
    p.add_argument(
        "--server-tok-s",
        type=float,
        default=20000.0,
        help="one drafter server's batched throughput (assumed; default 20000 tok/s)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)

    from aospec.replay.policies import parse_policies

    sessions = [int(x) for x in str(args.sessions).split(",") if x]
    traces = _load_traces(args)
    policies = parse_policies(",".join(CONFIGS.values()))
    ledgers = replay_ledgers(traces, policies, args.tpot)
    runtime = (
        measure_fork()
        if args.measure
        else {"root_kib": MEASURED_ROOT_KIB, "fork_kib": MEASURED_FORK_KIB, "source": "recorded"}
    )
    fork_kib, root_kib = max(1.0, runtime["fork_kib"]), max(1.0, runtime["root_kib"])
    per: list[PerSession] = []
    fleets: list[Fleet] = []
    for (label, _), pol in zip(CONFIGS.items(), policies, strict=True):
        mine = [x for x in ledgers if x.config == pol.name]
        engine = {
            k: getattr(pol.engine, k)
            for k in ("fork_width", "depth", "branch_budget", "max_live_forks", "draft_candidates")
        }
        ps = per_session(mine, engine)
        ps.config = label
        per.append(ps)
        fleets += [fleet(ps, n, args, fork_kib, root_kib) for n in sessions]
    if args.json:
        json.dump(
            {
                "tpot_ms": args.tpot,
                "traces": len(traces),
                "runtime": runtime,
                "assumed": {
                    k: getattr(args, k) for k in ("command_rss_mib", "session_rss_mib", "draft_tokens", "server_tok_s")
                },
                "per_session": [asdict(x) for x in per],
                "fleet": [asdict(x) for x in fleets],
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    print(
        f"per session ({len(traces)} traces, TPOT {args.tpot:g} ms; fork {fork_kib:.0f} KiB, root {root_kib:.0f} KiB kernel memory)"
    )
    print(
        "| config | engine | steps/s | forks/step | forks/s | mean live forks | peak live forks | drafter calls/step | running commands | wasted tool share | extra actor decode | saving |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ps in per:
        eng = " ".join(f"{k}={v}" for k, v in ps.engine.items())
        print(
            f"| {ps.config} | {eng} | {ps.steps_per_s:.3f} | {ps.forks_per_step:.2f} | {ps.forks_per_s:.3f} | "
            f"{ps.mean_live_forks:.2f} | {ps.peak_live_forks} | {ps.drafter_calls_per_step:.2f} | {ps.tool_cores:.3f} | "
            f"{ps.speculative_tool_share:.0%} | {ps.actor_decode_overhead:.0%} | {ps.saving:.1%} |"
        )
    print()
    print(
        "| config | sessions | live forks (mean / provisioned) | forks/s | fork memory GiB | memory GiB | CPU cores (upper bound) | drafter calls/s | LM drafter tok/s | drafter servers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in fleets:
        print(
            f"| {f.config} | {f.sessions:,} | {f.live_forks_mean:,.0f} / {f.live_forks_provisioned:,} | {f.forks_per_s:,.0f} | "
            f"{f.fork_memory_gib:,.1f} | {f.memory_gib:,.1f} | {f.cpu_cores:,.0f} | {f.drafter_calls_per_s:,.0f} | "
            f"{f.drafter_tok_s:,.0f} | {f.drafter_servers} |"
        )
    notes = sorted({n for f in fleets for n in f.notes})
    for n in notes:
        print(f"\nnote: {n}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
