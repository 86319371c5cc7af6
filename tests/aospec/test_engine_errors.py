"""Errors of the verified path say by their type what the harness may do: a failure after
which the verified history and the committed sandbox still agree is raised as itself (with
a note naming the step: retry it); a step committed before the error is a
FailedAfterCommitError (do not run it again: go on); a committed sandbox whose state is
unknown, or not the history's, is a StateUnknownError. The backend's error is the cause."""

from __future__ import annotations

import anyio
import pytest
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import EngineError, FailedAfterCommitError, SandboxError, StateUnknownError
from aospec.protocols import ActionDraft
from aospec.testing import Fault, FaultySandbox, InMemorySandbox, ScriptedActionDrafter, ScriptedActor
from aospec.types import Action, History
from aospec.wrappers import SandboxWrapper

SCRIPT = [Action.bash(c) for c in ["echo a > x", "cat x", "echo b >> x", "ls", "echo c > y"]]
SERIAL = EngineConfig(branch_budget=0, fork_width=0, provisional_targets=False)


def choose(history: History) -> Action:
    return SCRIPT[len(history)] if len(history) < len(SCRIPT) else Action.none()


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def serial_files() -> dict[str, str]:
    async def main() -> dict[str, str]:
        sb = InMemorySandbox()
        await Engine(ScriptedActor(choose), sb, config=SERIAL).run(History("t"), steps=len(SCRIPT))
        return sb.files

    return run_virtual(main)


def targets() -> ScriptedActionDrafter:
    return ScriptedActionDrafter(lambda h: [ActionDraft(choose(h), 0, 0.9)])


def is_step(k: int):
    return lambda call: call.action == SCRIPT[k]


def test_a_commit_that_took_effect_then_raised_is_failed_after_commit_and_the_harness_goes_on():
    sb = FaultySandbox(InMemorySandbox(), [Fault("commit", "late", when=is_step(2))])

    async def main():
        engine = Engine(ScriptedActor(choose, 0.1), sb, action_drafters=[targets()])
        errors = []
        async with engine.session(History("t")) as session:
            while len(session.history) < len(SCRIPT):
                try:
                    await session.execute(await session.decode())
                except FailedAfterCommitError as exc:
                    errors.append(exc)  # committed: not run again, the run goes on
            return session.history, errors

    history, errors = run_virtual(main)
    assert history.actions == tuple(SCRIPT) and sb.files == serial_files()
    (exc,) = errors
    assert isinstance(exc, EngineError) and exc.step == 2
    assert type(exc.__cause__) is SandboxError and "after it took effect" in str(exc.__cause__)
    assert "step 2 ('echo b >> x') was committed" in str(exc) and "injected fault" in str(exc)


class StrayCommit(SandboxWrapper):
    """Commits, then changes the committed state once more and raises: neither the version
    before nor the fork's."""

    async def fork(self) -> StrayCommit:
        return StrayCommit(await self.inner.fork())

    async def commit(self, fork: StrayCommit) -> None:
        await self.inner.commit(fork.inner)
        if "b" in self.inner.files.get("x", ""):
            await self.inner.execute(Action.bash("echo stray > z"))
            raise SandboxError("the backend lost track of the commit")


def test_a_commit_that_leaves_a_third_version_is_state_unknown():
    sb = StrayCommit(InMemorySandbox())

    async def main():
        engine = Engine(ScriptedActor(choose, 0.1), sb, action_drafters=[targets()])
        async with engine.session(History("t")) as session:
            with pytest.raises(StateUnknownError) as caught:
                while True:
                    await session.execute(await session.decode())
            return session.history, caught.value

    history, exc = run_virtual(main)
    assert len(history) == 2 and exc.step == 2  # the step is not in H; the sandbox is elsewhere
    assert type(exc.__cause__) is SandboxError and "its state is unknown" in str(exc)
    assert sb.files.get("z") == "stray\n"


def test_a_serial_step_that_changed_the_committed_sandbox_then_failed_is_state_unknown():
    sb = FaultySandbox(InMemorySandbox(), [Fault("execute", "late", when=is_step(2))])

    async def main():
        engine = Engine(ScriptedActor(choose), sb, config=SERIAL)
        with pytest.raises(StateUnknownError) as caught:
            await engine.run(History("t"), steps=len(SCRIPT))
        return caught.value

    exc = run_virtual(main)
    assert exc.step == 2 and "holds changes the verified history does not" in str(exc)
    assert type(exc.__cause__) is SandboxError
    assert sb.files == {"x": "a\nb\n"}


def test_a_failure_that_leaves_history_and_sandbox_agreeing_is_raised_as_itself_with_a_note():
    sb = FaultySandbox(InMemorySandbox(), [Fault("execute", "error", on="fork", when=is_step(3), limit=2)])

    async def main():
        engine = Engine(ScriptedActor(choose, 0.1), sb, action_drafters=[targets()])
        async with engine.session(History("t")) as session:
            errors = []
            while len(session.history) < len(SCRIPT):
                action = await session.decode()
                while True:
                    try:
                        await session.execute(action)
                        break
                    except SandboxError as exc:
                        errors.append(exc)  # not committed: retried
            return session.history, errors

    history, errors = run_virtual(main)
    assert history.actions == tuple(SCRIPT) and sb.files == serial_files()
    assert errors and all(type(e) is SandboxError for e in errors)
    assert any("step 3 ('ls') failed on the verified path" in n for n in errors[-1].__notes__)
