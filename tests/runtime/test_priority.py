"""Background priority of speculative forks (overlay backend): a fork set to the
background runs its command's processes at SCHED_IDLE in a cgroup of the least CPU
weight; promotion to the foreground changes processes already running; the engine runs
speculative forks in the background and the fork the step waits on in the foreground."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime.host import host_support
from aospec.runtime.isolation import _tree
from aospec.runtime.processes import marked_processes

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.protocols import ActionDraft, PrioritizedSandbox
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor
from aospec.types import Action, History

pytestmark = [pytest.mark.anyio, pytest.mark.root]


def _command_processes(marker: str) -> set[int]:
    """The processes inside the sandbox running under ``marker`` (not bwrap outside)."""
    found: set[int] = set()
    for pid in marked_processes(marker):
        found |= _tree(pid) - {pid}
    return {p for p in found if _is_sleep(p)}


def _is_sleep(pid: int) -> bool:
    try:
        return b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _policy(pid: int) -> int:
    """The scheduling policy field of /proc/PID/stat (0 SCHED_OTHER, 5 SCHED_IDLE)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rpartition(")")[2].split()[38])


def _weight(sb: object, fork: object) -> str | None:
    _, cgroups = host_support()
    if cgroups is None or "cpu" not in cgroups.roots:
        return None
    store = sb.store  # type: ignore[attr-defined]
    d = cgroups.roots["cpu"] / store.cgroup / f"{store.cgroup}-{fork.sid}"  # type: ignore[attr-defined]
    return (d / ("cpu.weight" if cgroups.version == 2 else "cpu.shares")).read_text().strip()


async def _wait_for(marker: str) -> set[int]:
    for _ in range(500):
        pids = _command_processes(marker)
        if pids:
            return pids
        await anyio.sleep(0.01)
    raise AssertionError("the command's processes never showed up")


async def test_a_background_fork_runs_idle_and_promotion_reaches_running_processes(overlay: str) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay, base="busybox")) as sb:
        assert isinstance(sb, PrioritizedSandbox)
        fork = await sb.fork()
        assert fork.foreground
        await fork.set_priority(foreground=False)
        assert not fork.foreground
        marker = f"aospec-{sb.store.id}-{fork.sid}-"
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, "sleep 30 & sleep 30; wait")
            pids = await _wait_for(marker)
            assert all(_policy(p) == os.SCHED_IDLE for p in pids)
            assert _weight(sb, fork) in (None, "1", "2", "3")  # 3: the idle class (cpu.idle)
            await fork.set_priority(foreground=True)
            assert all(_policy(p) == os.SCHED_OTHER for p in _command_processes(marker))
            assert _weight(sb, fork) in (None, "100", "1024")
            # and back: a demotion reaches them too
            await fork.set_priority(foreground=False)
            assert all(_policy(p) == os.SCHED_IDLE for p in _command_processes(marker))
            tg.cancel_scope.cancel()
        await fork.discard()


async def test_a_foreground_sandbox_runs_at_normal_priority(overlay: str) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay, base="busybox")) as sb:
        fork = await sb.fork()
        marker = f"aospec-{sb.store.id}-{fork.sid}-"
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, "sleep 30")
            pids = await _wait_for(marker)
            assert all(_policy(p) == os.SCHED_OTHER for p in pids)
            tg.cancel_scope.cancel()
        await fork.discard()


class _Recording(InMemorySandbox):
    """Records, for each command, whether it ran in the foreground when it finished."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, bool]] = []

    async def fork(self) -> _Recording:
        child = await super().fork()
        child.__class__ = _Recording
        child.log = self.log
        return child  # type: ignore[return-value]

    async def execute(self, action: Action) -> str:
        out = await super().execute(action)
        self.log.append((action.key, self.foreground))
        return out


async def test_the_engine_runs_guesses_in_the_background_and_the_awaited_fork_in_the_foreground() -> None:
    script = ("sleep 0.3 && echo a > /a", "sleep 0.3 && cat /a")
    sb = _Recording()
    actor = ScriptedActor(lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), delay_s=0.1)

    def propose(history: History) -> list[ActionDraft]:
        out = [ActionDraft(Action.bash("sleep 0.3 && echo wrong"), 0, 0.5)]
        if len(history) < len(script):
            out.append(ActionDraft(Action.bash(script[len(history)]), 0, 0.9))
        return out

    engine = Engine(
        actor,
        sb,
        action_drafters=[ScriptedActionDrafter(propose)],
        config=EngineConfig(branch_budget=0, fork_width=2, depth=1, max_live_forks=4),
    )
    history = await engine.run(History("t"), steps=len(script))
    assert [t.action.command for t in history.turns] == list(script)
    assert engine.statistics().forks_reused >= 1
    ran = dict(sb.log)
    assert ran[Action.bash("sleep 0.3 && echo wrong").key] is False  # a guess: background
    for cmd in script:
        assert ran[Action.bash(cmd).key] is True  # the step waited on it: foreground
