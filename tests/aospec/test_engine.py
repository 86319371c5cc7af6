"""Algorithm 1 on the in-package sandbox and actor, in virtual time (deterministic)."""

from __future__ import annotations

import anyio
import pytest
from aospec.drafters.canonicalize import Canonicalizer
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.engine_config import EngineConfig, engine_config
from aospec.errors import ConfigError, EngineError, SandboxError
from aospec.ledger import EventKind
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

SCRIPT = [
    Action.bash("sleep 2 && cat a"),  # read-only, long
    Action.bash("ls"),  # read-only
    Action.bash("echo x > b"),  # changes the filesystem
    Action.bash("sleep 3 && cat b"),  # read-only, long
]


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def script_actor(script=SCRIPT, delay=1.0) -> ScriptedActor:
    return ScriptedActor(lambda h: script[len(h)] if len(h) < len(script) else Action.bash("true"), delay)


async def serial_reference(script=SCRIPT):
    sb = InMemorySandbox({"a": "A\n"})
    engine = Engine(script_actor(script), sb)
    t0 = anyio.current_time()
    history = await engine.run(History("task"), steps=len(script))
    return history, sb.files, anyio.current_time() - t0, engine.statistics()


def test_serial_engine_runs_the_script_and_takes_the_sum_of_decode_and_tool_time():
    async def main():
        return await serial_reference()

    history, files, elapsed, stats = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert files == {"a": "A\n", "b": "x\n"}
    assert elapsed == pytest.approx(4 * 1.0 + 2 + 3)
    assert stats.latency_s == pytest.approx(9.0)
    assert stats.forks_launched == stats.drafts_started == 0
    assert stats.tool_time_hidden_s == pytest.approx(0.0)


def test_correct_action_target_is_reused_and_hides_its_tool_time():
    async def main():
        ref, files, serial_s, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})
        drafter = ScriptedActionDrafter(lambda h: [ActionDraft(SCRIPT[len(h)], 0, 0.9)] if len(h) < len(SCRIPT) else [])
        engine = Engine(script_actor(), sb, action_drafters=[drafter], config=EngineConfig(branch_budget=0, depth=1))
        t0 = anyio.current_time()
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, files, serial_s, history, sb, anyio.current_time() - t0, engine.statistics()

    ref, files, serial_s, history, sb, elapsed, stats = run_virtual(main)
    assert history == ref and sb.files == files
    assert stats.forks_reused == len(SCRIPT)
    # the 2 s and 3 s tools started with the 1 s decodes of their steps; the others are instant
    assert elapsed == pytest.approx(serial_s - 2 * 1.0)
    assert stats.tool_time_hidden_s == pytest.approx(2 * 1.0)
    assert sb.live_forks == 0


def test_jasv_rejects_a_fork_whose_origin_version_is_stale():
    # Step 3 ("sleep 3 && cat b") is proposed at offset 1 from step 2's boundary; step 2
    # writes b, so the fork started before it saw the old filesystem and must not be used.
    async def main():
        ref, files, _, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})

        def propose(h):
            if len(h) == 2:
                return [ActionDraft(SCRIPT[3], 1, 0.9)]
            return []

        engine = Engine(
            script_actor(),
            sb,
            action_drafters=[ScriptedActionDrafter(propose)],
            config=EngineConfig(branch_budget=0, depth=2),
        )
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, files, history, sb, engine

    ref, files, history, sb, engine = run_virtual(main)
    assert history == ref and sb.files == files
    stats = engine.statistics()
    assert stats.forks_launched == 1 and stats.forks_reused == 0 and stats.forks_wasted == 1
    assert history.turns[3].observation == "<returncode>0</returncode>\n<output>\nx\n</output>"
    kinds = [e.kind for e in engine.ledger.events]
    assert EventKind.DISCARD in kinds and EventKind.REUSE not in kinds


def test_fork_of_read_only_steps_stays_valid_across_steps():
    # "ls" (step 1) is launched at offset 1 from the start; step 0 is read-only, so the
    # version is unchanged when "ls" is emitted and the fork is reused.
    async def main():
        ref, _, _, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})
        propose = lambda h: [ActionDraft(SCRIPT[1], 1, 0.9)] if len(h) == 0 else []  # noqa: E731
        engine = Engine(
            script_actor(),
            sb,
            action_drafters=[ScriptedActionDrafter(propose)],
            config=EngineConfig(branch_budget=0, depth=2),
        )
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, history, engine.statistics()

    ref, history, stats = run_virtual(main)
    assert history == ref
    assert stats.forks_launched == 1 and stats.forks_reused == 1 and stats.forks_wasted == 0


