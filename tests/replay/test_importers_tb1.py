"""The tb1 importer on real step files (bundled sample, fixtures, and the whole shared set when present)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from aospec.replay import bundled_traces_path, load_traces, trace_stats
from aospec.replay.importers.tb1 import ACTOR_MODEL, HARNESS, parse_tb1_text, read_tb1
from hypothesis import given, settings
from hypothesis import strategies as st

from aospec.errors import TraceFormatError, TraceImportError
from aospec.types import Action

TB1_DIR = Path(__file__).parent / "data" / "tb1"
SHARED_TB1 = Path("/work/shared/traces/tb1-mini-swe-agent-claude-sonnet-4")
NULL_LAST = TB1_DIR / "2025-08-14__19-39-35" / "cartpole-rl-training.1-of-1.2025-08-14__19-39-35.jsonl"
NEGATIVE = TB1_DIR / "2025-08-15__16-23-45" / "cartpole-rl-training.1-of-1.2025-08-15__16-23-45.jsonl"
NO_RESULTS = TB1_DIR / "2025-08-15__19-28-24" / "train-fasttext.1-of-1.2025-08-15__19-28-24.jsonl"


def _raw(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_every_field_maps_as_documented() -> None:
    path = next(bundled_traces_path().glob("*/oom.*.jsonl"))
    trace = read_tb1(path)
    raw = _raw(path)
    results = json.loads(path.with_name(path.name.replace(".jsonl", ".results.json")).read_text())
    assert trace.id == "oom.1-of-1.2025-08-07__20-46-16" == results["trial_name"]
    assert trace.task == "oom" and trace.instruction == results["instruction"]
    assert (trace.harness, trace.actor_model) == (HARNESS, ACTOR_MODEL)
    assert "terminal-bench-leaderboard@8e1925a3" in trace.source and trace.source.endswith(trace.id)
    assert trace.meta["is_resolved"] is False and trace.meta["failure_mode"] == "agent_timeout"
    assert trace.meta["results_id"] == results["id"] and trace.meta["run"] == "2025-08-07__20-46-16"
    assert trace.meta["cast_epoch_start"] == raw[0]["cast_epoch_start"]
    assert len(trace) == len(raw)
    for step, rec in zip(trace.steps, raw, strict=True):
        assert step.action == (Action.bash(rec["action"]) if rec["action"] else Action.none())
        assert step.observation == rec["observation"]
        assert step.reply == rec["response_text"]
        assert (step.output_tokens, step.output_tokens_estimated) == (rec["est_output_tokens"], True)
        assert step.tool_duration_s == rec["tool_duration_s"] and step.completed
        assert step.model_latency_s == rec["llm_latency_s"] and step.started_at_s == rec["t_query_start"]
        assert step.state_changed is None and step.version_before is None
        assert step.extra["cum_cost_usd"] == rec["cum_cost_usd"] and step.extra["t_obs"] == rec["t_obs"]


def test_cut_off_last_command_has_unknown_duration_and_is_incomplete() -> None:
    trace = read_tb1(NULL_LAST)
    *done, last = trace.steps
    assert last.tool_duration_s is None and not last.completed and last.observation == ""
    assert last.action == Action.bash("python train_agent.py")
    assert all(s.completed and s.tool_duration_s is not None for s in done)


def test_slightly_negative_duration_reads_as_zero_and_keeps_the_raw_value() -> None:
    step = read_tb1(NEGATIVE).steps[17]
    assert step.tool_duration_s == 0.0
    assert step.extra["tool_duration_recorded_s"] == -0.092


def test_empty_results_file_falls_back_to_the_file_name() -> None:
    trace = read_tb1(NO_RESULTS)
    assert trace.task == "train-fasttext" and trace.instruction is None
    assert trace.meta["results_missing"] is True


def test_bundled_sample_is_one_run_of_ten_distinct_tasks() -> None:
    traces = load_traces(bundled_traces_path())
    assert len(traces) == 10 and len({t.task for t in traces}) == 10
    assert {t.meta["run"] for t in traces} == {"2025-08-07__20-46-16"}
    assert (bundled_traces_path() / "NOTICE").read_text().count("laude-institute/terminal-bench-leaderboard") == 1


@pytest.mark.skipif(not SHARED_TB1.is_dir(), reason="the shared tb1 trace set is not on this machine")
def test_whole_shared_set_has_47_trials_929_steps_and_numpy_quantiles() -> None:
    traces = load_traces(SHARED_TB1)
    stats = trace_stats(traces)
    assert (stats.trials, stats.steps, stats.tasks) == (47, 929, 12)
    raw = [r for p in sorted(SHARED_TB1.glob("*/*.jsonl")) for r in _raw(p)]
    durations = np.array([max(r["tool_duration_s"], 0.0) for r in raw if r["tool_duration_s"] is not None])
    assert stats.untimed_steps == 2 and stats.timed_steps == durations.size == 927
    assert stats.tool_time_p50_s == pytest.approx(np.quantile(durations, 0.5))
    assert stats.tool_time_p90_s == pytest.approx(np.quantile(durations, 0.9))
    assert stats.tool_time_p99_s == pytest.approx(np.quantile(durations, 0.99))
    long = durations[durations >= 1.0]
    assert stats.long_call_time_share == pytest.approx(long.sum() / durations.sum())
    assert stats.output_tokens == stats.output_tokens_estimated == sum(r["est_output_tokens"] for r in raw)


def _copy_trial(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / src.name
    shutil.copyfile(src, dst)
    res = src.with_name(src.name.replace(".jsonl", ".results.json"))
    shutil.copyfile(res, dst_dir / res.name)
    return dst


def _rewrite(path: Path, lineno: int, **changes: object) -> None:
    recs = _raw(path)
    recs[lineno - 1].update(changes)
    for k, v in list(changes.items()):
        if v is ...:
            del recs[lineno - 1][k]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.parametrize(
    ("lineno", "changes", "field"),
    [
        (3, {"step": 7}, "step"),
        (2, {"tool_duration_s": "fast"}, "tool_duration_s"),
        (2, {"tool_duration_s": -5.0}, "tool_duration_s"),
        (4, {"action": None}, "action"),
        (1, {"surprise": 1}, "surprise"),
        (5, {"observation": ...}, "observation"),
        (2, {"cast_epoch_start": 1}, "cast_epoch_start"),
        (3, {"tool_duration_s": None, "t_obs": None}, "tool_duration_s"),
    ],
)
def test_bad_step_records_name_file_line_and_field(tmp_path: Path, lineno: int, changes: dict, field: str) -> None:
    path = _copy_trial(NULL_LAST, tmp_path)
    _rewrite(path, lineno, **changes)
    with pytest.raises(TraceFormatError) as info:
        read_tb1(path)
    assert (info.value.path, info.value.line, info.value.field) == (str(path), lineno, field)


def test_mismatched_or_broken_results_file_is_an_error(tmp_path: Path) -> None:
    path = _copy_trial(NULL_LAST, tmp_path)
    res = path.with_name(path.name.replace(".jsonl", ".results.json"))
    res.write_text(json.dumps({"trial_name": "someone-else", "task_id": "x"}))
    with pytest.raises(TraceFormatError, match="someone-else"):
        read_tb1(path)
    res.write_text("{")
    with pytest.raises(TraceFormatError) as info:
        read_tb1(path)
    assert info.value.path == str(res)


def test_directory_with_bad_trials_reports_each_and_imports_none(tmp_path: Path) -> None:
    a = _copy_trial(NULL_LAST, tmp_path / "run")
    b = _copy_trial(NEGATIVE, tmp_path / "run")
    _copy_trial(NO_RESULTS, tmp_path / "run")
    _rewrite(a, 2, step=9)
    _rewrite(b, 1, llm_latency_s=None)
    with pytest.raises(TraceImportError) as info:
        load_traces(tmp_path)
    assert sorted((Path(e.path).name, e.line, e.field) for e in info.value.errors) == sorted(
        [(a.name, 2, "step"), (b.name, 1, "llm_latency_s")]
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.sampled_from(sorted(_raw(NULL_LAST)[0])), st.none() | st.integers() | st.text(max_size=5) | st.floats()
        ),
        max_size=3,
    )
)
def test_random_step_records_give_a_trace_or_trace_format_error(records: list[dict]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records)
    try:
        (trace,) = parse_tb1_text(Path("fuzz.jsonl"), text)
    except TraceFormatError:
        return
    assert len(trace) == len(records)
