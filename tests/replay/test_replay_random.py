"""Randomised traces through every policy: the replay invariants hold whatever the trace.

Traces repeat read-only commands at the same state with different outputs, interleave
writes, and mix instant and long tool times -- the cases where matching a speculative
fork to the right recorded step is subtle.
"""

from __future__ import annotations

from aospec.replay.policies import DEFAULT_POLICIES, DrafterSet, parse_policies
from aospec.replay.sweep import replay_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.types import Action, Step, Trace

COMMANDS = [
    "ls",
    "cat a.txt",
    "python run.py",
    "echo x >> a.txt",
    "pip install thing",
    "cat <<'EOF' > run.py\nprint(1)\nEOF",
]
OUTPUTS = [
    "<returncode>0</returncode>\n<output>\n</output>",
    "<returncode>0</returncode>\n<output>\nok\n</output>",
    "out-{}",
]

step_strategy = st.tuples(
    st.sampled_from(COMMANDS),
    st.sampled_from(OUTPUTS),
    st.integers(0, 40),
    st.sampled_from([0.0, 0.001, 0.3, 2.5, 30.0]),
    st.integers(1, 400),
)


def _trace(raw, task: str, k: int) -> Trace:
    steps = tuple(
        Step(
            action=Action.bash(cmd),
            observation=out.format(salt),
            output_tokens=tokens,
            tool_duration_s=t,
        )
        for cmd, out, salt, t, tokens in raw
    )
    return Trace(id=f"{task}-{k}", task=task, harness="h", actor_model="m", source="hypothesis", steps=steps)


POLICIES = parse_policies([*DEFAULT_POLICIES, "ceiling:depth=3", "aospec:obs_depth=2:depth=3"])  # (rank ablations are defaults)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    evaluated=st.lists(step_strategy, min_size=1, max_size=14),
    training=st.lists(st.lists(step_strategy, min_size=1, max_size=10), min_size=1, max_size=3),
    tpot=st.sampled_from([20.0, 1.0]),
)
def test_every_policy_replays_random_traces_losslessly_and_under_its_ceiling(evaluated, training, tpot):
    trace = _trace(evaluated, "eval-task", 0)
    train = [_trace(raw, f"train-task-{k}", k) for k, raw in enumerate(training)]
    results = replay_trace(trace, POLICIES, [tpot], DrafterSet(train))  # raises on any broken invariant
    serial = next(r for r in results if r.policy == "serial")
    for r in results:
        assert r.ceiling_ns <= r.latency_ns <= serial.latency_ns == r.serial_ns
