"""The replay actor, the replay sandbox and single-trace replays with their invariants."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.actor import DIVERGED_TOOL, ReplayActor, VirtualClock, seconds_to_ns
from aospec.replay.policies import DEFAULT_POLICIES, DrafterSet, parse_policies, parse_policy
from aospec.replay.sandbox import OFF_RECORD_PREFIX, ReplayWorld
from aospec.replay.sweep import check_ceiling, check_trajectory, replay_trace
from trio.testing import MockClock

from aospec.errors import ConfigError, EngineError
from aospec.types import Action, History, Step, Trace

# tool times whose binary sums are inexact: 0.1 + 0.2 != 0.3 in floats
STEPS = [
    ("ls", "a.txt\n", 0.1, 40),
    ("cat a.txt", "hello\n", 0.2, 30),
    ("echo hi > b.txt", "", 0.3, 20),
    ("sleep 7 && cat b.txt", "hi\n", 7.123456789, 50),
    ("cat a.txt", "hello\n", 0.7, 10),
]


def make_trace(steps=STEPS, task="demo", id="demo-1", unknown_last=False) -> Trace:
    out = []
    for k, (cmd, obs, t, tokens) in enumerate(steps):
        last = unknown_last and k == len(steps) - 1
        out.append(
            Step(
                action=Action.bash(cmd),
                observation=obs,
                output_tokens=tokens,
                tool_duration_s=None if last else t,
                completed=not last,
            )
        )
    return Trace(id=id, task=task, harness="h", actor_model="m", source="test", steps=tuple(out))


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def test_seconds_convert_to_exact_nanoseconds():
    assert seconds_to_ns(0.1) + seconds_to_ns(0.2) == seconds_to_ns(0.3) == 300_000_000
    assert seconds_to_ns(7.123456789) == 7_123_456_789


def test_replay_actor_returns_recorded_actions_on_the_recorded_history_only():
    trace = make_trace()

    async def main():
        clock = VirtualClock()
        actor = ReplayActor(trace, tpot_ns=1_000_000, clock=clock)
        t0 = clock.now_ns()
        first = await actor.decode(trace.history(0))
        elapsed = clock.now_ns() - t0
        provisional = History(trace.history(0).task).extend(trace.steps[0].action, "a.txt\n")
        on_record = await actor.decode(provisional)
        off = await actor.decode(History(trace.history(0).task).extend(trace.steps[0].action, "a.txt \n"))
        return first, elapsed, on_record, off

    first, elapsed, on_record, off = run_virtual(main)
    assert first == trace.steps[0].action and elapsed == 40 * 1_000_000
    assert on_record == trace.steps[1].action
    assert off.tool == DIVERGED_TOOL


def test_replay_sandbox_versions_results_and_off_record_actions():
    trace = make_trace()

    async def main():
        world = ReplayWorld(trace, VirtualClock())
        sb = world.sandbox()
        v0 = sb.version
        fork = await sb.fork()
        assert await fork.execute(Action.bash("ls")) == "a.txt\n"
        assert fork.version == v0  # read-only: same version
        await sb.commit(fork)
        assert sb.position == 1
        assert await sb.execute(Action.bash("cat a.txt")) == "hello\n"
        assert await sb.execute(Action.bash("echo hi > b.txt")) == ""
        v_after_write = sb.version
        assert v_after_write != v0
        stray = await sb.fork()
        out = await stray.execute(Action.bash("rm -rf /"))
        assert out.startswith(OFF_RECORD_PREFIX) and stray.version not in (v0, v_after_write)
        # the second "cat a.txt" is recorded after the write: from v0 it is off the recording
        old = world.sandbox()
        skip = await old.fork()
        await skip.execute(Action.bash("ls"))
        assert await skip.execute(Action.bash("cat a.txt")) == "hello\n"  # step 2, first match
        return world

    world = run_virtual(main)
    assert world.unknown_tool_steps == []


def test_serial_replay_latency_is_exactly_the_sum_of_decode_and_tool_times():
    trace = make_trace()
    (result,) = replay_trace(trace, [parse_policy("serial")], [15.0], DrafterSet([]), check_ceilings=False)
    tokens = sum(s[3] for s in STEPS)
    assert result.serial_ns == tokens * 15_000_000 + sum(seconds_to_ns(s[2]) for s in STEPS)
    assert result.latency_ns == result.serial_ns and result.saving == 0.0


def test_unknown_tool_time_counts_as_zero_and_is_reported():
    trace = make_trace(unknown_last=True)
    (result,) = replay_trace(trace, [parse_policy("serial")], [1.0], DrafterSet([]), check_ceilings=False)
    assert result.unknown_tool_steps == 1
    assert result.serial_ns == sum(s[3] for s in STEPS) * 1_000_000 + sum(seconds_to_ns(s[2]) for s in STEPS[:-1])


def test_oracle_policies_reuse_every_step_and_respect_the_ceiling_order():
    trace = make_trace()
    policies = parse_policies("serial,oracle-action,ceiling,ceiling:depth=3")
    results = {r.policy: r for r in replay_trace(trace, policies, [10.0], DrafterSet([]))}
    assert results["oracle-action"].forks_reused == len(STEPS)
    assert results["oracle-action"].latency_ns < results["serial"].latency_ns
    assert results["ceiling"].latency_ns <= results["oracle-action"].latency_ns
    assert results["ceiling:depth=3"].drafts_hit > 0


@pytest.fixture(scope="module")
def bundled() -> list[Trace]:
    return load_traces([bundled_traces_path()])


def test_every_default_policy_replays_a_real_trace_losslessly_and_deterministically(bundled):
    trace = max(bundled, key=len)
    train = [t for t in bundled if t.task != trace.task]
    policies = parse_policies(",".join(DEFAULT_POLICIES))
    first = replay_trace(trace, policies, [20.0, 1.0], DrafterSet(train))
    again = replay_trace(trace, policies, [20.0, 1.0], DrafterSet(train))
    assert first == again
    by = {(r.policy, r.tpot_ms): r for r in first}
    for (policy, tpot), r in by.items():
        assert r.serial_ns == by[("serial", tpot)].latency_ns
        assert r.latency_ns <= r.serial_ns
        assert r.ceiling_ns <= r.latency_ns, (policy, tpot)
    assert by[("aospec", 20.0)].drafts_hit > 0


def test_invariant_checks_name_the_trace_and_policy():
    trace = make_trace()
    bad = trace.history().turns
    wrong = History(trace.history(0).task, (*bad[:-1], bad[-1].__class__(bad[-1].action, "tampered")))
    with pytest.raises(EngineError, match="committed step 5 differs"):
        check_trajectory(trace, wrong, "trace 'demo-1', policy 'x'")
    with pytest.raises(EngineError, match=r"trace 'demo-1', policy 'aospec', TPOT 5 ms: .* beats its ceiling"):
        check_ceiling("demo-1", "aospec", 5.0, latency_ns=10, ceiling_ns=11)
    check_ceiling("demo-1", "aospec", 5.0, latency_ns=11, ceiling_ns=11)


def test_policy_specs_reject_unknown_names_and_keys():
    with pytest.raises(ConfigError, match="unknown policy 'fast'"):
        parse_policy("fast")
    with pytest.raises(ConfigError, match="unknown key 'budget'"):
        parse_policy("aospec:budget=3")
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_policy("aospec:rank")
    with pytest.raises(ConfigError, match="'rank' has invalid value 'loudest'"):
        parse_policy("aospec:rank=loudest")
    with pytest.raises(ConfigError, match="listed twice"):
        parse_policies("serial,serial")
    p = parse_policy("aospec:rank=likelihood:branch_budget=2:obs_drafter=patterns")
    assert (p.engine.rank, p.engine.branch_budget, p.config.obs_names) == ("likelihood", 2, ("patterns",))
    assert parse_policy("ceiling:depth=5").engine.obs_depth == 5
    assert parse_policy("spec-actions").twin().key == parse_policy("oracle-action").twin().key
    assert parse_policy("aospec").twin().key == parse_policy("ceiling").key == parse_policy("ceiling").twin().key
    assert parse_policy("action-only").twin().key == parse_policy("oracle-action:depth=2").twin().key
    assert parse_policy("obs-only").twin().key == parse_policy("spechop-cache").twin().key


def test_empty_trace_is_rejected():
    empty = Trace(id="e", task="t", harness="h", actor_model="m", source="s", steps=())
    with pytest.raises(ConfigError, match="has no steps"):
        replay_trace(empty, [parse_policy("serial")], [1.0], DrafterSet([]))


def test_bundled_sample_exists():
    assert Path(bundled_traces_path()).is_dir()


PS = "pgrep -a server"
PID_STEPS = [
    ("cat a.txt", "hello\n", 0.1, 40),
    (PS, "4242 server --port 80\n", 4.0, 30),
    (PS, "5151 server --port 80\n", 4.0, 30),
    ("ls", "a.txt\n", 0.1, 20),
    (PS, "6262 server --port 80\n", 4.0, 30),
]


def _pid_trace(task: str, pids=(4242, 5151, 6262)) -> Trace:
    steps = [
        (c, o.replace("4242", str(pids[0])).replace("5151", str(pids[1])).replace("6262", str(pids[2])), t, n)
        for c, o, t, n in PID_STEPS
    ]
    return make_trace([(c, f"pid {o}" if c == PS else o, t, n) for c, o, t, n in steps], task=task, id=task)


def test_replay_actor_matches_canonically_equal_histories_only_when_given_a_canonicaliser():
    from aospec.drafters.canonicalize import Canonicalizer

    trace = _pid_trace("t")
    turns = trace.history(3).turns
    variant = History(
        trace.history(0).task, (*turns[:2], turns[2].__class__(turns[2].action, "pid 1 server --port 80\n"))
    )
    exact = ReplayActor(trace, tpot_ns=1, clock=VirtualClock())
    canonical = ReplayActor(trace, tpot_ns=1, clock=VirtualClock(), canonicalizer=Canonicalizer(["pids"]))
    assert canonical.matches(variant) and not exact.matches(variant)
    other = History(variant.task, (*turns[:2], turns[2].__class__(turns[2].action, "pid 1 server --port 81\n")))
    assert not canonical.matches(other)


def test_canonical_acceptance_replays_losslessly_and_counts_canonical_hits_apart():
    from aospec.replay.metrics import summarize
    from aospec.replay.report import markdown_summary

    trace = _pid_trace("eval")
    train = [_pid_trace("train-a", (11, 12, 13)), _pid_trace("train-b", (21, 22, 23))]
    policies = parse_policies("spechop-cache,spechop-cache:accept=canonical,aospec,aospec:accept=canonical")
    # replay_trace checks every invariant: the committed trajectory equals the recording
    # (the real observations, never the accepted drafts) and no policy beats its ceiling.
    results = {r.policy: r for r in replay_trace(trace, policies, [10.0], DrafterSet(train))}
    exact, canonical = results["spechop-cache"], results["spechop-cache:accept=canonical"]
    # byte-identical hits ("cat a.txt", "ls": outputs shared by the training tasks) count as before
    assert exact.drafts_canonical_hit == 0 and canonical.drafts_hit == exact.drafts_hit == 2
    assert canonical.drafts_canonical_hit == 2  # the second and third pgrep: same line, new pid
    assert canonical.latency_ns < exact.latency_ns
    assert results["aospec:accept=canonical"].drafts_canonical_hit == 2
    assert results["aospec:accept=canonical"].latency_ns <= results["aospec"].latency_ns
    summaries = {s.policy: s for s in summarize(results.values())}
    assert summaries["spechop-cache:accept=canonical"].obs_canonical_hit_rate == pytest.approx(2 / 5)
    assert summaries["spechop-cache"].obs_canonical_hit_rate == 0.0
    assert "canonical hit" in markdown_summary(list(summaries.values()), {})
    with pytest.raises(ConfigError, match="canonicalizer 'colour'"):
        from aospec.replay.policies import check_drafter_names

        check_drafter_names(parse_policies("aospec:accept=canonical:canonicalizer=colour"))
