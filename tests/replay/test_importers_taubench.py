"""The tau-bench importer on real historical trajectories (fixture excerpt, whole shared set when present)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from aospec.replay import load_traces, trace_stats
from aospec.replay.importers.taubench import RESPOND_TOOL, parse_taubench_text, read_taubench
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.effects import step_effect
from aospec.errors import TraceFormatError
from aospec.types import Action, Effect

FIXTURE = Path(__file__).parent / "data" / "taubench" / "gpt-4o-airline.two-tasks.json"
SHARED = Path("/work/shared/traces/tau-bench-gpt-4o-airline/gpt-4o-airline.even-tasks.json")


def _records(path: Path) -> list[dict]:
    return json.loads(path.read_text())


def _check_every_call_paired(path: Path) -> None:
    records = _records(path)
    traces = read_taubench(path)
    assert len(traces) == len(records)
    for rec, trace in zip(records, traces, strict=True):
        traj = rec["traj"]
        # call ids are reused across a transcript, so a call is answered by the tool
        # messages right after its own assistant message
        pairs = []
        for i, m in enumerate(traj):
            if m["role"] == "assistant" and m.get("tool_calls"):
                following = []
                for t in traj[i + 1 :]:
                    if t["role"] != "tool":
                        break
                    following.append(t)
                answers = {t["tool_call_id"]: t["content"] for t in following}
                assert len(answers) == len(following) == len(m["tool_calls"])
                pairs += [(c, answers[c["id"]]) for c in m["tool_calls"]]
        texts = [m for m in traj if m["role"] == "assistant" and not m.get("tool_calls")]
        tool_steps = [s for s in trace.steps if s.action.tool != RESPOND_TOOL]
        assert len(tool_steps) == len(pairs) == sum(1 for m in traj if m["role"] == "tool")
        for (call, answer), step in zip(pairs, tool_steps, strict=True):
            assert step.action == Action(call["function"]["name"], json.loads(call["function"]["arguments"]))
            assert step.observation == answer and step.extra["tool_call_id"] == call["id"]
        calls = pairs
        assert len(trace) == len(calls) + len(texts)
        assert all(s.tool_duration_s is None and s.model_latency_s is None for s in trace.steps)
        assert all(s.output_tokens_estimated for s in trace.steps)


def test_every_tool_call_is_paired_with_its_answer() -> None:
    _check_every_call_paired(FIXTURE)


@pytest.mark.skipif(not SHARED.is_file(), reason="the shared tau-bench set is not on this machine")
def test_whole_shared_set_imports_with_every_tool_call_paired() -> None:
    _check_every_call_paired(SHARED)
    stats = trace_stats(load_traces(SHARED))
    assert stats.trials == 100 and stats.steps == 577 + 586
    assert stats.tools[RESPOND_TOOL] == 586


def test_replies_to_the_user_are_observed_by_the_next_user_message() -> None:
    trace = read_taubench(FIXTURE)[0]
    traj = _records(FIXTURE)[0]["traj"]
    first = trace.steps[0]
    assert first.action == Action(RESPOND_TOOL, {"content": traj[2]["content"]})
    assert first.observation == traj[3]["content"] and first.reply == traj[2]["content"]
    assert trace.instruction == traj[1]["content"] and trace.meta["system_prompt"] == traj[0]["content"]
    assert (trace.id, trace.task, trace.actor_model) == (
        "gpt-4o-airline.two-tasks/task-0/trial-0",
        "airline/0",
        "gpt-4o",
    )
    assert trace.meta["reward"] == 0.0 and trace.meta["info"]["task"]["user_id"] == "mia_li_3668"


def test_text_alongside_tool_calls_is_the_first_calls_reply() -> None:
    trace = read_taubench(FIXTURE)[1]
    rec = _records(FIXTURE)[1]
    mixed = [m for m in rec["traj"] if m["role"] == "assistant" and m.get("tool_calls") and m.get("content")]
    assert mixed
    replies = [s.reply for s in trace.steps if s.action.tool != RESPOND_TOOL and s.reply]
    assert replies == [m["content"] for m in mixed]


def test_tau_bench_effects() -> None:
    steps = [s for t in read_taubench(FIXTURE) for s in t.steps]
    by_tool = {s.action.tool: step_effect(s) for s in steps}
    assert by_tool[RESPOND_TOOL] is Effect.READ_ONLY
    assert all(e is Effect.READ_ONLY for t, e in by_tool.items() if t.startswith(("get_", "search_")) or t == "think")
    assert any(e is Effect.MAY_CHANGE for e in by_tool.values())


def _write(tmp_path: Path, records: list[dict]) -> Path:
    p = tmp_path / "gpt-4o-airline.bad.json"
    p.write_text(json.dumps(records))
    return p


def _first_call_index(traj: list[dict]) -> int:
    return next(i for i, m in enumerate(traj) if m.get("tool_calls"))


@pytest.mark.parametrize(
    ("edit", "field_fmt"),
    [
        (lambda traj, i: traj.pop(i + 1), "traj[{i}].tool_calls[0].id"),
        (lambda traj, i: traj[i + 1].update(tool_call_id="call_other"), "traj[{j}].tool_call_id"),
        (lambda traj, i: traj.insert(i + 1, copy.deepcopy(traj[i + 1])), "traj[{k}].tool_call_id"),
        (
            lambda traj, i: traj[i]["tool_calls"][0]["function"].update(arguments="{oops"),
            "traj[{i}].tool_calls[0].function.arguments",
        ),
        (lambda traj, i: traj[i + 1].update(name="book_everything"), "traj[{j}].name"),
        (lambda traj, i: traj[i].update(role="wizard"), "traj[{i}].role"),
    ],
)
def test_unpaired_or_malformed_calls_name_the_record_and_field(tmp_path: Path, edit, field_fmt: str) -> None:
    records = _records(FIXTURE)
    traj = records[1]["traj"]
    i = _first_call_index(traj)
    edit(traj, i)
    p = _write(tmp_path, records)
    with pytest.raises(TraceFormatError) as info:
        read_taubench(p)
    assert (info.value.path, info.value.line) == (str(p), 2)
    assert info.value.field == field_fmt.format(i=i, j=i + 1, k=i + 2)


def test_records_must_be_a_list_of_known_objects(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="JSON list"):
        parse_taubench_text(tmp_path / "x.json", "{}")
    with pytest.raises(TraceFormatError) as info:
        parse_taubench_text(tmp_path / "x.json", json.dumps([{"task_id": 1, "traj": [], "extra_key": 1}]))
    assert (info.value.line, info.value.field) == (1, "extra_key")


_msg = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "other"])},
    optional={
        "content": st.none() | st.text(max_size=10) | st.integers(),
        "tool_calls": st.none()
        | st.lists(
            st.fixed_dictionaries(
                {
                    "id": st.sampled_from(["a", "b", ""]),
                    "function": st.fixed_dictionaries(
                        {
                            "name": st.sampled_from(["get_x", "", "book"]),
                            "arguments": st.sampled_from(["{}", '{"a": 1}', "[", "3"]),
                        }
                    ),
                }
            ),
            max_size=2,
        ),
        "tool_call_id": st.sampled_from(["a", "b", None]),
        "name": st.sampled_from(["get_x", "book"]),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries({"task_id": st.integers(0, 3) | st.text(max_size=2), "traj": st.lists(_msg, max_size=6)}),
        max_size=3,
    )
)
def test_random_records_give_traces_or_trace_format_error(records: list[dict]) -> None:
    try:
        traces = parse_taubench_text(Path("fuzz.json"), json.dumps(records))
    except TraceFormatError:
        return
    assert len(traces) == len(records)
