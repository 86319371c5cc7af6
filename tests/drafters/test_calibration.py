"""Calibration: isotonic cells per (drafter, tool, distance) with backoff, JSON, outcomes."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from aospec.drafters.cache import ObservationCache
from aospec.drafters.calibration import (
    ANY,
    CalibratedActionDrafter,
    CalibratedRoutedActionDrafter,
    Calibration,
    Outcome,
    action_outcomes,
    calibrated,
    cross_fit_outcomes,
    expected_calibration_error,
    fit_action_calibration,
    observation_outcomes,
    reliability,
)
from aospec.drafters.history import HistoryActionDrafter
from aospec.integrations._mcp_common import MergedDrafter
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.types import Action, History, Step, Trace


def _overconfident(n: int, drafter: str = "d", tool: str = "cat", distance: int = 0) -> list[Outcome]:
    """Raw 0.9 hits 30% of the time, raw 0.2 hits 10%."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        out.append(Outcome(drafter, tool, distance, 0.9, rng.random() < 0.3))
        out.append(Outcome(drafter, tool, distance, 0.2, rng.random() < 0.1))
    return out


def test_a_fitted_calibration_maps_raw_scores_to_observed_hit_rates() -> None:
    cal = Calibration.fit(_overconfident(2000))
    assert abs(cal.p("d", "cat", 0, 0.9) - 0.3) < 0.05
    assert abs(cal.p("d", "cat", 0, 0.2) - 0.1) < 0.05
    assert cal.p("d", "cat", 0, 0.5) <= cal.p("d", "cat", 0, 0.9)  # monotone


def test_unseen_cells_back_off_to_the_drafter_and_unknown_drafters_keep_their_score() -> None:
    cal = Calibration.fit(_overconfident(500, tool="cat") + _overconfident(5, tool="ls"))
    assert ("d", "ls", "0") not in cal.cells  # too few outcomes for a cell of its own
    assert cal.p("d", "ls", 0, 0.9) == cal.p("d", ANY, 0, 0.9)
    assert cal.p("d", "python", 7, 0.9) == pytest.approx(cal.p("d", ANY, ANY, 0.9))
    assert cal.p("other", "cat", 0, 0.42) == 0.42


def test_the_json_form_round_trips_and_bad_input_names_the_field(tmp_path) -> None:
    cal = Calibration.fit(_overconfident(300))
    path = cal.save(tmp_path)
    assert path.name == "calibration.json"
    again = Calibration.load(tmp_path)
    for raw in (0.0, 0.2, 0.5, 0.9, 1.0):
        assert again.p("d", "cat", 0, raw) == cal.p("d", "cat", 0, raw)
    data = json.loads(path.read_text())
    data["cells"][0]["rates"][0] = 2.0
    with pytest.raises(ConfigError, match=r"cells\[0\]: rates must be in \[0, 1\]"):
        Calibration.from_json(data)
    with pytest.raises(ConfigError, match="not an aospec calibration"):
        Calibration.from_json({"cells": []})
    with pytest.raises(ConfigError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        Calibration.load(tmp_path / "bad.json")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=20, max_size=200))
def test_calibrated_probabilities_are_monotone_and_in_range(points: list[tuple[float, bool]]) -> None:
    cal = Calibration.fit([Outcome("d", "t", 0, raw, hit) for raw, hit in points], min_count=20)
    grid = [k / 20 for k in range(21)]
    ps = [cal.p("d", "t", 0, x) for x in grid]
    assert all(0.0 <= p <= 1.0 for p in ps)
    assert ps == sorted(ps)


def _trace(task: str, cmds: list[str]) -> Trace:
    steps = tuple(Step(Action.bash(c), f"out:{c}", output_tokens=5, tool_duration_s=0.1) for c in cmds)
    return Trace(task, task, "h", "m", "s", steps)


