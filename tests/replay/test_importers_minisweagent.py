"""The mini-swe-agent importer on trajectories written by the real package (v1 and both v2 layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aospec.replay import load_traces
from aospec.replay.importers.minisweagent import parse_traj_text, read_traj
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.errors import TraceFormatError
from aospec.types import Action

DIR = Path(__file__).parent / "data" / "mini-swe-agent"
V1 = DIR / "v1-count-lines.traj.json"
V2_TEXT = DIR / "v2-text-count-lines.traj.json"
V2_TOOL = DIR / "v2-toolcall-count-lines.traj.json"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat count.txt"


def _messages(path: Path) -> list[dict]:
    return json.loads(path.read_text())["messages"]


@pytest.mark.parametrize("path", [V1, V2_TEXT])
def test_text_layouts_give_one_step_per_reply(path: Path) -> None:
    trace = read_traj(path)
    assert [s.action for s in trace.steps] == [
        Action.bash("ls"),
        Action.none(),
        Action.bash("wc -l < data.txt > count.txt"),
        Action.bash("sleep 4"),
        Action.bash(SUBMIT),
    ]
    assert trace.instruction is not None and trace.instruction.startswith("Your task: Count the lines")
    assert trace.harness == "mini-swe-agent" and trace.meta["exit_status"] == "Submitted"
    ls, fmt, _, sleep, _ = trace.steps
    assert "data.txt" in ls.observation and ls.reply is not None and "```bash\nls\n```" in ls.reply
    assert "EXACTLY ONE action" in fmt.observation and fmt.tool_duration_s is None
    assert "forgot the code block" in (fmt.reply or "")
    assert all(s.output_tokens_estimated for s in trace.steps)
    assert ls.output_tokens == -(-len(ls.reply) // 4)
    assert sleep.tool_duration_s is not None and sleep.tool_duration_s >= 1.9  # killed by the 2 s timeout
    assert ls.tool_duration_s is not None and ls.tool_duration_s < 1.0
    assert "timed out" in sleep.observation


def test_v1_takes_timings_from_message_timestamps() -> None:
    trace = read_traj(V1)
    msgs = _messages(V1)
    ls = trace.steps[0]
    assert ls.model_latency_s == pytest.approx(msgs[2]["timestamp"] - msgs[1]["timestamp"])
    assert ls.tool_duration_s == pytest.approx(msgs[3]["timestamp"] - msgs[2]["timestamp"])
    assert ls.started_at_s == pytest.approx(msgs[1]["timestamp"] - msgs[0]["timestamp"])
    assert trace.steps[-1].observation == "3\n"  # v1 shows the submission as the last observation
    assert trace.meta["trajectory_format"] == "mini-swe-agent-1" and trace.meta["mini_version"].startswith("1.")


def test_v2_format_error_and_submission() -> None:
    trace = read_traj(V2_TEXT)
    fmt, submit = trace.steps[1], trace.steps[-1]
    assert fmt.extra["interrupt_type"] == "FormatError"
    assert submit.observation == "" and submit.tool_duration_s is None and submit.completed
    assert submit.extra["exit_status"] == "Submitted"
    assert trace.steps[0].extra["returncode"] == 0 and trace.steps[3].extra["returncode"] == -1
    assert trace.meta["trajectory_format"] == "mini-swe-agent-1.1"


def test_v2_tool_calls_pair_by_id_and_use_counted_tokens() -> None:
    trace = read_traj(V2_TOOL)
    msgs = _messages(V2_TOOL)
    assert [s.action for s in trace.steps[:2]] == [Action.bash("ls"), Action.bash("cat data.txt")]
    ls, cat = trace.steps[:2]
    assert "one\ntwo\nthree" in cat.observation and "data.txt" in ls.observation
    assert ls.output_tokens == msgs[2]["extra"]["response"]["usage"]["completion_tokens"]
    assert not ls.output_tokens_estimated and cat.output_tokens == 0 and cat.model_latency_s is None
    assert ls.tool_duration_s == pytest.approx(msgs[3]["extra"]["timestamp"] - msgs[2]["extra"]["timestamp"])
    assert cat.tool_duration_s == pytest.approx(msgs[4]["extra"]["timestamp"] - msgs[3]["extra"]["timestamp"])
    fmt = trace.steps[2]
    assert fmt.action.is_none and fmt.output_tokens == 17 and not fmt.output_tokens_estimated
    assert fmt.reply is not None and "forgot" in fmt.reply
    assert trace.steps[-1].action == Action.bash(SUBMIT)


def test_load_traces_detects_traj_json() -> None:
    traces = load_traces(DIR)
    assert [t.id for t in traces] == ["v1-count-lines", "v2-text-count-lines", "v2-toolcall-count-lines"]


def _edited(tmp_path: Path, src: Path, edit) -> Path:
    obj = json.loads(src.read_text())
    edit(obj)
    p = tmp_path / src.name
    p.write_text(json.dumps(obj))
    return p


@pytest.mark.parametrize(
    ("src", "edit", "field"),
    [
        (V2_TOOL, lambda o: o["messages"][3].update(tool_call_id="call_nope"), "messages[3].tool_call_id"),
        (V2_TOOL, lambda o: o["messages"].pop(4), "messages[2].tool_calls[1]"),
        (V2_TEXT, lambda o: o["messages"][2].update(role="robot"), "messages[2].role"),
        (V2_TEXT, lambda o: o["messages"][2]["extra"].update(actions=[{"cmd": "ls"}]), "messages[2].extra.actions[0]"),
        (V1, lambda o: o.update(messages={}), "messages"),
        (V1, lambda o: o["messages"][3].update(content=5), "messages[3].content"),
        (V1, lambda o: o.update(trajectory_format="swe-agent-3"), "trajectory_format"),
    ],
)
def test_bad_trajectories_name_the_field(tmp_path: Path, src: Path, edit, field: str) -> None:
    p = _edited(tmp_path, src, edit)
    with pytest.raises(TraceFormatError) as info:
        read_traj(p)
    assert (info.value.path, info.value.field) == (str(p), field)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "exit", "x"])},
    optional={
        "content": st.none() | st.text(max_size=20) | st.lists(st.fixed_dictionaries({"text": st.text(max_size=5)})),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": st.sampled_from(["a", "b"]),
                    "function": st.fixed_dictionaries(
                        {
                            "name": st.sampled_from(["bash", "", "f"]),
                            "arguments": st.sampled_from(['{"command": "ls"}', "{", "[]", '{"x": 1}']),
                        }
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_call_id": st.sampled_from(["a", "b", 3]),
        "timestamp": st.floats() | st.integers(),
        "extra": st.fixed_dictionaries(
            {},
            optional={
                "actions": _json,
                "timestamp": st.floats(),
                "interrupt_type": st.just("FormatError"),
                "response": _json,
            },
        )
        | _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_message, max_size=6) | _json)
def test_random_trajectories_give_a_trace_or_trace_format_error(messages) -> None:
    text = json.dumps({"messages": messages} if isinstance(messages, list) else messages)
    try:
        (trace,) = parse_traj_text(Path("fuzz.traj.json"), text)
    except TraceFormatError:
        return
    assert all(s.output_tokens >= 0 for s in trace.steps)
