"""Core value types: canonical actions, immutable steps and traces."""

from __future__ import annotations

import pickle
from dataclasses import FrozenInstanceError

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aospec.types import NO_ACTION_TOOL, Action, History, Step, Trace, Turn, canonical_json

_keys = st.text(max_size=6)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=8,
)


def test_equal_arguments_in_any_key_order_are_the_same_action() -> None:
    a = Action("edit", {"path": "x", "line": 3, "opts": {"b": 1, "a": [1, 2]}})
    b = Action("edit", {"opts": {"a": [1, 2], "b": 1}, "line": 3, "path": "x"})
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert a.key == '{"args":{"line":3,"opts":{"a":[1,2],"b":1},"path":"x"},"tool":"edit"}'
    assert len({a, b}) == 1


@given(st.text(min_size=1, max_size=8), st.dictionaries(_keys, _json, max_size=4))
def test_action_key_is_canonical_json_and_round_trips(tool: str, args: dict) -> None:
    a = Action(tool, args)
    assert a.key == canonical_json({"args": args, "tool": tool})
    assert Action.from_json(a.to_json()) == a
    assert pickle.loads(pickle.dumps(a)) == a
    reordered = dict(reversed(list(args.items())))
    assert Action(tool, reordered) == a


def test_shell_commands_are_kept_byte_for_byte() -> None:
    assert Action.bash("ls  -la") != Action.bash("ls -la")
    assert Action.bash("ls").command == "ls" and Action.bash("ls").tool == "bash"
    assert Action("read", {"command": "x"}).command is None


def test_none_action() -> None:
    none = Action.none()
    assert none.is_none and none.tool == NO_ACTION_TOOL and none.command is None and none == Action("none", {})


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Action("", {}),
        lambda: Action("t", {"x": float("nan")}),
        lambda: Action("t", {"x": object()}),
        lambda: Action("t", {1: "a"}),
        lambda: Action.from_json({"tool": "t", "args": {}, "extra": 1}),
        lambda: Action.from_json({"tool": "t", "args": []}),
        lambda: Action.from_json(["t"]),
    ],
)
def test_invalid_actions_are_rejected(bad) -> None:
    with pytest.raises(ValueError):
        bad()


def test_actions_steps_and_traces_are_immutable() -> None:
    a = Action("t", {"x": [1, {"y": 2}]})
    with pytest.raises(AttributeError):
        a.tool = "u"  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.args["x"] = 1  # type: ignore[index]
    assert a.args["x"] == (1, {"y": 2})
    step = Step(a, "out", 3)
    with pytest.raises(FrozenInstanceError):
        step.observation = "x"  # type: ignore[misc]
    assert (step.tool_duration_s, step.state_changed, step.completed, step.output_tokens_estimated) == (
        None,
        None,
        True,
        False,
    )


def test_trace_history_is_the_verified_prefix() -> None:
    steps = tuple(Step(Action.bash(f"echo {i}"), f"{i}\n", 1) for i in range(3))
    trace = Trace("id", "task", "h", "m", "src", steps, instruction="Do the task")
    assert len(trace) == 3
    h = trace.history(2)
    assert h == History("Do the task", (Turn(Action.bash("echo 0"), "0\n"), Turn(Action.bash("echo 1"), "1\n")))
    assert h.actions == (Action.bash("echo 0"), Action.bash("echo 1"))
    assert trace.history().extend(Action.bash("ls"), "x") == History(
        "Do the task", (*trace.history().turns, Turn(Action.bash("ls"), "x"))
    )
    assert Trace("id", "task", "h", "m", "src", steps).history(0) == History("task")
