"""EVD: patterns, the pattern kernel, tool-time regression and the three rankings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from aospec.errors import ConfigError
from aospec.evd import CMD_SLOT, EVDEstimator, PatternKernel, observation_pattern, rank_drafts
from aospec.protocols import Kernel, ObservationDraft
from aospec.types import Action, Step, Trace

TIMEOUT = (
    "The last command <command>{}</command> timed out and has been killed.\n"
    "The output of the command was:\n <output>\n\n</output>\n"
    "Please try another command and make sure to avoid those requiring interactive input."
)


def _trace(pairs, task="t") -> Trace:
    steps = tuple(
        Step(action=Action.bash(cmd), observation=obs, output_tokens=10, tool_duration_s=t) for cmd, obs, t in pairs
    )
    return Trace(id=f"{task}-1", task=task, harness="h", actor_model="m", source="s", steps=steps)


def test_pattern_abstracts_numbers_paths_ids_and_the_echoed_command():
    a = observation_pattern(TIMEOUT.format("python train.py --epochs 3"), "python train.py --epochs 3")
    b = observation_pattern(TIMEOUT.format("pip install torch"), "pip install torch")
    assert a == b and CMD_SLOT in a
    assert observation_pattern("wrote 120 bytes to /tmp/x/y.txt in 0.5s") == observation_pattern(
        "wrote 7 bytes to /app/out.bin in 12s"
    )
    assert observation_pattern("commit deadbeefcafe1234") == observation_pattern("commit 0123456789abcdef")
    assert observation_pattern("ok") != observation_pattern("error")


def test_pattern_kernel_is_pattern_equality():
    k = PatternKernel()
    assert isinstance(k, Kernel)
    assert list(k.similarities("took 3 s", ["took 15 s", "failed", "took 1 s"])) == [1.0, 0.0, 1.0]


def test_tool_time_is_the_kernel_weighted_mean_of_history():
    est = EVDEstimator()
    est.fit(
        [
            _trace(
                [
                    ("python a.py", TIMEOUT.format("python a.py"), 30.0),
                    ("python b.py", TIMEOUT.format("python b.py"), 29.0),
                    ("wc -l f", "3 f\n", 0.01),
                    ("wc -l f", "5 f\n", 0.03),
                ]
            )
        ]
    )
    text = TIMEOUT.format("python c.py")
    timeout_draft = ObservationDraft(text, 0.3, template=observation_pattern(text, "python c.py"))
    assert est.tool_time(timeout_draft) == pytest.approx(29.5)
    assert est.tool_time(ObservationDraft("7 f\n", 0.9)) == pytest.approx(0.02)
    assert est.tool_time(ObservationDraft("never seen anything like it", 0.9)) == pytest.approx(est.prior_s)
    assert est.prior_s == pytest.approx((30 + 29 + 0.04) / 4)


def test_session_learns_from_the_run_without_changing_the_estimator():
    est = EVDEstimator()
    est.fit([_trace([("wc -l f", "1 f\n", 1.0)])])
    s1, s2 = est.session(), est.session()
    s1.observe(Action.bash("wc -l f"), "2 f\n", 3.0)
    d = ObservationDraft("3 f\n", 0.5)
    assert s1.tool_time(d) == pytest.approx(2.0)
    assert s2.tool_time(d) == pytest.approx(1.0)


class _LengthKernel:
    """A kernel without a ``key``: similarity by relative length (exercises the O(N) path)."""

    def similarities(self, candidate: str, observations: Sequence[str]) -> Sequence[float]:
        return [1.0 if abs(len(o) - len(candidate)) <= 2 else 0.0 for o in observations]


def test_non_grouped_kernels_are_evaluated_over_all_pairs():
    est = EVDEstimator(_LengthKernel())
    est.fit([_trace([("a", "abc", 2.0), ("b", "abcd", 4.0), ("c", "a" * 50, 100.0)])])
    assert est.tool_time(ObservationDraft("xyz", 0.5)) == pytest.approx(3.0)
    s = est.session()
    s.observe(Action.bash("d"), "wxyz", 6.0)
    assert s.tool_time(ObservationDraft("xyz", 0.5)) == pytest.approx(4.0)


def test_rankings_order_by_expected_hidden_time_likelihood_or_tool_time():
    est = EVDEstimator()
    est.fit([_trace([("python a.py", "long job finished\n", 30.0), ("ls", "short\n", 0.1)])])
    session = est.session()
    likely_short = ObservationDraft("short\n", 0.9)
    unlikely_long = ObservationDraft("long job finished\n", 0.2)
    drafts = [likely_short, unlikely_long, ObservationDraft("short\n", 0.5)]
    assert rank_drafts(drafts, "evd", 1, session) == [unlikely_long]  # 0.2*30 > 0.9*0.1
    assert rank_drafts(drafts, "likelihood", 1, session) == [likely_short]
    assert rank_drafts(drafts, "tooltime", 2, session) == [unlikely_long, likely_short]
    assert len(rank_drafts(drafts, "evd", 5, session)) == 2  # equal texts merged
    assert rank_drafts(drafts, "evd", 5, session, min_probability=0.3) == [likely_short]
    with pytest.raises(ConfigError, match="unknown ranking"):
        rank_drafts(drafts, "loudest", 1, session)
