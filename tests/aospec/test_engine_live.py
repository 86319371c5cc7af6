"""Losslessness in real time on both anyio backends: whatever the drafters propose, the
committed trajectory and the final filesystem equal serial execution's."""

from __future__ import annotations

import random

import anyio
import pytest
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