def test_byte_identical_draft_is_adopted_and_hides_decode_time():
    async def main():
        ref, files, serial_s, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})

        def propose(h, a):
            i = len(h)
            return [ObservationDraft(ref.turns[i].observation, 0.8), ObservationDraft("wrong", 0.1)]

        engine = Engine(
            script_actor(),
            sb,
            observation_drafters=[ScriptedObservationDrafter(propose, delay_s=0.1)],
            config=EngineConfig(fork_width=0, provisional_targets=False),
        )
        t0 = anyio.current_time()
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, files, serial_s, history, sb, anyio.current_time() - t0, engine.statistics()

    ref, files, serial_s, history, sb, elapsed, stats = run_virtual(main)
    assert history == ref and sb.files == files
    # steps 0 and 3 run 2 s and 3 s: the next decode (1 s) starts 0.1 s into them and is hidden;
    # steps 1 and 2 are instant, so their drafting (0.1 s) loses the race.
    assert stats.drafts_hit == 2  # step 3's hit decodes past the end of the run: nothing to hide
    assert elapsed == pytest.approx(serial_s - 1.0)
    assert stats.decode_time_hidden_s == pytest.approx(1.0)


def test_draft_differing_by_one_byte_is_never_committed():
    async def main():
        ref, files, _, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})
        propose = lambda h, a: [ObservationDraft(ref.turns[len(h)].observation + " ", 0.99)]  # noqa: E731
        engine = Engine(
            script_actor(),
            sb,
            observation_drafters=[ScriptedObservationDrafter(propose)],
            config=EngineConfig(fork_width=0),
        )
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, files, history, sb, engine.statistics()

    ref, files, history, sb, stats = run_virtual(main)
    assert history == ref and sb.files == files
    assert stats.drafts_hit == 0 and stats.drafts_started > 0
    assert stats.drafts_cancelled >= stats.drafts_started
    assert sb.live_forks == 0


def test_provisional_continuation_action_is_launched_into_a_fork():
    # While "sleep 2 && cat a" runs, the continuation decodes "ls" on the right draft and
    # launches it at once; step 0 is read-only, so JASV reuses that fork at step 1.
    async def main():
        ref, _, _, _ = await serial_reference()
        sb = InMemorySandbox({"a": "A\n"})
        propose = lambda h, a: [ObservationDraft(ref.turns[len(h)].observation, 0.8)]  # noqa: E731
        engine = Engine(
            script_actor(),
            sb,
            observation_drafters=[ScriptedObservationDrafter(propose)],
            config=EngineConfig(fork_width=0, provisional_targets=True),
        )
        history = await engine.run(History("task"), steps=len(SCRIPT))
        return ref, history, engine.statistics()

    ref, history, stats = run_virtual(main)
    assert history == ref
    assert stats.forks_reused >= 1


def test_run_needs_an_end_condition_and_stop_ends_it():
    async def main():
        engine = Engine(script_actor(), InMemorySandbox())
        with pytest.raises(EngineError, match="steps= or stop="):
            await engine.run(History("task"))
        history = await engine.run(History("task"), stop=lambda turn: turn.action == SCRIPT[1])
        return history

    assert run_virtual(main).actions == tuple(SCRIPT[:2])


def test_forks_are_released_when_the_actor_fails_mid_run():
    class FailingActor:
        def __init__(self):
            self.inner = script_actor()

        async def decode(self, history):
            if len(history) == 2:
                raise SandboxError("actor backend went away")
            return await self.inner.decode(history)

    async def main():
        sb = InMemorySandbox({"a": "A\n"})
        drafter = ScriptedActionDrafter(
            lambda h: [ActionDraft(Action.bash(f"sleep {k + 5}"), 0, 0.5) for k in range(4)]
        )
        engine = Engine(FailingActor(), sb, action_drafters=[drafter], config=EngineConfig(branch_budget=0))
        with pytest.raises(SandboxError, match="went away"):
            await engine.run(History("task"), steps=4)
        return sb

    sb = run_virtual(main)
    assert sb.forks_opened > 0 and sb.live_forks == 0


