"""Calibration: isotonic cells per (drafter, tool, distance) with backoff, JSON, outcomes."""

from __future__ import annotations

import json
import random

import pytest
from aospec.drafters.cache import ObservationCache
from aospec.drafters.calibration import (
    ANY,
    Calibration,
    Outcome,
    action_outcomes,
    cross_fit_outcomes,
    expected_calibration_error,
    observation_outcomes,
    reliability,
)
from aospec.drafters.history import HistoryActionDrafter
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.errors import ConfigError
from aospec.types import Action, Step, Trace


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
