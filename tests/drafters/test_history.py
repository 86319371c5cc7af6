"""HistoryActionDrafter: skeleton n-grams, successors and repetition, with lookahead."""

from __future__ import annotations

import anyio
import pytest
from aospec.drafters.history import HistoryActionDrafter, skeleton

from aospec.errors import ConfigError
from aospec.types import Action, History, Step, Trace


def _trace(cmds, task) -> Trace:
    steps = tuple(Step(action=Action.bash(c), observation="ok", output_tokens=5, tool_duration_s=1.0) for c in cmds)
    return Trace(id=task, task=task, harness="h", actor_model="m", source="s", steps=steps)


def _history(cmds) -> History:
    h = History("task")
    for c in cmds:
        h = h.extend(Action.bash(c), "ok")
    return h


def _propose(d, h, width=8, depth=1):
    return anyio.run(d.propose, h, width, depth)


WRITE = "cat <<'EOF' > {}\nprint('hi')\nEOF"
TRAIN = [
    _trace(["ls", WRITE.format("train.py"), "python train.py", "ls -la"], "t1"),
    _trace(["pwd", WRITE.format("solve.py"), "python solve.py", "cat out.txt"], "t2"),
    _trace(["ls", WRITE.format("fit.py"), "python fit.py"], "t3"),
]


def test_skeleton_turns_the_previous_command_paths_into_slots():
    prev = Action.bash(WRITE.format("train.py"))
    assert skeleton(Action.bash("python train.py"), prev) == "python \x000\x00"
    assert skeleton(Action.bash("python /app/train.py"), prev) == "python /app/\x000\x00"
    assert skeleton(Action.bash("python train.pyc"), prev) == "python train.pyc"
    assert skeleton(Action.bash("ls"), prev) == "ls"


def test_write_then_run_is_learned_across_tasks():
    d = HistoryActionDrafter()
    d.fit(TRAIN)
    drafts = _propose(d, _history(["ls", WRITE.format("model.py")]))
    assert drafts[0].action == Action.bash("python model.py")
    assert drafts[0].offset == 0 and 0 < drafts[0].probability <= 1
    assert all(x.probability <= drafts[0].probability for x in drafts)


def test_within_trace_successors_and_repetition():
    d = HistoryActionDrafter()
    d.fit(TRAIN)
    h = _history(["make build", "./run --fast", "vim x", "make build"])
    keys = [x.action for x in _propose(d, h)]
    assert Action.bash("./run --fast") in keys[:2]
    assert len(_propose(d, h, width=3)) == 3


def test_lookahead_goes_only_through_read_only_actions():
    d = HistoryActionDrafter()
    d.fit([_trace(["ls", "cat a.txt", "ls", "cat a.txt", "ls", "cat a.txt"], "t1"), _trace(["ls", "cat a.txt"], "t2")])
    ahead = _propose(d, _history(["cat a.txt"]), width=8, depth=2)
    assert any(x.offset == 1 for x in ahead)
    d2 = HistoryActionDrafter()
    d2.fit([_trace(["rm x", "touch y", "rm x", "touch y"], "t1"), _trace(["rm x", "touch y"], "t2")])
    ahead2 = _propose(d2, _history(["touch y"]), width=8, depth=2)
    assert ahead2 and all(x.offset == 0 for x in ahead2)  # "rm x" may change state: nothing behind it


def _h_trace(cmds, task, harness, observation="ok") -> Trace:
    steps = tuple(Step(action=Action.bash(c), observation=observation, output_tokens=5) for c in cmds)
    return Trace(id=task, task=task, harness=harness, actor_model="m", source="s", steps=steps)


def test_recent_transitions_outweigh_old_ones_with_time_decay():
    # "make" was followed by "./old" three times early on, by "./new" once just now.
    cmds = ["make", "./old", "vim a", "make", "./old", "vim a", "make", "./old"]
    cmds += [f"grep x f{k}" for k in range(12)] + ["make", "./new", "vim a", "make"]
    h = _history(cmds)
    decayed, flat = HistoryActionDrafter(half_life=4), HistoryActionDrafter(half_life=0)
    for d in (decayed, flat):
        d.fit(TRAIN)
    p = {
        name: {x.action.command: x.probability for x in _propose(d, h, width=32)}
        for name, d in (("decayed", decayed), ("flat", flat))
    }
    assert p["flat"]["./old"] > p["flat"]["./new"]
    assert p["decayed"]["./new"] > p["decayed"]["./old"]
    with pytest.raises(ConfigError, match="half_life"):
        HistoryActionDrafter(half_life=-1)


# Two harnesses that continue "ls" differently; h2 has more data, and its own observation format.
H1 = [_h_trace(["ls", "pwd", "ls", "pwd"], f"a{k}", "h1", "<returncode>0</returncode>") for k in range(2)]
H2 = [_h_trace(["ls", "whoami", "ls", "whoami"], f"b{k}", "h2", '{"ok": true}') for k in range(6)]


def _first(d, h):
    return _propose(d, h, width=8)[0].action.command