def test_outcomes_score_every_draft_against_what_happened() -> None:
    traces = [_trace("t1", ["ls", "pwd", "ls", "pwd"]), _trace("t2", ["ls", "pwd", "ls"])]
    cache = ObservationCache()
    cache.fit(traces)
    obs = list(observation_outcomes("cache", cache, traces))
    assert obs and all(o.distance == 0 and o.tool in ("ls", "pwd") for o in obs)
    assert any(o.hit for o in obs)  # repeats see the same output
    history = HistoryActionDrafter()
    history.fit(traces)
    acts = list(action_outcomes("history", history, traces, width=4, depth=2))
    assert {o.distance for o in acts} <= {0, 1} and any(o.hit for o in acts)


def test_cross_fitting_scores_each_fold_with_a_drafter_that_never_saw_it() -> None:
    traces = [_trace(f"t{k}", ["ls", "pwd"]) for k in range(4)]
    fitted_on: list[set[str]] = []

    class Spy(ObservationCache):
        def fit(self, train):  # type: ignore[override]
            fitted_on.append({t.task for t in train})
            super().fit(train)

    folds = cross_fit_outcomes(Spy, "cache", "observation", traces, folds=2)
    assert len(folds) == 2 and fitted_on == [{"t1", "t3"}, {"t0", "t2"}]
    with pytest.raises(ConfigError, match="at least two tasks"):
        cross_fit_outcomes(Spy, "cache", "observation", traces[:1])


def test_reliability_rows_and_calibration_error() -> None:
    outcomes = _overconfident(500)
    rows = reliability(outcomes, lambda o: o.raw, bins=10)
    assert [(r.low, r.count) for r in rows] == [(0.2, 500), (0.9, 500)]
    assert abs(rows[1].observed - 0.3) < 0.06
    cal = Calibration.fit(outcomes)
    before = expected_calibration_error(rows)["d"]
    after = expected_calibration_error(reliability(outcomes, lambda o: cal.p(o.drafter, o.tool, o.distance, o.raw)))["d"]
    assert after < before / 5


# -- ranking by calibrated probabilities ---------------------------------------------------


class _Loud:
    """Always proposes ``rm -rf /tmp/x`` next at 0.9: confident and never right."""

    def fit(self, train) -> None:
        self.fitted = len(train)

    async def propose(self, history, width, depth):
        return [ActionDraft(Action.bash("rm -rf /tmp/x"), 0, 0.9)]


class _Quiet:
    """Proposes the command that follows the last one in a fixed cycle, at 0.1: humble
    and always right on the cycle's traces."""

    CYCLE = ("ls", "pwd", "whoami")

    def fit(self, train) -> None:
        pass

    async def propose(self, history, width, depth):
        last = history.turns[-1].action.command if history.turns else None
        nxt = self.CYCLE[(self.CYCLE.index(last) + 1) % 3] if last in self.CYCLE else "ls"
        return [ActionDraft(Action.bash(nxt), 0, 0.1)]

    async def propose_routed(self, history, tool, width):
        return [ActionDraft(Action.bash("ls"), 0, 0.05)]


def _cycle_traces(tasks: int = 4, steps: int = 12) -> list[Trace]:
    return [_trace(f"t{k}", [_Quiet.CYCLE[i % 3] for i in range(steps)]) for k in range(tasks)]


def test_calibrated_ranking_puts_the_humble_right_drafter_before_the_loud_wrong_one() -> None:
    traces = _cycle_traces()
    loud = calibrated(_Loud(), "loud", fit_action_calibration("loud", _Loud, traces, min_count=5))
    quiet = calibrated(_Quiet(), "quiet", fit_action_calibration("quiet", _Quiet, traces, min_count=5))
    merged = MergedDrafter([loud, quiet])
    history = traces[0].history(4)  # ls, pwd, whoami, ls -> pwd
    raw = asyncio.run(MergedDrafter([_Loud(), _Quiet()]).propose(history, 2, 1))
    assert raw[0].action.command == "rm -rf /tmp/x"  # by raw scores the loud one wins
    drafts = asyncio.run(merged.propose(history, 2, 1))
    assert [d.action.command for d in drafts] == ["pwd", "rm -rf /tmp/x"]
    assert drafts[0].probability > 0.8 and drafts[1].probability < 0.2  # honest now


