"""Losslessness in real time on both anyio backends: whatever the drafters propose, the
committed trajectory and the final filesystem equal serial execution's."""

from __future__ import annotations

import random
import re

import anyio
import pytest
import xxhash
from aospec.drafters.canonicalize import Canonicalizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

POOL = [
    Action.bash(c)
    for c in (
        "ls",
        "cat a",
        "cat b",
        "echo one > a",
        "echo two >> a",
        "echo three > b",
        "rm b",
        "sleep 0.004 && cat a",
        "sleep 0.003 && echo four >> b",
    )
]
FILES = {"a": "zero\n"}


async def _serial(actor: ScriptedActor, steps: int):
    sb = InMemorySandbox(FILES, op_delay_s=0.001)
    history = await Engine(actor, sb).run(History("live"), steps=steps)
    return history, sb


async def _speculative(actor, ref, steps, q_obs, q_act, seed, config):
    rng = random.Random(seed)
    sb = InMemorySandbox(FILES, op_delay_s=0.001)

    def observations(h, a):
        out = [ObservationDraft(f"<returncode>0</returncode>\n<output>\n{rng.random()}\n</output>", 0.3)]
        i = len(h)
        if i < len(ref) and rng.random() < q_obs:
            out.append(ObservationDraft(ref.turns[i].observation, rng.random()))
        rng.shuffle(out)
        return out

    def actions(h):
        out = [ActionDraft(rng.choice(POOL), rng.randrange(2), rng.random())]
        i = len(h)
        for k in range(2):
            if i + k < len(ref) and rng.random() < q_act:
                out.append(ActionDraft(ref.turns[i + k].action, k, rng.random()))
        return out

    engine = Engine(
        actor,
        sb,
        observation_drafters=[ScriptedObservationDrafter(observations, delay_s=0.0005)],
        action_drafters=[ScriptedActionDrafter(actions, delay_s=0.0005)],
        config=config,
    )
    history = await engine.run(History("live"), steps=steps)
    return history, sb, engine.statistics()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    actor_seed=st.integers(0, 10_000),
    steps=st.integers(3, 9),
    q_obs=st.floats(0.0, 1.0),
    q_act=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
    depth=st.integers(1, 3),
    obs_depth=st.integers(1, 2),
)
def test_live_engine_is_lossless_under_random_drafter_quality(
    backend, actor_seed, steps, q_obs, q_act, seed, depth, obs_depth
):
    actor = ScriptedActor.hashing(POOL, seed=actor_seed, delay_s=0.002)
    config = EngineConfig(depth=depth, obs_depth=obs_depth, branch_budget=3, fork_width=4)

    async def main():
        ref, ref_sb = await _serial(actor, steps)
        history, sb, stats = await _speculative(actor, ref, steps, q_obs, q_act, seed, config)
        return ref, ref_sb, history, sb, stats

    ref, ref_sb, history, sb, stats = anyio.run(main, backend=backend)
    assert history == ref
    assert sb.files == ref_sb.files
    assert sb.version == ref_sb.version  # same changes in the same order: same hash chain
    assert sb.live_forks == 0
    assert stats.steps == steps


PID_POOL = [
    Action.bash(c)
    for c in (
        "ls",
        "cat log",
        "sleep 0.004 && cat log",
        "echo started pid 4242 > log",
        "echo worker pid 77 >> log",
        "echo two >> a",
    )
]


def _actor_ignoring_pids(seed: int) -> ScriptedActor:
    """An actor that reads every observation except its process ids: the condition under
    which canonical acceptance stays lossless."""
    canon = Canonicalizer(["pids"])

    def choose(history: History) -> Action:
        parts = [str(seed), *(f"{t.action.key}\x1f{canon.canonical(t.observation)}" for t in history.turns)]
        return PID_POOL[xxhash.xxh3_64_intdigest("\x1e".join(parts).encode()) % len(PID_POOL)]

    return ScriptedActor(choose, 0.002)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    actor_seed=st.integers(0, 10_000), steps=st.integers(3, 8), q_obs=st.floats(0.0, 1.0), seed=st.integers(0, 10_000)
)
def test_live_canonical_acceptance_is_lossless_for_an_actor_that_ignores_pids(backend, actor_seed, steps, q_obs, seed):
    actor = _actor_ignoring_pids(actor_seed)
    rng = random.Random(seed)
    files = {"a": "zero\n", "log": "started pid 1\n"}

    def observations(h, a):
        out = [ObservationDraft("<returncode>0</returncode>\n<output>\nnothing\n</output>", 0.2)]
        i = len(h)
        if i < len(ref) and rng.random() < q_obs:
            real = ref.turns[i].observation
            out.append(ObservationDraft(re.sub(r"pid \d+", lambda _m: f"pid {rng.randrange(10**6)}", real), 0.7))
        return out

    async def main():
        nonlocal ref
        ref_sb = InMemorySandbox(files, op_delay_s=0.001)
        ref = await Engine(actor, ref_sb).run(History("live"), steps=steps)
        sb = InMemorySandbox(files, op_delay_s=0.001)
        engine = Engine(
            actor,
            sb,
            observation_drafters=[ScriptedObservationDrafter(observations, delay_s=0.0005)],
            config=EngineConfig(branch_budget=2, fork_width=0, accept="canonical"),
            canonicalizer=Canonicalizer(["pids"]),
        )
        history = await engine.run(History("live"), steps=steps)
        return ref_sb, history, sb, engine.statistics()

    ref = History("live")
    ref_sb, history, sb, stats = anyio.run(main, backend=backend)
    assert history == ref  # what the actor finally saw: the real observations
    assert sb.files == ref_sb.files and sb.version == ref_sb.version
    assert sb.live_forks == 0
    assert stats.drafts_hit + stats.drafts_canonical_hit <= steps


def test_live_canonical_acceptance_hides_a_decode_behind_a_tool_whose_output_names_a_pid():
    actor = ScriptedActor(lambda h: PID_POOL[2] if len(h) == 0 else PID_POOL[0], 0.01)
    files = {"log": "started pid 4242\n"}

    async def run(accept: str):
        sb = InMemorySandbox(files)
        drafter = ScriptedObservationDrafter(
            lambda h, a: [ObservationDraft("<returncode>0</returncode>\n<output>\nstarted pid 9\n</output>", 0.9)]
        )
        canon = Canonicalizer() if accept == "canonical" else None
        engine = Engine(
            actor,
            sb,
            observation_drafters=[drafter],
            config=EngineConfig(fork_width=0, accept=accept),
            canonicalizer=canon,
        )
        history = await engine.run(History("live"), steps=2)
        return history, engine.statistics()

    exact_history, exact = anyio.run(run, "exact")
    canonical_history, canonical = anyio.run(run, "canonical")
    assert canonical_history == exact_history
    assert "pid 4242" in canonical_history.turns[0].observation
    assert exact.drafts_canonical_hit == 0 and canonical.drafts_canonical_hit == 1