def test_statistics_is_a_frozen_record():
    async def main():
        engine = Engine(script_actor(), InMemorySandbox())
        await engine.run(History("task"), steps=2)
        return engine.statistics()

    stats = run_virtual(main)
    with pytest.raises(AttributeError):
        stats.steps = 5  # type: ignore[misc]
    assert stats.steps == 2 and stats.actions_executed == 2


def test_engine_config_rejects_unknown_keys_and_bad_values():
    assert engine_config({"branch_budget": 3, "rank": "likelihood"}).branch_budget == 3
    with pytest.raises(ConfigError, match="did you mean 'fork_width'"):
        engine_config({"fork_widht": 3})
    with pytest.raises(ConfigError, match="rank must be one of"):
        EngineConfig(rank="loudest")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="depth must be >= 1"):
        engine_config({"depth": 0})


def test_stale_forks_are_pruned_at_the_commit_that_invalidates_them():
    seen: dict[int, int] = {}
    sb = InMemorySandbox({"a": "A\n"})

    class WatchingActor:
        async def decode(self, history):
            action = await script_actor().decode(history)
            seen[len(history)] = sb.live_forks
            return action

    junk = [ActionDraft(Action.bash(f"sleep {50 + k}"), 0, 0.3) for k in range(3)]
    drafter = ScriptedActionDrafter(lambda h: junk if len(h) == 0 else [])

    async def main():
        # admission off: the junk is launched whatever it costs (the controller would refuse it)
        config = EngineConfig(branch_budget=0, admission="off")
        engine = Engine(WatchingActor(), sb, action_drafters=[drafter], config=config)
        await engine.run(History("task"), steps=len(SCRIPT))
        return engine.statistics()

    stats = run_virtual(main)
    assert seen[1] == 3 and seen[2] == 3  # steps 0 and 1 are read-only: the forks stay valid
    assert seen[3] == 0  # step 2 wrote b: pruned at its commit, long before they would finish
    assert stats.forks_wasted == 3 and sb.live_forks == 0


# ---------------------------------------------------------------------- canonical acceptance

LOG_SCRIPT = [
    Action.bash("sleep 2 && cat server.log"),  # long, prints a pid
    Action.bash("ls"),
    Action.bash("sleep 3 && cat server.log"),
]
LOG_FILES = {"server.log": "started server, pid 4242\n"}


def _pid_variant(text: str, pid: str = "977") -> str:
    return text.replace("pid 4242", f"pid {pid}")


async def _log_run(choose, accept: str, propose, **engine_kwargs):
    if accept == "canonical":
        engine_kwargs.setdefault("canonicalizer", Canonicalizer())
    sb = InMemorySandbox(LOG_FILES)
    # admission off: these tests count continuations; the controller would stop starting
    # the ones that never match exactly
    config = EngineConfig(fork_width=0, provisional_targets=False, accept=accept, admission="off")  # type: ignore[arg-type]
    engine = Engine(
        ScriptedActor(choose, 1.0),
        sb,
        observation_drafters=[ScriptedObservationDrafter(propose, delay_s=0.1)],
        config=config,
        **engine_kwargs,
    )
    t0 = anyio.current_time()
    history = await engine.run(History("task"), steps=len(LOG_SCRIPT))
    return history, sb, anyio.current_time() - t0, engine


def _by_step(h):
    return LOG_SCRIPT[len(h)] if len(h) < len(LOG_SCRIPT) else Action.bash("true")


def test_canonical_acceptance_adopts_a_draft_differing_only_in_a_pid_and_commits_the_real_observation():
    async def main():
        serial_engine = Engine(ScriptedActor(_by_step, 1.0), InMemorySandbox(LOG_FILES))
        t0 = anyio.current_time()
        ref = await serial_engine.run(History("task"), steps=len(LOG_SCRIPT))
        serial_s = anyio.current_time() - t0

        def propose(h, a):
            real = ref.turns[len(h)].observation
            return [ObservationDraft(_pid_variant(real), 0.8), ObservationDraft("wrong", 0.1)]

        exact = await _log_run(_by_step, "exact", propose)
        canonical = await _log_run(_by_step, "canonical", propose)
        return ref, serial_s, exact, canonical

    ref, serial_s, exact, canonical = run_virtual(main)
    assert "pid 4242" in ref.turns[0].observation
    history, sb, elapsed, engine = exact
    assert history == ref and elapsed == pytest.approx(serial_s)
    stats = engine.statistics()
    assert stats.drafts_hit == 0 and stats.drafts_canonical_hit == 0
    history, sb, elapsed, engine = canonical
    assert history == ref  # the actor finally sees the real observation, never the draft
    assert all("pid 977" not in t.observation for t in history.turns)
    stats = engine.statistics()
    assert stats.drafts_hit == 0 and stats.drafts_canonical_hit == 2
    assert elapsed == pytest.approx(serial_s - 1.0)  # step 1's decode ran during step 0's 2 s tool
    assert EventKind.DRAFT_CANONICAL_HIT in [e.kind for e in engine.ledger.events]
    assert sb.live_forks == 0