def test_per_harness_models_keep_each_harness_own_transitions():
    pooled = HistoryActionDrafter()
    pooled.fit(H1[:1] + H2)  # one harness's traces only would give no per-harness model
    assert pooled.harnesses == ("h1", "h2")
    fixed = HistoryActionDrafter(harness="h1")
    fixed.fit(H1 + H2)
    ls_h1 = (
        History("t")
        .extend(Action.bash("cd /app"), "<returncode>0</returncode>")
        .extend(Action.bash("ls"), "<returncode>0</returncode>")
    )
    ls_h2 = History("t").extend(Action.bash("cd /app"), "{}").extend(Action.bash("ls"), '{"files": []}')
    assert _first(fixed, ls_h1) == "pwd" and _first(fixed, ls_h2) == "pwd"  # the option wins
    inferred = HistoryActionDrafter()
    inferred.fit(H1 + H2)
    assert _first(inferred, ls_h1) == "pwd"  # observation format says h1
    assert _first(inferred, ls_h2) == "whoami"
    single = HistoryActionDrafter()
    single.fit(H1)
    assert single.harnesses == ()


def test_a_harness_without_data_for_a_context_backs_off_to_the_other_harnesses():
    # Only h2 ever ran "id"; h1 (little data) inherits h2's estimate for what follows it.
    h2 = [_h_trace(["id", "uname -a", "id", "uname -a"], f"b{k}", "h2", "{}") for k in range(3)]
    d = HistoryActionDrafter(harness="h1")
    d.fit(H1 + h2)
    hist = (
        History("t")
        .extend(Action.bash("ls"), "<returncode>0</returncode>")
        .extend(Action.bash("id"), "<returncode>0</returncode>")
    )
    assert _first(d, hist) == "uname -a"


def _call_trace(task: str, origin: str, destination: str) -> Trace:
    args = {"origin": origin, "destination": destination, "date": "2024-05-20"}
    calls = [Action("get_user_details", {"user_id": f"u_{task}"}), Action("search_direct_flight", args)]
    calls.append(Action("search_onestop_flight", args))
    steps = tuple(Step(action=a, observation="[]", output_tokens=5) for a in calls)
    return Trace(id=task, task=task, harness="tau", actor_model="m", source="s", steps=steps)


def test_tool_calls_are_modelled_with_the_previous_calls_argument_values_as_slots():
    d = HistoryActionDrafter()
    d.fit([_call_trace("t1", "JFK", "SEA"), _call_trace("t2", "SFO", "ORD")])
    search = Action("search_direct_flight", {"origin": "BOS", "destination": "LAX", "date": "2024-06-01"})
    h = History("task").extend(Action("get_user_details", {"user_id": "x"}), "{}").extend(search, "[]")
    assert skeleton(Action("search_onestop_flight", dict(search.args)), search) is not None
    expected = Action("search_onestop_flight", {"origin": "BOS", "destination": "LAX", "date": "2024-06-01"})
    assert _propose(d, h)[0].action == expected


# -- routed proposals (aospec.protocols.RoutedActionDrafter) --------------------------------


def _routed(d, h, tool, width=4):
    return anyio.run(d.propose_routed, h, tool, width)


def test_routed_proposals_keep_only_the_routed_program_with_its_conditional_probability():
    from aospec.specbox.routers import tool_label  # the router's own label rule

    d = HistoryActionDrafter(label=tool_label)
    d.fit(TRAIN)
    h = _history(["make build", "./run --fast", "vim x", "make build", "cd /app && make test"])
    plain = {x.action: x.probability for x in _propose(d, h, width=50)}
    routed = _routed(d, h, "make", width=50)
    assert routed and {tool_label(x.action) for x in routed} == {"make"}
    assert {x.offset for x in routed} == {0}
    for x in routed:
        if x.action in plain:  # conditioned on the tool: never less likely than unconditioned
            assert plain[x.action] <= x.probability <= 1
    assert sum(x.probability for x in routed) <= 1 + 1e-9
    assert [x.action for x in _routed(d, h, "./run")] == [Action.bash("./run --fast")]
    assert _routed(d, h, "pytest") == []
    assert _routed(d, h, "make", width=0) == []


def test_routed_proposals_reach_a_test_command_older_than_the_repetition_window():
    from aospec.specbox.routers import tool_label

    d = HistoryActionDrafter(label=tool_label, max_recent=3)
    d.fit(TRAIN)
    h = _history(["python -m pytest -q tests", "cat a.py", "sed -i s/1/2/ a.py", "cat b.py", "ls", "grep x a.py"])
    assert Action.bash("python -m pytest -q tests") not in [x.action for x in _propose(d, h, width=50)]
    routed = {x.action: x.probability for x in _routed(d, h, "python")}
    assert 0 < routed[Action.bash("python -m pytest -q tests")] <= 1  # besides the skeleton's `python a.py`


def test_routed_proposals_see_past_a_cd_prefix():
    from aospec.specbox.routers import tool_label

    d = HistoryActionDrafter(label=tool_label)
    d.fit(TRAIN)
    h = _history(["cd /app && make test", "cd /app && vim x.c", "cd /app", "ls"])
    routed = [x.action for x in _routed(d, h, "make", width=50)]
    assert Action.bash("cd /app && make test") in routed  # labelled 'make', not 'cd'
    assert {tool_label(a) for a in routed} == {"make"}
    assert [x.action for x in _routed(d, h, "cd", width=50)] == [Action.bash("cd /app")]


def test_routed_proposals_need_the_label_function():
    d = HistoryActionDrafter()
    d.fit(TRAIN)
    with pytest.raises(ConfigError, match="label="):
        _routed(d, _history(["ls"]), "ls")
