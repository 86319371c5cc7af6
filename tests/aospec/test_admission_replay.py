"""The speculation controller in replay: the same engine, in virtual time, on the bundled
recordings. Its decisions are deterministic (two replays agree to the nanosecond), it never
changes what is committed (replay checks every trajectory against the recording and every
policy against its ceiling), ``admission=off`` launches every guess as before, and the
model fitted by replaying traces (``aospec.replay.calibrate``) is one an engine loads."""

from __future__ import annotations

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.calibrate import fit_admission
from aospec.replay.policies import DrafterSet, parse_policies
from aospec.replay.sweep import replay_trace

from aospec.admission import AdmissionModel, Candidate, GuardState
from aospec.errors import ConfigError


@pytest.fixture(scope="module")
def bundled():
    return load_traces([bundled_traces_path()])


def _fold(traces, trace):
    return DrafterSet([t for t in traces if t.task != trace.task])


def test_the_controller_decides_the_same_every_time_and_wastes_far_less(bundled):
    trace = max(bundled, key=len)
    policies = parse_policies("aospec,aospec:admission=off")
    first = replay_trace(trace, policies, [20.0, 1.0], _fold(bundled, trace))
    again = replay_trace(trace, policies, [20.0, 1.0], _fold(bundled, trace))
    assert first == again  # deterministic, in virtual time
    by = {(r.policy, r.tpot_ms): r for r in first}
    for tpot in (20.0, 1.0):
        on, off = by[("aospec", tpot)], by[("aospec:admission=off", tpot)]
        assert on.forks_launched < off.forks_launched
        assert on.wasted_tool_ns < off.wasted_tool_ns / 4
        assert on.latency_ns <= on.serial_ns and on.ceiling_ns <= on.latency_ns


def test_a_model_fitted_by_replaying_traces_is_saved_loaded_and_used(bundled, tmp_path):
    train = bundled[:6]
    model = fit_admission(train)
    assert len(model.hits) > 0
    assert model.costs.decode.n == 0  # the endpoint's decode time is learned live, not from traces
    # ...and so are the guard's realised steps: a model fitted further keeps its own
    assert not model.guard.window and not model.guard.guarded
    mine = AdmissionModel()
    mine.guard = GuardState([(0.0, 1.0)] * 3, guarded=True)
    fit_admission(train[:2], model=mine)
    assert list(mine.guard.window) == [(0.0, 1.0)] * 3 and mine.guard.guarded
    path = tmp_path / "calibration.json"
    model.save(path)
    loaded = AdmissionModel.load(path)
    c = Candidate("target", "ChargedActionDrafter", "ls", 0, 0.5)
    assert loaded.hits.p_hit(c) == pytest.approx(model.hits.p_hit(c))
    # fitting on held-out drafters: the fitted p(hit) of confident targets is below their raw score
    assert model.hits.p_hit(Candidate("target", "ChargedActionDrafter", "python", 0, 0.9)) < 0.9
    with pytest.raises(ConfigError, match="oracle"):
        fit_admission(train, "ceiling")
    with pytest.raises(ConfigError, match="at least one trace"):
        fit_admission([])
