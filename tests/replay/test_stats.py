"""trace_stats on hand-built traces whose figures are known exactly."""

from __future__ import annotations

import numpy as np
import pytest
from aospec.replay import trace_stats
from aospec.replay.stats import tool_durations

from aospec.types import Action, Step, Trace


def _trace(id: str, task: str, durations: list[float | None], *, harness: str = "h", estimated: bool = True) -> Trace:
    steps = tuple(
        Step(
            Action.bash("ls" if k % 2 == 0 else "rm x"),
            "",
            output_tokens=10,
            output_tokens_estimated=estimated,
            tool_duration_s=d,
            model_latency_s=1.0,
            completed=d is not None,
        )
        for k, d in enumerate(durations)
    )
    return Trace(id, task, harness, "m", "src", steps)


def test_figures_of_a_small_set() -> None:
    traces = [
        _trace("a", "t1", [0.01, 2.0, 0.5, None]),
        _trace("b", "t1", [10.0, 0.04], harness="other", estimated=False),
        _trace("c", "t2", []),
    ]
    s = trace_stats(traces)
    d = np.array([0.01, 2.0, 0.5, 10.0, 0.04])
    assert (s.trials, s.steps, s.tasks) == (3, 6, 2)
    assert s.harnesses == {"h": 2, "other": 1}
    assert (s.timed_steps, s.untimed_steps, s.incomplete_steps) == (5, 1, 1)
    assert s.tool_time_p50_s == pytest.approx(np.quantile(d, 0.5)) == pytest.approx(0.5)
    assert s.tool_time_p90_s == pytest.approx(2.0 + 0.6 * (10.0 - 2.0))  # linear: rank 0.9 * 4 = 3.6
    assert s.tool_time_p99_s == pytest.approx(np.quantile(d, 0.99))
    assert s.tool_time_total_s == pytest.approx(12.55)
    assert (s.long_calls, s.long_call_share) == (2, pytest.approx(0.4))
    assert s.long_call_time_share == pytest.approx(12.0 / 12.55)
    assert (s.output_tokens, s.output_tokens_counted, s.output_tokens_estimated) == (60, 20, 40)
    assert (s.steps_tokens_counted, s.steps_tokens_estimated) == (2, 4)
    assert (s.read_only_steps, s.may_change_steps) == (3, 3)
    assert s.tools == {"bash": 6}
    assert list(tool_durations(traces)) == list(d)


def test_empty_and_untimed_sets_have_no_quantiles() -> None:
    for traces in ([], [_trace("a", "t", [None, None])]):
        s = trace_stats(traces)
        assert s.tool_time_p50_s is None and s.long_call_time_share is None and s.tool_time_mean_s is None
        assert s.to_json()["tool_time_p99_s"] is None


def test_to_json_is_plain_json() -> None:
    import json

    out = trace_stats([_trace("a", "t", [1.5])]).to_json()
    assert json.loads(json.dumps(out)) == out
    assert out["long_call_time_share"] == 1.0 and out["task_names"] == ["t"]