def test_calibration_wrapper_forwards_fit_and_routes_only_when_its_drafter_routes() -> None:
    traces = _cycle_traces()
    cal = fit_action_calibration("loud", _Loud, traces, min_count=5)
    loud = calibrated(_Loud(), "loud", cal)
    assert isinstance(loud, CalibratedActionDrafter) and not hasattr(loud, "propose_routed")
    loud.fit(traces)
    assert loud.fitted == len(traces)  # other attributes are the drafter's
    quiet = calibrated(_Quiet(), "quiet", cal)
    assert isinstance(quiet, CalibratedRoutedActionDrafter)
    # routed targets keep their raw scores (ranked among themselves only)
    routed = asyncio.run(quiet.propose_routed(traces[0].history(1), "ls", 4))
    assert [d.probability for d in routed] == [0.05]
    # no calibration: the drafter itself
    d = _Loud()
    assert calibrated(d, "loud", None) is d


def test_equal_calibrated_rates_keep_the_raw_order() -> None:
    # one isotonic block for every raw score: equal rates, the raw order breaks the tie
    cal = Calibration.fit([Outcome("d", "ls", 0, r, k % 2 == 0) for k, r in enumerate([0.1, 0.5, 0.9] * 20)])

    class Two:
        async def propose(self, history, width, depth):
            return [ActionDraft(Action.bash("ls a"), 0, 0.2), ActionDraft(Action.bash("ls b"), 0, 0.6)]

    drafts = asyncio.run(calibrated(Two(), "d", cal).propose(History("t"), 4, 1))
    by_p = sorted(drafts, key=lambda d: -d.probability)
    assert [d.action.command for d in by_p] == ["ls b", "ls a"]
    assert abs(drafts[0].probability - drafts[1].probability) < 1e-5


def test_no_calibration_from_a_single_task_and_a_bounded_number_of_boundaries() -> None:
    traces = _cycle_traces(tasks=1)
    assert fit_action_calibration("quiet", _Quiet, traces) is None
    seen: list[int] = []

    class Counting(_Quiet):
        async def propose(self, history, width, depth):
            seen.append(len(history.turns))
            return await super().propose(history, width, depth)

    fit_action_calibration("quiet", Counting, _cycle_traces(tasks=4, steps=12), boundaries=12, min_count=5)
    assert len(seen) == 12 and set(seen) == {0, 4, 8}  # every 4th boundary of each trace


def test_the_aospec_policy_ranks_its_action_drafters_calibrated_and_the_baselines_do_not() -> None:
    from aospec.replay.policies import DrafterSet, parse_policy

    assert parse_policy("aospec").config.calibrate_actions
    assert parse_policy("action-only").config.calibrate_actions
    assert not parse_policy("spec-actions").config.calibrate_actions
    assert not parse_policy("aospec:calibrate_actions=false").config.calibrate_actions
    ds = DrafterSet(_cycle_traces())
    raw, cal = ds.action("history"), ds.action("history", calibrated=True)
    assert raw is not cal and ds.action("history", calibrated=True) is cal
    assert ds.calibration("history") is ds.calibration("history")  # fit once
    history = _cycle_traces()[0].history(5)
    p_raw = {d.action.key: d.probability for d in asyncio.run(raw.propose(history, 4, 1))}
    p_cal = {d.action.key: d.probability for d in asyncio.run(cal.propose(history, 4, 1))}
    assert set(p_raw) == set(p_cal) and p_raw != p_cal


def test_a_drafter_that_fails_while_it_is_calibrated_keeps_its_raw_scores(capsys) -> None:
    class Broken(_Quiet):
        async def propose(self, history, width, depth):
            if len(history.turns) == 3:
                raise KeyError("boom")
            return await super().propose(history, width, depth)

    assert fit_action_calibration("broken", Broken, _cycle_traces(), min_count=5) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "broken action drafter failed" in err and "KeyError" in err
    d = Broken()
    assert calibrated(d, "broken", None) is d
