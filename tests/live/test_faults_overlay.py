"""Faults only a real sandbox has: a command's processes killed from outside while the
engine runs (overlay backend, busybox base; skipped where overlayfs cannot run).

The other faults run on the overlay backend too, in tests/live/test_faults.py.

- Killing a speculative fork's processes (a wrong guess) only costs that fork: the run
  equals the serial run, nothing is left behind.
- Killing the sandbox (its bubblewrap process) while it runs the step the actor emitted is
  no observation: the runtime raises SandboxError (the command's result is unknown). In a
  speculative fork JASV accepted, that is a failed fork: the step runs again as serial
  execution would and the run equals the fault-free one; in the step's own execution it is
  an error of the verified path: the run ends with it, the committed state is that of the
  steps before, and nothing is left behind (docs/engine.md, Faults).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import SandboxError
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

pytestmark = pytest.mark.root

TASK = "kill"
WRONG = "sleep 2.25 && echo wrong > /wrong"
SLOW = "sleep 2.5 && echo b > /b"
SCRIPT = ("echo a > /a", "cat /a", SLOW, "ls /a /b", "echo c > /c", "cat /c")
CONFIG = EngineConfig(branch_budget=2, fork_width=2, depth=1, max_live_forks=4)


@pytest.fixture(scope="module")
def overlay_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.host import host_support

    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    cache, state = tmp_path_factory.mktemp("kill-cache"), tmp_path_factory.mktemp("kill-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(cache))
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield state
    mp.undo()
    assert not mounts_under(str(state))


def script_actor(script: tuple[str, ...] = SCRIPT, delay_s: float = 0.3) -> ScriptedActor:
    return ScriptedActor(
        lambda h: Action.bash(script[len(h)]) if len(h) < len(script) else Action.none(), delay_s=delay_s
    )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def kill_while_running(store_id: str, needle: str, killed: list[int], *, once: bool) -> None:
    """SIGKILL, from outside, the sandbox processes of the store whose command line holds
    ``needle`` (the bubblewrap processes running it), whenever they show up."""
    from aospec.runtime.processes import marked_processes

    while True:
        for pid in marked_processes(f"aospec-{store_id}-"):
            if needle in _cmdline(pid) and pid not in killed:
                await anyio.sleep(0.2)  # let the command get going
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(pid)
        if once and killed:
            return
        await anyio.sleep(0.02)


async def run_killing(needle: str | None, *, drafters: bool, once: bool = False) -> dict[str, Any]:
    from aospec.runtime import SandboxConfig, open_sandbox
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.lossless import snapshot_sandbox
    from aospec.runtime.processes import marked_processes

    killed: list[int] = []
    serial = dict(enumerate(SCRIPT))

    def propose(history: History) -> list[ActionDraft]:
        out = [ActionDraft(Action.bash(WRONG), 0, 0.4)]
        if len(history) < len(SCRIPT):
            out.append(ActionDraft(Action.bash(serial[len(history)]), 0, 0.9))
        return out

    def observe(history: History, action: Action) -> list[ObservationDraft]:
        return [ObservationDraft("<returncode>0</returncode>\n<output>\n</output>", 0.5)]

    async with open_sandbox(SandboxConfig(backend="overlay", base="busybox", timeout_s=20, formatter="mini-swe-agent")) as sb:
        store_id, path = sb.store.id, sb.store.path
        engine = Engine(
            script_actor(),
            sb,
            observation_drafters=[ScriptedObservationDrafter(observe)] if drafters else [],
            action_drafters=[ScriptedActionDrafter(propose)] if drafters else [],
            config=CONFIG if drafters else EngineConfig(branch_budget=0, fork_width=0),
        )
        error: BaseException | None = None
        history = History(TASK)
        async with anyio.create_task_group() as tg:
            if needle is not None:
                tg.start_soon(lambda: kill_while_running(store_id, needle, killed, once=once))
            try:
                history = await engine.run(History(TASK), steps=len(SCRIPT))
            except SandboxError as exc:
                error = exc
            tg.cancel_scope.cancel()
        result = {
            "error": error,
            "history": [(t.action.command, t.observation) for t in history.turns],
            "version": sb.version,
            "snapshot": await snapshot_sandbox(sb),
            "live": len(sb.store.live) - 1,
            "killed": killed,
            "stats": engine.statistics(),
        }
    assert not mounts_under(str(path)) and not marked_processes(f"aospec-{store_id}-") and not path.exists()
    return result


@pytest.mark.slow
def test_killing_a_speculative_fork_from_outside_only_costs_speed(overlay_dirs: Path) -> None:
    serial = anyio.run(lambda: run_killing(None, drafters=False))
    spec = anyio.run(lambda: run_killing("echo wrong", drafters=True))
    assert spec["killed"], "no speculative fork was killed: the check proves nothing"
    assert spec["history"] == serial["history"]
    assert spec["version"] == serial["version"] and spec["snapshot"] == serial["snapshot"]
    assert spec["live"] == 0
    assert spec["stats"].forks_reused > 0


@pytest.mark.parametrize("drafters", [False, True], ids=["serial", "speculative"])
def test_killing_the_emitted_step_from_outside_is_an_error_not_an_observation(
    overlay_dirs: Path, drafters: bool
) -> None:
    out = anyio.run(lambda: run_killing("echo b", drafters=drafters, once=True))
    assert out["killed"]
    assert out["live"] == 0
    if out["error"] is None:
        # killed in a speculative fork JASV accepted: the step ran again, as serial would
        assert drafters, "the step's own execution was killed, yet the run went on"
        serial = anyio.run(lambda: run_killing(None, drafters=False))
        assert out["history"] == serial["history"]
        assert out["version"] == serial["version"] and out["snapshot"] == serial["snapshot"]
        assert out["stats"].speculative_failures > 0
        return
    # killed in the step's own execution: the run ends with the error, no observation of
    # the kill is committed and the committed state is the steps' before it: /a, no /b
    assert "killed from outside" in str(out["error"])
    assert "a" in out["snapshot"] and "b" not in out["snapshot"]
    assert all("-9" not in obs for _, obs in out["history"])
