"""HistoryActionDrafter: skeleton n-grams, successors and repetition, with lookahead."""

from __future__ import annotations

import anyio

from aospec.types import Action, History, Step, Trace
from drafters.history import HistoryActionDrafter, skeleton


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
