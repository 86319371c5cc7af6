"""The engine live on a real sandbox: real bash commands in overlayfs forks isolated by
bubblewrap. Whatever the drafters propose, the committed trajectory and the final
filesystem (its version and its contents) equal serial execution on the same base."""

from __future__ import annotations

import random

import anyio
import pytest
from aospec.runtime import default_state_root, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

POOL = [
    Action.bash(c)
    for c in (
        "ls /work",
        "cat /work/a",
        "echo one >> /work/a",
        "echo two > /work/b",
        "rm -f /work/b",
        "sleep 0.05; wc -l /work/a",
        "mkdir -p /work/d && echo x > /work/d/f",
        "cat /work/b 2>&1; echo done",
    )
]
STEPS = 12
SNAPSHOT = Action.bash("cd /work && find . | sort && cat a")


def _skip_reason() -> str | None:
    support, _ = host_support()
    problems = support.problems()
    return "; ".join(problems) if problems else None


pytestmark = [pytest.mark.root, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _needs_overlay():
    reason = _skip_reason()
    if reason:
        pytest.skip(f"overlay sandbox cannot run here: {reason}")


async def _run(speculate: bool, seed: int) -> tuple[History, str, str]:
    actor = ScriptedActor.hashing(POOL, seed=seed, delay_s=0.01)
    rng = random.Random(seed)
    async with open_sandbox(backend="overlay", base="busybox", timeout_s=10, formatter="mini-swe-agent") as sb:
        await sb.execute(Action.bash("mkdir -p /work && echo zero > /work/a"))
        if not speculate:
            history = await Engine(actor, sb).run(History("live"), steps=STEPS)
        else:

            def observations(h: History, a: Action) -> list[ObservationDraft]:
                guess = f"<returncode>0</returncode>\n<output>\n{rng.choice(['', 'zero', 'one'])}\n</output>"
                return [
                    ObservationDraft(guess, 0.5),
                    ObservationDraft("<returncode>0</returncode>\n<output>\n</output>", 0.4),
                ]

            def actions(h: History) -> list[ActionDraft]:
                return [ActionDraft(rng.choice(POOL), rng.randrange(2), rng.random()) for _ in range(4)]

            engine = Engine(
                actor,
                sb,
                observation_drafters=[ScriptedObservationDrafter(observations)],
                action_drafters=[ScriptedActionDrafter(actions)],
                config=EngineConfig(branch_budget=2, fork_width=4, depth=2),
            )
            history = await engine.run(History("live"), steps=STEPS)
            stats = engine.statistics()
            assert stats.forks_launched > 0
        version = sb.version
        snapshot = await sb.execute(SNAPSHOT)
    return history, version, snapshot


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_speculative_run_on_overlay_equals_serial_run(seed):
    serial = await _run(False, seed)
    speculative = await _run(True, seed)
    assert speculative[0] == serial[0], "committed trajectories differ"
    assert speculative[1] == serial[1], "final filesystem versions differ"
    assert speculative[2] == serial[2], "final filesystem contents differ"


async def test_engine_run_cancelled_midway_leaves_no_forks_behind(monkeypatch, tmp_path):
    # a private state root: the shared one may hold other sessions' mounts
    monkeypatch.setenv("AOSPEC_STATE_ROOT", str(tmp_path / "state"))
    actor = ScriptedActor.hashing(POOL, seed=7, delay_s=0.02)
    async with open_sandbox(backend="overlay", base="busybox", timeout_s=10, formatter="mini-swe-agent") as sb:
        await sb.execute(Action.bash("mkdir -p /work && echo zero > /work/a"))
        engine = Engine(
            actor,
            sb,
            action_drafters=[ScriptedActionDrafter(lambda h: [ActionDraft(a, 0, 0.5) for a in POOL[:6]])],
            config=EngineConfig(fork_width=6),
        )
        with anyio.move_on_after(0.3):
            await engine.run(History("live"), steps=1000)
        assert engine.statistics().forks_launched > 0
        # cancelled mid-run, the committed sandbox is intact and usable
        assert "zero" in await sb.execute(Action.bash("cat /work/a"))
    assert default_state_root() == tmp_path / "state"
    assert mounts_under(str(default_state_root())) == []
