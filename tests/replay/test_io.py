"""Canonical JSONL: exact round trips, strict validation, and load_traces over directories."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest
from aospec.replay import bundled_traces_path, dump_jsonl, load_traces, read_jsonl, write_jsonl
from aospec.replay.io import freeze_json, parse_jsonl_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aospec.errors import TraceFormatError, TraceImportError
from aospec.types import SCHEMA_VERSION, Action, Step, Trace

DATA = Path(__file__).parent / "data"
TB1_DIR = DATA / "tb1"


def _trace(id: str = "t1", steps: int = 2, **kw) -> Trace:
    return Trace(
        id=id,
        task=kw.pop("task", "task-a"),
        harness="h",
        actor_model="m",
        source="test",
        steps=tuple(
            Step(action=Action.bash(f"echo {i}"), observation=f"{i}\n", output_tokens=i, tool_duration_s=0.5 * i)
            for i in range(steps)
        ),
        **kw,
    )


# ---------------------------------------------------------------- round trips


def test_bundled_sample_round_trips_exactly(tmp_path: Path) -> None:
    traces = load_traces(bundled_traces_path())
    out = write_jsonl(traces, tmp_path / "all.jsonl")
    back = read_jsonl(out)
    assert back == traces
    assert dump_jsonl(back) == out.read_text(encoding="utf-8")
    write_jsonl(back, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == out.read_bytes()


def test_several_traces_share_one_file_in_order(tmp_path: Path) -> None:
    traces = [_trace("b", 3), _trace("a", 0), _trace("c", 1, instruction="do it", meta={"k": [1, {"x": None}]})]
    p = write_jsonl(traces, tmp_path / "x.jsonl")
    back = read_jsonl(p)
    assert [t.id for t in back] == ["b", "a", "c"]
    assert [len(t) for t in back] == [3, 0, 1]
    assert back[2].meta["k"][1]["x"] is None
    lines = p.read_text().splitlines()
    assert len(lines) == 3 + 3 + 1
    # no step has a CPU time: written as schema 1, exactly as before schema 2 existed
    assert json.loads(lines[0])["type"] == "trace" and json.loads(lines[0])["schema"] == 1
    assert "tool_cpu_s" not in json.loads(lines[1])


def test_a_trace_with_cpu_times_is_schema_2_and_round_trips(tmp_path: Path) -> None:
    base = _trace(steps=2)
    steps = (replace(base.steps[0], tool_cpu_s=1.25), base.steps[1])
    trace = replace(base, steps=steps)
    p = write_jsonl([trace, _trace("other", 1)], tmp_path / "cpu.jsonl")
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    assert [r["schema"] for r in lines if r["type"] == "trace"] == [SCHEMA_VERSION, 1]
    assert list(lines[1])[5:7] == ["tool_duration_s", "tool_cpu_s"]
    assert [lines[1]["tool_cpu_s"], lines[2]["tool_cpu_s"]] == [1.25, None]
    back = read_jsonl(p)
    assert back[0] == trace and [s.tool_cpu_s for s in back[0].steps] == [1.25, None]
    assert dump_jsonl(back) == p.read_text()


def test_header_and_step_field_order_is_fixed(tmp_path: Path) -> None:
    lines = dump_jsonl([_trace(steps=1)]).splitlines()
    assert list(json.loads(lines[0])) == [
        "type", "schema", "id", "task", "harness", "actor_model", "source", "instruction", "meta",
    ]  # fmt: skip
    assert list(json.loads(lines[1]))[:4] == ["type", "action", "observation", "output_tokens"]


def test_read_values_are_immutable(tmp_path: Path) -> None:
    p = write_jsonl([_trace(meta={"k": [1, 2]})], tmp_path / "x.jsonl")
    (t,) = read_jsonl(p)
    assert isinstance(t.meta, MappingProxyType)
    assert t.meta["k"] == (1, 2)
    with pytest.raises(TypeError):
        t.meta["k"] = 3  # type: ignore[index]


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    write_jsonl([_trace()], tmp_path / "sub" / "x.jsonl")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["x.jsonl"]


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
_json_scalar = (
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _text | st.floats(allow_nan=False, allow_infinity=False)
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_seconds = st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False)
_action = st.one_of(
    st.builds(Action.bash, _text),
    st.just(Action.none()),
    st.builds(lambda t, a: Action(t, a), st.text(min_size=1, max_size=10), st.dictionaries(_text, _json, max_size=3)),
)
_step = st.builds(
    Step,
    action=_action,
    observation=_text,
    output_tokens=st.integers(0, 10**6),
    output_tokens_estimated=st.booleans(),
    tool_duration_s=_seconds,
    tool_cpu_s=_seconds,
    model_latency_s=_seconds,
    state_changed=st.none() | st.booleans(),
    version_before=st.none() | _text,
    version_after=st.none() | _text,
    reply=st.none() | _text,
    completed=st.booleans(),
    started_at_s=st.none() | st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    extra=st.dictionaries(_text, _json, max_size=3).map(freeze_json),
)
_trace_st = st.builds(
    Trace,
    id=st.text(min_size=1, max_size=10),
    task=_text,
    harness=_text,
    actor_model=_text,
    source=_text,
    steps=st.lists(_step, max_size=4).map(tuple),
    instruction=st.none() | _text,
    meta=st.dictionaries(_text, _json, max_size=3).map(freeze_json),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_trace_st, min_size=1, max_size=3))
def test_any_trace_round_trips_exactly(traces: list[Trace]) -> None:
    text = dump_jsonl(traces)
    back = parse_jsonl_text(text, "<mem>")
    assert back == traces
    assert dump_jsonl(back) == text


# ---------------------------------------------------------------- validation

GOOD_HEADER = {"type": "trace", "schema": 1, "id": "t", "task": "x", "harness": "h", "actor_model": "m", "source": "s"}
GOOD_STEP = {
    "type": "step",
    "action": {"tool": "bash", "args": {"command": "ls"}},
    "observation": "",
    "output_tokens": 1,
}


def _lines(*records: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _err(text: str, tmp_path: Path) -> TraceFormatError:
    p = tmp_path / "bad.jsonl"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(TraceFormatError) as info:
        read_jsonl(p)
    assert info.value.path == str(p)
    assert str(p) in str(info.value)
    return info.value


def test_minimal_records_use_documented_defaults(tmp_path: Path) -> None:
    p = tmp_path / "ok.jsonl"
    p.write_text(_lines(GOOD_HEADER, GOOD_STEP))
    (t,) = read_jsonl(p)
    assert t.instruction is None and dict(t.meta) == {}
    (s,) = t.steps
    assert (s.tool_duration_s, s.state_changed, s.completed, s.output_tokens_estimated) == (None, None, True, False)


@pytest.mark.parametrize(
    ("records", "line", "field"),
    [
        ([{**GOOD_HEADER, "colour": 1}], 1, "colour"),
        ([GOOD_HEADER, {**GOOD_STEP, "tool_time": 1.0}], 2, "tool_time"),
        ([{k: v for k, v in GOOD_HEADER.items() if k != "harness"}], 1, "harness"),
        ([GOOD_HEADER, {k: v for k, v in GOOD_STEP.items() if k != "observation"}], 2, "observation"),
        ([GOOD_HEADER, {**GOOD_STEP, "output_tokens": "7"}], 2, "output_tokens"),
        ([GOOD_HEADER, {**GOOD_STEP, "output_tokens": -1}], 2, "output_tokens"),
        ([GOOD_HEADER, {**GOOD_STEP, "output_tokens": True}], 2, "output_tokens"),
        ([GOOD_HEADER, {**GOOD_STEP, "tool_duration_s": -0.5}], 2, "tool_duration_s"),
        ([GOOD_HEADER, {**GOOD_STEP, "tool_duration_s": "1s"}], 2, "tool_duration_s"),
        ([GOOD_HEADER, {**GOOD_STEP, "state_changed": "yes"}], 2, "state_changed"),
        ([GOOD_HEADER, {**GOOD_STEP, "completed": None}], 2, "completed"),
        ([GOOD_HEADER, {**GOOD_STEP, "extra": []}], 2, "extra"),
        ([GOOD_HEADER, {**GOOD_STEP, "action": {"tool": "bash", "argz": {}}}], 2, "action"),
        ([GOOD_HEADER, {**GOOD_STEP, "action": {"tool": "", "args": {}}}], 2, "action"),
        ([{**GOOD_HEADER, "schema": 3}], 1, "schema"),
        ([GOOD_HEADER, {**GOOD_STEP, "tool_cpu_s": 1.0}], 2, "tool_cpu_s"),
        ([{**GOOD_HEADER, "schema": 2}, {**GOOD_STEP, "tool_cpu_s": -1.0}], 2, "tool_cpu_s"),
        ([{**GOOD_HEADER, "schema": 2}, {**GOOD_STEP, "tool_cpu_s": "1s"}], 2, "tool_cpu_s"),
        ([{**GOOD_HEADER, "id": ""}], 1, "id"),
        ([{**GOOD_HEADER, "meta": "x"}], 1, "meta"),
        ([GOOD_STEP], 1, "type"),
        ([GOOD_HEADER, {**GOOD_STEP, "type": "stp"}], 2, "type"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path: Path, records: list, line: int, field: str) -> None:
    e = _err(_lines(*records), tmp_path)
    assert (e.line, e.field) == (line, field)
    assert f":{line}: field {field!r}" in str(e)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (_lines(GOOD_HEADER, "{not json"), 2),
        (_lines(GOOD_HEADER, '{"type": "step", "type": "step"}'), 2),
        (_lines(GOOD_HEADER, json.dumps(GOOD_STEP).replace('"output_tokens": 1', '"output_tokens": NaN')), 2),
        (_lines(GOOD_HEADER, "[1, 2]"), 2),
        (_lines(GOOD_HEADER, GOOD_STEP, '{"type": "step", "action": '), 3),
    ],
)
def test_malformed_lines_name_the_line(tmp_path: Path, text: str, line: int) -> None:
    assert _err(text, tmp_path).line == line


def test_absurdly_nested_json_is_a_format_error_not_a_crash(tmp_path: Path) -> None:
    deep = json.dumps(GOOD_STEP)[:-1] + ', "extra": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    e = _err(_lines(GOOD_HEADER, deep), tmp_path)
    assert e.line == 2 and "nested deeper than" in str(e)


def test_empty_and_non_utf8_files_are_rejected(tmp_path: Path) -> None:
    assert "no trace header" in str(_err("\n\n", tmp_path))
    p = tmp_path / "bin.jsonl"
    p.write_bytes(_lines(GOOD_HEADER).encode() + b"\xff\xfe\n")
    with pytest.raises(TraceFormatError, match="not UTF-8") as info:
        read_jsonl(p)
    assert info.value.line == 2


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_give_traces_or_trace_format_error(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    try:
        out = parse_jsonl_text(text, "<fuzz>")
    except TraceFormatError:
        return
    assert all(isinstance(t, Trace) for t in out)


_record = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["trace", "step", "x"]) | _json_scalar,
        "schema": st.sampled_from([1, 2, "1", None]),
        "id": _json_scalar,
        "task": _json_scalar,
        "harness": _json_scalar,
        "actor_model": _json_scalar,
        "source": _json_scalar,
        "meta": _json,
        "action": _json | st.fixed_dictionaries({"tool": _json_scalar, "args": _json}),
        "observation": _json_scalar,
        "output_tokens": _json_scalar,
        "tool_duration_s": _json_scalar,
        "extra": _json,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_record | _json, max_size=5))
def test_random_json_records_give_traces_or_trace_format_error(records: list) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    try:
        out = parse_jsonl_text(text, "<fuzz>")
    except TraceFormatError:
        return
    assert out and all(isinstance(t, Trace) for t in out)
    for t in out:
        for s in t.steps:
            assert s.tool_duration_s is None or (math.isfinite(s.tool_duration_s) and s.tool_duration_s >= 0)


# ---------------------------------------------------------------- load_traces


def test_load_traces_detects_every_format_in_one_call(tmp_path: Path) -> None:
    canonical = write_jsonl([_trace("zz-canonical")], tmp_path / "c.jsonl")
    traces = load_traces([TB1_DIR, canonical, DATA / "taubench" / "gpt-4o-airline.two-tasks.json"])
    ids = [t.id for t in traces]
    assert ids == sorted(ids)
    assert "zz-canonical" in ids
    assert {t.harness for t in traces} == {"mini-swe-agent", "h", "tau-bench"}


def test_load_traces_is_independent_of_argument_order_and_duplicated_paths() -> None:
    a = load_traces([TB1_DIR, bundled_traces_path()])
    b = load_traces([bundled_traces_path(), TB1_DIR, TB1_DIR])
    assert a == b
    assert len(a) == 13


def test_converted_set_loads_identically(tmp_path: Path) -> None:
    traces = load_traces(TB1_DIR)
    write_jsonl(traces, tmp_path / "out.jsonl")
    assert load_traces(tmp_path / "out.jsonl") == traces
    assert load_traces(tmp_path, format="aospec") == traces


def test_directory_import_reports_every_bad_file_and_returns_nothing(tmp_path: Path) -> None:
    write_jsonl([_trace("fine")], tmp_path / "fine.jsonl")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bad1.jsonl").write_text(_lines(GOOD_HEADER, {**GOOD_STEP, "bogus": 1}))
    (tmp_path / "bad2.json").write_text("{ nope")
    (tmp_path / "bad3.jsonl").write_text('{"hello": 1}\n')
    (tmp_path / "notes.txt").write_text("not a trace, ignored")
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path)
    errs = info.value.errors
    assert sorted(Path(e.path).name for e in errs) == ["bad1.jsonl", "bad2.json", "bad3.jsonl"]
    bad1 = next(e for e in errs if e.path.endswith("bad1.jsonl"))
    assert (bad1.line, bad1.field) == (2, "bogus")
    assert "3 file(s) could not be imported" in str(info.value)
    assert isinstance(info.value, TraceFormatError)


def test_duplicate_trace_ids_are_an_error(tmp_path: Path) -> None:
    write_jsonl([_trace("same")], tmp_path / "a.jsonl")
    write_jsonl([_trace("same", task="other")], tmp_path / "b.jsonl")
    with pytest.raises(TraceImportError, match="duplicate trace id 'same'"):
        load_traces(tmp_path)


def test_missing_paths_empty_directories_and_unknown_formats_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceImportError, match="no such file"):
        load_traces(tmp_path / "missing")
    with pytest.raises(TraceImportError, match="no trace files"):
        load_traces(tmp_path)
    with pytest.raises(TraceImportError, match="unknown format"):
        load_traces(TB1_DIR, format="csv")


def test_forced_format_applies_to_every_file(tmp_path: Path) -> None:
    write_jsonl([_trace("x")], tmp_path / "x.jsonl")
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path, format="tb1")
    (e,) = info.value.errors
    assert (e.line, e.field) == (1, "type")
