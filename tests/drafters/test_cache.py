"""ObservationCache: within-trajectory reuse keyed by (action, unchanged state)."""

from __future__ import annotations

import anyio
from aospec.drafters.cache import ObservationCache

from aospec.types import Action, History, Step, Trace


def _trace(pairs, task="t", id=None) -> Trace:
    steps = tuple(Step(action=Action.bash(c), observation=o, output_tokens=5, tool_duration_s=0.1) for c, o in pairs)
    return Trace(id=id or task, task=task, harness="h", actor_model="m", source="s", steps=steps)


def _history(pairs) -> History:
    h = History("task")
    for c, o in pairs:
        h = h.extend(Action.bash(c), o)
    return h


def _draft(drafter, history, cmd):
    return anyio.run(drafter.draft, history, Action.bash(cmd), 5)


def test_fit_learns_how_often_repeats_see_the_same_observation():
    cache = ObservationCache()
    cache.fit(
        [
            # unchanged state: 2 repeats, both identical
            _trace([("ls", "a\n"), ("cat a", "1\n"), ("ls", "a\n"), ("ls", "a\n")], "t1"),
            # a write between: the repeat differs
            _trace([("cat a", "1\n"), ("echo 2 > a", ""), ("cat a", "2\n")], "t2"),
        ]
    )
    assert cache.p_same_state == (2 + 1) / (2 + 2)
    assert cache.p_changed_state == (0 + 1) / (1 + 2)


def test_draft_reuses_the_last_observation_with_the_state_aware_probability():
    cache = ObservationCache()
    h = _history([("cat a", "1\n"), ("ls", "a\n")])
    (d,) = _draft(cache, h, "cat a")
    assert d.text == "1\n" and d.probability == cache.p_same_state
    h2 = h.extend(Action.bash("echo 2 > a"), "")
    (d2,) = _draft(cache, h2, "cat a")
    assert d2.text == "1\n" and d2.probability == cache.p_changed_state
    assert _draft(cache, h2, "cat b") == []


def test_cross_trajectory_results_need_several_tasks():
    cache = ObservationCache(min_traces=2)
    cache.fit([_trace([("pwd", "/app\n"), ("whoami", "root\n")], "t1"), _trace([("pwd", "/app\n")], "t2")])
    (d,) = _draft(cache, History("task"), "pwd")
    assert d.text == "/app\n" and 0 < d.probability < 1
    assert _draft(cache, History("task"), "whoami") == []


def test_incremental_index_matches_a_fresh_drafter_on_any_history():
    cache = ObservationCache()
    a = _history([("cat a", "1\n"), ("ls", "x\n")])
    b = _history([("cat a", "9\n")])
    _draft(cache, a, "cat a")
    longer = a.extend(Action.bash("cat a"), "3\n")
    assert _draft(cache, longer, "cat a")[0].text == "3\n"
    assert _draft(cache, b, "cat a")[0].text == "9\n"  # an unrelated history rebuilds the index
    assert _draft(cache, longer, "cat a") == _draft(ObservationCache(), longer, "cat a")
