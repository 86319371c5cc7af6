#!/usr/bin/env python3
"""Replay benchmark: steps simulated per second per policy, engine CPU per step, and the
wall time of the whole default sweep (all non-LLM policies, TPOTs 20/15/10/5/1 ms).

Usage: .venv/bin/python scripts/bench_replay.py [TRACES_DIR] [--jobs N] [--skip-sweep]
Targets (issue 3): full sweep < 60 s on 2 cores; engine control overhead < 0.5 ms CPU/step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.policies import DEFAULT_POLICIES, DrafterSet, parse_policies
from aospec.replay.sweep import DEFAULT_TPOTS_MS, replay_trace, run_sweep

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

DEFAULT_DIR = Path("/work/shared/traces/tb1-mini-swe-agent-claude-sonnet-4")


def per_policy(traces, tpot_ms: float = 10.0) -> list[tuple[str, int, float]]:
    """(policy, steps, CPU seconds) replaying every trace under each policy, drafters pre-fit."""
    folds = {t.task: DrafterSet([x for x in traces if x.task != t.task]) for t in traces}
    out = []
    for policy in parse_policies(",".join(DEFAULT_POLICIES)):
        for t in traces:  # warm-up: fit drafters, fill memo caches
            replay_trace(t, [policy], [tpot_ms], folds[t.task], check_ceilings=False)
        start = time.process_time()
        steps = 0
        for t in traces:
            replay_trace(t, [policy], [tpot_ms], folds[t.task], check_ceilings=False)
            steps += len(t)
        out.append((policy.name, steps, time.process_time() - start))
    return out


def live_overhead(steps: int = 400) -> list[tuple[str, float]]:
    """CPU ms per step of the engine in real time (asyncio) with an instant actor and
    in-memory sandbox: what the engine itself costs per step, live."""
    pool = [Action.bash(c) for c in ("ls", "cat a", "echo x > a", "echo y >> b", "cat b")]
    actor = ScriptedActor.hashing(pool, seed=3)

    async def serial_ref():
        return await Engine(actor, InMemorySandbox({"a": "1\n"})).run(History("bench"), steps=steps)

    ref = anyio.run(serial_ref)
    obs = ScriptedObservationDrafter(
        lambda h, a: [ObservationDraft(ref.turns[len(h)].observation, 0.9)] if len(h) < steps else []
    )
    act = ScriptedActionDrafter(lambda h: [ActionDraft(ref.turns[len(h)].action, 0, 0.9)] if len(h) < steps else [])
    configs = {
        "serial": ({}, EngineConfig(branch_budget=0, fork_width=0, provisional_targets=False)),
        "obs+actions (1 draft, 1 fork)": ({"observation_drafters": [obs], "action_drafters": [act]}, EngineConfig()),
    }
    out = []
    for name, (kw, cfg) in configs.items():

        async def run(kw=kw, cfg=cfg):
            return await Engine(actor, InMemorySandbox({"a": "1\n"}), config=cfg, **kw).run(
                History("bench"), steps=steps
            )

        anyio.run(run)
        start = time.process_time()
        anyio.run(run)
        out.append((name, 1000 * (time.process_time() - start) / steps))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="?", default=str(DEFAULT_DIR if DEFAULT_DIR.exists() else bundled_traces_path()))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--skip-sweep", action="store_true")
    args = ap.parse_args()
    traces = load_traces([args.traces])
    print(f"traces: {args.traces} ({len(traces)} traces, {sum(len(t) for t in traces)} steps); CPUs: {os.cpu_count()}")

    print("\nper policy, one process, TPOT 10 ms (drafters fit beforehand):")
    print(f"  {'policy':<16}{'steps/s':>10}{'CPU ms/step':>13}")
    for name, steps, cpu in per_policy(traces):
        print(f"  {name:<16}{steps / cpu:>10.0f}{1000 * cpu / steps:>13.3f}")

    print("\nlive engine (asyncio, real time, instant actor and in-memory sandbox):")
    for name, ms in live_overhead():
        print(f"  {name:<32}{ms:>8.3f} CPU ms/step")

    if not args.skip_sweep:
        policies = parse_policies(",".join(DEFAULT_POLICIES))
        start = time.perf_counter()
        results = run_sweep(traces, policies, tpots_ms=DEFAULT_TPOTS_MS, jobs=args.jobs)
        wall = time.perf_counter() - start
        print(
            f"\nfull default sweep: {len(policies)} policies x {len(DEFAULT_TPOTS_MS)} TPOTs x {len(traces)} traces "
            f"(+ matching ceilings, {len(results)} results), jobs={args.jobs}: {wall:.1f} s wall; target < 60 s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