def test_canonical_acceptance_is_lossless_only_if_the_action_ignores_the_canonicalised_fields():
    # This actor reads the pid: on the accepted draft it decodes what it would never have
    # decoded on the real observation. The committed history still holds the real
    # observation; the action is the (documented) price of the opt-in approximation.
    def reads_pid(h):
        if len(h) == 1 and "pid 977" in h.turns[0].observation:
            return Action.bash("cat pid-977")
        return _by_step(h)

    async def main():
        ref = await Engine(ScriptedActor(reads_pid, 1.0), InMemorySandbox(LOG_FILES)).run(History("task"), steps=3)
        propose = lambda h, a: [ObservationDraft(_pid_variant(ref.turns[len(h)].observation), 0.8)]  # noqa: E731
        history, *_ = await _log_run(reads_pid, "canonical", propose)
        return ref, history

    ref, history = run_virtual(main)
    assert ref.turns[1].action == LOG_SCRIPT[1]
    assert history.turns[0] == ref.turns[0]
    assert history.turns[1].action == Action.bash("cat pid-977")


def test_drafts_equal_once_canonicalised_share_one_continuation():
    async def main():
        ref = await Engine(ScriptedActor(_by_step, 1.0), InMemorySandbox(LOG_FILES)).run(History("task"), steps=3)

        def propose(h, a):
            real = ref.turns[len(h)].observation
            return [ObservationDraft(_pid_variant(real, str(p)), 0.3) for p in (1, 2, 3)]

        _, _, _, canonical = await _log_run(_by_step, "canonical", propose)
        _, _, _, exact = await _log_run(_by_step, "exact", propose)
        return canonical.statistics(), exact.statistics()

    canonical, exact = run_virtual(main)
    assert exact.drafts_started == 3 * canonical.drafts_started > 0
    assert canonical.drafts_canonical_hit == 2


def test_canonicaliser_is_an_object_given_to_the_engine():
    class Lowercase:
        def canonical(self, text: str) -> str:
            return text.lower()

    async def main():
        ref = await Engine(ScriptedActor(_by_step, 1.0), InMemorySandbox(LOG_FILES)).run(History("task"), steps=3)
        propose = lambda h, a: [ObservationDraft(ref.turns[len(h)].observation.upper(), 0.8)]  # noqa: E731
        by_object = await _log_run(_by_step, "canonical", propose, canonicalizer=Lowercase())
        by_default = await _log_run(_by_step, "canonical", propose)
        return ref, by_object, by_default

    ref, by_object, by_default = run_virtual(main)
    assert by_object[0] == ref and by_object[3].statistics().drafts_canonical_hit == 2
    assert by_default[0] == ref and by_default[3].statistics().drafts_canonical_hit == 0
    with pytest.raises(ConfigError, match="'accept' has invalid value 'fuzzy'"):
        engine_config({"accept": "fuzzy"})
    with pytest.raises(ConfigError, match="accept must be one of"):
        EngineConfig(accept="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key 'canonicalizer'"):
        engine_config({"accept": "canonical", "canonicalizer": "pids+times"})  # objects are passed, not named
    with pytest.raises(ConfigError, match="no canonicalizer was given"):
        Engine(script_actor(), InMemorySandbox(), config=EngineConfig(accept="canonical"))
    with pytest.raises(ConfigError, match="has no canonical"):
        Engine(script_actor(), InMemorySandbox(), config=EngineConfig(accept="canonical"), canonicalizer=object())
    with pytest.raises(ConfigError, match='accept is "exact"'):
        Engine(script_actor(), InMemorySandbox(), canonicalizer=Lowercase())
