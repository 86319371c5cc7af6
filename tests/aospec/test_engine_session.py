"""The engine's run state as a session a harness drives, the states of branches and forks,
drafters of different speed, and the split of latency into waited time and overhead."""

from __future__ import annotations

import anyio
import pytest
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import EngineError
from aospec.protocols import ActionDraft, ObservationDraft, Sandbox
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

SCRIPT = [
    Action.bash("sleep 2 && cat a"),
    Action.bash("ls"),
    Action.bash("echo x > b"),
    Action.bash("sleep 3 && cat b"),
]


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def script_actor(delay: float = 1.0) -> ScriptedActor:
    return ScriptedActor(lambda h: SCRIPT[len(h)] if len(h) < len(SCRIPT) else Action.bash("true"), delay)


def right_and_wrong_drafts(ref: History):
    return lambda h, a: [ObservationDraft(ref.turns[len(h)].observation, 0.8), ObservationDraft("wrong", 0.1)]


async def serial_history() -> History:
    return await Engine(script_actor(), InMemorySandbox({"a": "A\n"})).run(History("task"), steps=len(SCRIPT))


def test_a_harness_driving_decode_and_execute_gets_what_run_gets():
    async def main():
        ref = await serial_history()
        results = []
        for harness in (False, True):
            engine = Engine(
                script_actor(),
                InMemorySandbox({"a": "A\n"}),
                observation_drafters=[ScriptedObservationDrafter(right_and_wrong_drafts(ref), delay_s=0.1)],
                action_drafters=[ScriptedActionDrafter(lambda h: [ActionDraft(SCRIPT[len(h) % 4], 0, 0.5)])],
            )
            t0 = anyio.current_time()
            if harness:
                observations = []
                async with engine.session(History("task")) as session:
                    for _ in SCRIPT:
                        action = await session.decode()
                        observations.append(await session.execute(action))
                    history = session.history
                assert observations == [t.observation for t in history.turns]
            else:
                history = await engine.run(History("task"), steps=len(SCRIPT))
            results.append((history, anyio.current_time() - t0, engine.statistics(), engine.sandbox.live_forks))
        return ref, results

    ref, [(run_h, run_s, run_stats, run_live), (harness_h, harness_s, harness_stats, harness_live)] = run_virtual(main)
    assert run_h == harness_h == ref
    assert run_s == pytest.approx(harness_s)
    counts = ("steps", "forks_launched", "forks_reused", "forks_wasted", "drafts_started", "drafts_hit")
    assert [getattr(run_stats, c) for c in counts] == [getattr(harness_stats, c) for c in counts]
    assert run_stats.latency_ns == pytest.approx(harness_stats.latency_ns, abs=10)  # float clock, rounded to ns
    assert run_stats.drafts_hit > 0 and run_stats.forks_reused > 0
    assert run_live == harness_live == 0


def test_session_calls_out_of_order_are_engine_errors():
    async def main():
        engine = Engine(script_actor(), InMemorySandbox({"a": "A\n"}))
        async with engine.session(History("task")) as session:
            with pytest.raises(EngineError, match="call decode"):
                await session.execute(SCRIPT[0])
            action = await session.decode()
            with pytest.raises(EngineError, match="twice"):
                await session.decode()
            with pytest.raises(EngineError, match="call decode"):
                await session.execute(Action.bash("something else"))
            await session.execute(action)
            with pytest.raises(EngineError, match="already running"):
                await engine.run(History("task"), steps=1)
            return session.history

    assert run_virtual(main).actions == (SCRIPT[0],)


def test_a_harness_that_changes_the_history_drops_the_adopted_continuation():
    # The continuation adopted after step 0 decoded on the recorded history; the harness
    # goes on from another one, so the next action is decoded afresh from that.
    async def main():
        ref = await serial_history()
        actor = script_actor()
        engine = Engine(
            actor,
            InMemorySandbox({"a": "A\n"}),
            observation_drafters=[ScriptedObservationDrafter(right_and_wrong_drafts(ref), delay_s=0.1)],
            config=EngineConfig(fork_width=0, provisional_targets=False),
        )
        async with engine.session(History("task")) as session:
            await session.execute(await session.decode())
            calls = actor.calls
            edited = History("task").extend(SCRIPT[0], "edited by the harness")
            action = await session.decode(edited)
            assert actor.calls == calls + 1  # a fresh decode of the edited history
            await session.execute(action)
            return session.history, engine.statistics()

    history, stats = run_virtual(main)
    assert history.turns[0].observation == "edited by the harness"
    assert history.actions == tuple(SCRIPT[:2])
    assert stats.drafts_hit == 1 and stats.drafts_cancelled >= 1


def test_a_cheap_drafter_does_not_wait_for_a_slow_one():
    # Step 0's tool runs 2 s. The fast drafter has the right draft after 0.1 s; the slow
    # one needs 5 s. Each drafter's drafts start continuations when that drafter is done,
    # so the right continuation decodes step 1 during step 0's tool.
    async def main():
        ref = await serial_history()
        fast = ScriptedObservationDrafter(lambda h, a: [ObservationDraft(ref.turns[len(h)].observation, 0.6)], 0.1)
        slow = ScriptedObservationDrafter(lambda h, a: [ObservationDraft("slow and wrong", 0.9)], 5.0)
        out = []
        for drafters in ([fast], [fast, slow], [slow, fast]):
            engine = Engine(
                script_actor(),
                InMemorySandbox({"a": "A\n"}),
                observation_drafters=drafters,
                config=EngineConfig(fork_width=0, provisional_targets=False),
            )
            history = await engine.run(History("task"), steps=len(SCRIPT))
            assert history == ref
            out.append(engine.statistics())
        return out

    alone, with_slow, slow_first = run_virtual(main)
    assert alone.drafts_hit == with_slow.drafts_hit == slow_first.drafts_hit == 2
    assert alone.latency_ns == with_slow.latency_ns == slow_first.latency_ns


