"""Issue 9, items 9-11: trace inputs are untrusted. Each test is one reproduction from the
issue: importers never hang, never read without bound, never accept what they cannot
replay, and name file, line and field; a drafter's configuration error stops a sweep
before it starts and per-call failures are counted; TPOTs are distinct and positive."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path, dump_jsonl, import_traces, load_traces, read_jsonl
from aospec.replay.importers.minisweagent import parse_traj_text
from aospec.replay.io import MAX_OUTPUT_TOKENS
from aospec.replay.policies import check_drafters, parse_policies
from aospec.replay.sweep import run_sweep

from aospec.errors import ConfigError, MissingDependencyError, TraceFormatError, TraceImportError

DATA = Path(__file__).parent / "data"
V1 = DATA / "mini-swe-agent" / "v1-count-lines.traj.json"
TAU = DATA / "taubench" / "gpt-4o-airline.two-tasks.json"
TB1_TRIAL = next((DATA / "tb1" / "2025-08-15__16-23-45").glob("*.jsonl"))

HEADER = {"type": "trace", "schema": 1, "id": "t", "task": "t", "harness": "h", "actor_model": "m", "source": "s"}
STEP = {"type": "step", "action": {"tool": "bash", "args": {"command": "ls"}}, "observation": "o", "output_tokens": 3}


def _canonical(path: Path, header: dict | None = None, *steps: dict) -> Path:
    lines = [json.dumps(header or HEADER)] + [json.dumps(s) for s in (steps or (STEP,))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _one_error(paths, **kw) -> TraceFormatError:
    with pytest.raises(TraceImportError) as info:
        load_traces(paths, **kw)
    assert len(info.value.errors) == 1, info.value
    return info.value.errors[0]


def _copy_tb1(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(TB1_TRIAL, dest)
    shutil.copy(TB1_TRIAL.with_name(TB1_TRIAL.name[: -len(".jsonl")] + ".results.json"), dest)
    return dest / TB1_TRIAL.name


def _set_tb1_field(path: Path, line: int, key: str, raw: str) -> None:
    """Replace ``key``'s value on ``line`` with the literal JSON text ``raw`` (which json.dumps
    could not write, e.g. 1e999)."""
    lines = path.read_text().split("\n")
    rec = json.loads(lines[line - 1])
    rec[key] = "@@"
    lines[line - 1] = json.dumps(rec).replace('"@@"', raw)
    path.write_text("\n".join(lines))


# ---------------------------------------------------------------- never hang, never read without bound


@pytest.mark.timeout(120)
def test_a_catastrophic_action_regex_is_an_error_naming_the_field_not_a_hang(tmp_path: Path) -> None:
    traj = json.loads(V1.read_text())
    traj["info"]["config"]["agent"]["action_regex"] = "(a|aa)+$"
    traj["messages"][2]["content"] = "a" * 60 + "b"  # exponential backtracking for re
    path = tmp_path / "evil.traj.json"
    path.write_text(json.dumps(traj))
    err = _one_error(path)
    assert (err.path, err.field) == (str(path), "info.config.agent.action_regex")
    assert "catastrophic backtracking" in err.message and "fix it in the file" in err.message


def test_a_custom_action_regex_that_is_safe_still_extracts_actions(tmp_path: Path) -> None:
    traj = json.loads(V1.read_text())
    traj["info"]["config"]["agent"]["action_regex"] = "<cmd>(.*?)</cmd>"
    for m in traj["messages"]:
        if m["role"] == "assistant" and isinstance(m["content"], str):
            m["content"] = m["content"].replace("```bash\n", "<cmd>").replace("\n```", "</cmd>")
    (trace,) = parse_traj_text(tmp_path / "x.traj.json", json.dumps(traj))
    assert [s.action for s in trace.steps] == [s.action for s in load_traces(V1)[0].steps]


def test_a_symlink_loop_among_trace_files_is_one_error_per_file(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").symlink_to("b.jsonl")
    (tmp_path / "b.jsonl").symlink_to("a.jsonl")
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path)
    assert sorted((Path(e.path).name, e.message) for e in info.value.errors) == [
        ("a.jsonl", "symlink loop (too many levels of symbolic links)"),
        ("b.jsonl", "symlink loop (too many levels of symbolic links)"),
    ]
    assert "symlink loop" in _one_error(tmp_path / "a.jsonl").message  # named directly, too


@pytest.mark.timeout(120)
def test_a_fifo_and_a_device_are_refused_without_being_read(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "x.jsonl")  # opening it for reading would wait for a writer forever
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path)
    assert sorted((Path(e.path).name, e.message.split(",")[0]) for e in info.value.errors) == [
        ("x.jsonl", "a FIFO"),
        ("zero.jsonl", "a character device"),
    ]
    assert all("only regular files are read" in e.message for e in info.value.errors)


def test_files_over_the_size_cap_are_refused_and_the_cap_can_be_raised(tmp_path: Path) -> None:
    path = _canonical(tmp_path / "t.jsonl")
    size = path.stat().st_size
    err = _one_error(path, max_file_bytes=size - 1)
    assert "limit for one trace file" in err.message and "--max-file-mb" in err.message
    assert [t.id for t in load_traces(path, max_file_bytes=size)] == ["t"]


# ---------------------------------------------------------------- never accept what cannot be replayed


@pytest.mark.parametrize("key", ["tool_duration_s", "llm_latency_s"])
def test_tb1_infinite_durations_are_rejected_naming_line_and_field(tmp_path: Path, key: str) -> None:
    step_file = _copy_tb1(tmp_path / "run")
    _set_tb1_field(step_file, 3, key, "1e999")
    err = _one_error(tmp_path)
    assert (err.path, err.line, err.field) == (str(step_file), 3, key)
    assert "overflows to infinity" in err.message


def test_tb1_absurd_finite_values_are_rejected(tmp_path: Path) -> None:
    step_file = _copy_tb1(tmp_path / "run")
    _set_tb1_field(step_file, 2, "tool_duration_s", "1e300")
    err = _one_error(tmp_path)
    assert (err.line, err.field) == (2, "tool_duration_s") and "beyond the limit" in err.message
    step_file = _copy_tb1(tmp_path / "run")
    _set_tb1_field(step_file, 4, "est_output_tokens", str(10**30))
    err = _one_error(tmp_path)
    assert (err.line, err.field) == (4, "est_output_tokens") and "beyond the limit" in err.message


def test_canonical_non_finite_meta_and_lone_surrogates_are_rejected_on_read(tmp_path: Path) -> None:
    inf = tmp_path / "inf.jsonl"
    inf.write_text(json.dumps({**HEADER, "meta": {"x": "@@"}}).replace('"@@"', "1e999") + "\n" + json.dumps(STEP))
    err = _one_error(inf)
    assert (err.line, err.field) == (1, "meta.x") and "overflows to infinity" in err.message
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text(json.dumps({**HEADER, "meta": {"x": "\ud800"}}) + "\n" + json.dumps(STEP))
    err = _one_error(surrogate)
    assert (err.line, err.field) == (1, "meta.x") and "surrogate" in err.message
    key = tmp_path / "key.jsonl"
    key.write_text(json.dumps(HEADER) + "\n" + json.dumps({**STEP, "extra": {"\udcff": 1}}))
    err = _one_error(key)
    assert (err.line, err.field) == (2, "extra") and "surrogate" in err.message
    paired = _canonical(tmp_path / "paired.jsonl", {**HEADER, "meta": {"x": "\U0001f600"}})
    assert load_traces(paired)[0].meta["x"] == "\U0001f600"  # a proper surrogate pair is fine


def test_taubench_infinite_reward_names_the_record_and_field(tmp_path: Path) -> None:
    records = json.loads(TAU.read_text())
    records[1]["reward"] = "@@"
    path = tmp_path / "tau.json"
    path.write_text(json.dumps(records).replace('"@@"', "1e999"))
    err = _one_error(path)
    assert (err.line, err.field) == (2, "reward") and "overflows to infinity" in err.message


def test_absurd_output_tokens_are_rejected_on_read_not_in_the_engine(tmp_path: Path) -> None:
    path = _canonical(tmp_path / "big.jsonl", None, {**STEP, "output_tokens": 10**30})
    err = _one_error(path)
    assert (err.line, err.field) == (2, "output_tokens") and f"{MAX_OUTPUT_TOKENS:,}" in err.message
    traj = json.loads(V1.read_text())
    traj["messages"][2].setdefault("extra", {})["response"] = {"usage": {"completion_tokens": 10**30}}
    path = tmp_path / "big.traj.json"
    path.write_text(json.dumps(traj))
    err = _one_error(path)
    assert err.field == "messages[2].extra.response.usage.completion_tokens"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tool_duration_s", 10**400, "out of range"),  # an integer no float can hold
        ("model_latency_s", 1e300, "beyond the limit of 1e+07 s"),
        ("started_at_s", -(10**400), "out of range"),
        ("started_at_s", 1e11, "beyond the limit of +-1e+10 s"),
    ],
)
def test_canonical_absurd_times_are_rejected(tmp_path: Path, key: str, value: float, message: str) -> None:
    path = _canonical(tmp_path / "t.jsonl", None, STEP, {**STEP, key: value})
    err = _one_error(path)
    assert (err.line, err.field) == (3, key) and message in err.message


def test_mini_swe_agent_absurd_timestamps_are_rejected_not_ignored(tmp_path: Path) -> None:
    traj = json.loads(V1.read_text())
    traj["messages"][3]["timestamp"] = 10**400
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps(traj))
    assert _one_error(path).field == "messages[3].timestamp"
    traj["messages"][3]["timestamp"] = traj["messages"][2]["timestamp"] + 2e7  # a 231-day command
    path.write_text(json.dumps(traj))
    err = _one_error(path)
    assert err.field == "messages[3]" and "beyond the limit of 1e+07 s" in err.message


def test_a_trace_too_long_for_exact_virtual_time_is_refused_before_replay(tmp_path: Path) -> None:
    steps = [{**STEP, "tool_duration_s": 9e6} for _ in range(10)]  # each valid, 90e6 s in all
    traces = load_traces(_canonical(tmp_path / "long.jsonl", None, *steps))
    with pytest.raises(ConfigError, match="days of virtual time"):
        run_sweep(traces, parse_policies("serial"), tpots_ms=[10.0])


# ---------------------------------------------------------------- say what is wrong


def test_an_unknown_trajectory_format_version_is_rejected(tmp_path: Path) -> None:
    traj = json.loads(V1.read_text())
    traj["trajectory_format"] = "mini-swe-agent-9.9"
    path = tmp_path / "x.traj.json"
    path.write_text(json.dumps(traj))
    err = _one_error(path)
    assert err.field == "trajectory_format" and "mini-swe-agent-9.9" in err.message
    assert "mini-swe-agent-1 and mini-swe-agent-1.1" in err.message


def test_a_tau_bench_record_given_as_an_object_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "one-record.json"
    path.write_text(json.dumps(json.loads(TAU.read_text())[0]))
    err = _one_error(path)
    assert "tau-bench record" in err.message and "wrap it in [ ]" in err.message
    assert "mini-swe-agent" in err.message and "messages" not in (err.field or "")
    err = _one_error(path, format="tau-bench")
    assert "wrap it in [ ]" in err.message


def test_duplicate_keys_name_the_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"type": "trace", "type": "trace"}\n')
    err = _one_error(path)
    assert (err.line, err.message) == (1, "invalid JSON: duplicate key 'type'")
    path.write_text(json.dumps(HEADER) + "\n" + json.dumps(STEP) + '\n{"type": "step", "type": "step"}\n')
    err = _one_error(path)
    assert (err.line, err.message) == (3, "invalid JSON: duplicate key 'type'")


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    plain = _canonical(tmp_path / "plain.jsonl")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_jsonl(bom) == read_jsonl(plain)
    traj = tmp_path / "bom.traj.json"
    traj.write_bytes(b"\xef\xbb\xbf" + V1.read_bytes())
    assert load_traces(traj)[0].steps == load_traces(V1)[0].steps


def test_ten_thousand_bad_files_give_a_summarised_error(tmp_path: Path) -> None:
    for i in range(10_000):
        (tmp_path / f"{i:05}.jsonl").touch()
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path)
    assert len(info.value.errors) == 10_000
    lines = str(info.value).splitlines()
    assert lines[0] == "10000 file(s) could not be imported:"
    assert len(lines) == 1 + TraceImportError.MAX_LISTED + 1 and lines[-1] == "  ... and 9980 more"


# ---------------------------------------------------------------- skip invalid files when asked


def test_skip_invalid_keeps_every_good_file_and_names_each_bad_one(tmp_path: Path) -> None:
    shutil.copytree(bundled_traces_path(), tmp_path / "set")
    bad = tmp_path / "set" / "bad.jsonl"
    bad.write_text("{not json\n")
    (tmp_path / "set" / "zz").mkdir()  # walked after the sample's run directory: the later file is skipped
    dup = _canonical(tmp_path / "set" / "zz" / "dup.jsonl", {**HEADER, "id": load_traces(bundled_traces_path())[0].id})
    with pytest.raises(TraceImportError, match="--skip-invalid"):
        load_traces(tmp_path / "set")  # the default stays: one bad file stops the import
    loaded = import_traces(tmp_path / "set", skip_invalid=True)
    assert list(loaded.traces) == load_traces(bundled_traces_path())
    assert sorted(e.path for e in loaded.skipped) == sorted([str(bad), str(dup)])
    assert loaded.files == len(loaded.traces)
    with pytest.raises(TraceImportError, match="no file was valid"):
        import_traces(bad, skip_invalid=True)
    with pytest.raises(TraceImportError, match="no such file"):
        import_traces(tmp_path / "missing", skip_invalid=True)  # a wrong path is not skipped


# ---------------------------------------------------------------- drafters and TPOTs (items 10, 11)


def test_a_drafter_configuration_error_is_raised_before_the_sweep() -> None:
    policies = parse_policies("serial,aospec:obs_drafter=lm")
    with pytest.raises(ConfigError, match="'/nonexistent' is neither a shape"):
        check_drafters(policies, {"lm": {"model": "/nonexistent"}})
    with pytest.raises(ConfigError, match="no_such_option"):
        check_drafters(policies, {"lm": {"model": "tiny", "no_such_option": 1}})
    with pytest.raises(ConfigError, match="observation drafter 'patterns': bad options"):
        check_drafters(parse_policies("aospec"), {"patterns": {"bogus": 1}})
    shape = (parse_policies("aospec,aospec:obs_drafter=lm"), {"lm": {"model": "tiny"}})
    if all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        check_drafters(*shape)  # a shape is a valid model
    else:
        with pytest.raises(MissingDependencyError, match=r"pip install 'aospec\[train\]'"):
            check_drafters(*shape)
    traces = load_traces(bundled_traces_path())
    with pytest.raises(ConfigError, match="/nonexistent"):
        run_sweep(traces, policies, tpots_ms=[10.0], drafter_options={"lm": {"model": "/nonexistent"}})


@pytest.mark.parametrize("tpots", [[10.0, 10.0], [10.0, 0.0], [10.0, float("nan")], [float("inf")], []])
def test_run_sweep_rejects_repeated_and_non_positive_tpots(tpots: list[float]) -> None:
    traces = load_traces(bundled_traces_path())
    with pytest.raises(ConfigError, match="TPOT"):
        run_sweep(traces, parse_policies("serial"), tpots_ms=tpots)


def test_converting_after_the_fixes_still_round_trips_the_fixtures(tmp_path: Path) -> None:
    traces = load_traces([DATA / "tb1", V1, TAU])
    out = tmp_path / "all.jsonl"
    out.write_text(dump_jsonl(traces), encoding="utf-8")
    assert read_jsonl(out) == traces