def test_drafts_of_later_drafters_fill_only_what_is_left_of_the_branch_budget():
    async def main():
        ref = await serial_history()
        first = ScriptedObservationDrafter(lambda h, a: [ObservationDraft(f"first {k}", 0.5) for k in range(2)], 0.1)
        second = ScriptedObservationDrafter(
            lambda h, a: [ObservationDraft("first 0", 0.9), *(ObservationDraft(f"second {k}", 0.5) for k in range(3))],
            0.2,
        )
        engine = Engine(
            script_actor(),
            InMemorySandbox({"a": "A\n"}),
            observation_drafters=[first, second],
            config=EngineConfig(branch_budget=3, fork_width=0, provisional_targets=False),
        )
        history = await engine.run(History("task"), steps=1)
        return ref, history, engine.statistics()

    ref, history, stats = run_virtual(main)
    assert history.turns[0] == ref.turns[0]
    # two from the first drafter, then one of the second's (its repeat of "first 0" skipped)
    assert stats.drafts_started == 3 and stats.drafts_cancelled == 3


class SlowForkSandbox(InMemorySandbox):
    """An in-memory sandbox whose fork and commit take time, as real ones do."""

    def __init__(self, files, *, fork_s: float, commit_s: float) -> None:
        super().__init__(files)
        self.fork_s, self.commit_s = fork_s, commit_s

    async def fork(self) -> SlowForkSandbox:
        child = await super().fork()
        child.__class__ = SlowForkSandbox
        child.fork_s, child.commit_s = self.fork_s, self.commit_s
        await anyio.sleep(self.fork_s)
        return child  # type: ignore[return-value]

    async def commit(self, fork: Sandbox) -> None:
        await anyio.sleep(self.commit_s)
        await super().commit(fork)  # type: ignore[arg-type]


def test_fork_and_commit_time_is_overhead_and_hidden_time_is_never_negative():
    # Action forks on, but no drafter ever proposes the right action: every step forks
    # (0.5 s) and commits (0.25 s) on the committed path. That is overhead, not negative
    # hidden tool time.
    async def main():
        sb = SlowForkSandbox({"a": "A\n"}, fork_s=0.5, commit_s=0.25)
        junk = ScriptedActionDrafter(lambda h: [ActionDraft(Action.bash("sleep 100"), 0, 0.1)])
        engine = Engine(script_actor(), sb, action_drafters=[junk], config=EngineConfig(branch_budget=0))
        t0 = anyio.current_time()
        await engine.run(History("task"), steps=len(SCRIPT))
        return anyio.current_time() - t0, engine.statistics()

    elapsed, stats = run_virtual(main)
    assert stats.tool_hidden_ns == 0 and stats.decode_hidden_ns == 0
    assert stats.overhead_ns == pytest.approx(len(SCRIPT) * 0.75e9)
    assert stats.latency_ns == stats.decode_ns + stats.tool_ns + stats.overhead_ns
    assert stats.latency_s == pytest.approx(elapsed)
    assert stats.wait_tool_ns - stats.tool_ns == stats.overhead_ns  # what used to show as negative hidden time


def test_a_fork_released_before_its_task_ran_never_forks_the_sandbox():
    # Three targets at one boundary, one live fork allowed: launching each evicts the one
    # before it while its task has not run yet, so only the last forks the sandbox.
    async def main():
        sb = InMemorySandbox({"a": "A\n"})
        targets = [ActionDraft(Action.bash(f"sleep {50 + k}"), 0, 0.9 - 0.1 * k) for k in range(3)]
        drafter = ScriptedActionDrafter(lambda h: targets if len(h) == 0 else [])
        engine = Engine(
            script_actor(), sb, action_drafters=[drafter], config=EngineConfig(branch_budget=0, max_live_forks=1)
        )
        await engine.run(History("task"), steps=1)
        return sb, engine.statistics()

    sb, stats = run_virtual(main)
    assert stats.forks_launched == 3
    assert sb.forks_opened == 1 + 1  # the last target's fork and the step's own
    assert sb.live_forks == 0


class TwoBatches:
    """A streaming drafter: a wrong guess after 0.1 s, the right one after 0.5 s."""

    def __init__(self, ref: History) -> None:
        self.ref = ref

    async def draft(self, history, action, n):  # the protocol's one-shot call (unused by the engine)
        return [d async for batch in self.draft_stream(history, action, n) for d in batch]

    async def draft_stream(self, history, action, n):
        await anyio.sleep(0.1)
        yield [ObservationDraft("wrong guess", 0.5)]
        await anyio.sleep(0.4)
        yield [ObservationDraft(self.ref.turns[len(history)].observation, 0.4)]


def test_a_streaming_drafter_continues_each_batch_within_the_budget():
    async def main():
        ref = await serial_history()
        out = []
        for budget in (2, 1):
            engine = Engine(
                script_actor(),
                InMemorySandbox({"a": "A\n"}),
                observation_drafters=[TwoBatches(ref)],
                config=EngineConfig(branch_budget=budget, fork_width=0, provisional_targets=False),
            )
            assert await engine.run(History("task"), steps=len(SCRIPT)) == ref
            out.append(engine.statistics())
        return out

    room, full = run_virtual(main)
    assert room.drafts_hit == 2  # steps 0 and 3 outlast the second batch
    assert full.drafts_hit == 0  # the wrong guess took the only slot
