"""`aospec traces stats|convert` end to end, through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aospec.replay import bundled_traces_path, dump_jsonl, load_traces, read_jsonl

from aospec._files import new_file_mode
from aospec.cli import main

TESTS = Path(__file__).resolve().parents[1]
TB1_FIXTURES = TESTS / "replay" / "data" / "tb1"
SHARED_TB1 = Path("/work/shared/traces/tb1-mini-swe-agent-claude-sonnet-4")
REQUIRED = (
    "trials",
    "steps",
    "tool_time_p50_s",
    "tool_time_p90_s",
    "tool_time_p99_s",
    "long_call_time_share",
    "read_only_steps",
)


def _json_stats(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["traces", "stats", *args, "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


def test_bundled_reads_the_bundled_sample_as_in_sweep_and_replay(capsys: pytest.CaptureFixture[str]) -> None:
    assert _json_stats(capsys, "--bundled") == _json_stats(capsys, str(bundled_traces_path()))


@pytest.mark.parametrize("argv", [["traces", "stats"], ["traces", "convert", "-o", "x.jsonl"], ["sweep"], ["replay"]])
def test_no_traces_is_one_error_naming_bundled(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("aospec: error: no traces: give PATH...") and "--bundled" in err[0]


def test_convert_reads_the_bundled_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bundled.jsonl"
    assert main(["traces", "convert", "--bundled", "-o", str(out), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["traces"] == 10
    assert read_jsonl(out) == load_traces(bundled_traces_path())
    assert out.stat().st_mode & 0o777 == new_file_mode()  # not mkstemp's private 0600


def test_stats_json_on_the_bundled_sample(capsys: pytest.CaptureFixture[str]) -> None:
    stats = _json_stats(capsys, str(bundled_traces_path()))
    assert set(REQUIRED) <= set(stats)
    traces = load_traces(bundled_traces_path())
    durations = np.array([s.tool_duration_s for t in traces for s in t.steps if s.tool_duration_s is not None])
    assert stats["trials"] == 10 and stats["steps"] == sum(len(t) for t in traces)
    assert stats["tool_time_p90_s"] == pytest.approx(float(np.quantile(durations, 0.9)))
    assert stats["read_only_steps"] + stats["may_change_steps"] == stats["steps"]
    assert stats["effects"] == {"read_only": stats["read_only_steps"], "may_change": stats["may_change_steps"]}
    assert stats["quantile_method"] == "numpy linear"


@pytest.mark.skipif(not SHARED_TB1.is_dir(), reason="the shared tb1 trace set is not on this machine")
def test_stats_on_the_whole_tb1_set_prints_47_trials_and_929_steps(capsys: pytest.CaptureFixture[str]) -> None:
    stats = _json_stats(capsys, str(SHARED_TB1))
    assert (stats["trials"], stats["steps"], stats["untimed_steps"]) == (47, 929, 2)
    assert main(["traces", "stats", str(SHARED_TB1)]) == 0
    table = capsys.readouterr().out
    assert "│ trials" in table and " 47 │" in table and " 929 │" in table


def test_stats_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plots" / "tool-time.png"
    assert main(["traces", "stats", str(TB1_FIXTURES), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tool time p50 / p90 / p99" in out and "numpy linear" in out and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_convert_writes_canonical_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tb1.jsonl"
    assert main(["traces", "convert", str(TB1_FIXTURES), "-o", str(out), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"traces": 3, "steps": sum(len(t) for t in read_jsonl(out)), "output": str(out)}
    assert read_jsonl(out) == load_traces(TB1_FIXTURES)
    assert main(["traces", "convert", str(out), "-o", "-"]) == 0
    assert capsys.readouterr().out == out.read_text()
    assert out.read_text() == dump_jsonl(load_traces(TB1_FIXTURES))


def test_bad_inputs_exit_2_naming_every_bad_file(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"type": "trace"}\n')
    (tmp_path / "b.json").write_text("[1, 2]")
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", "traces", "stats", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("aospec: error: 2 file(s) could not be imported")
    assert f"{tmp_path / 'a.jsonl'}:1: field 'schema'" in proc.stderr
    assert f"{tmp_path / 'b.json'}:1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_convert_refuses_nothing_silently(tmp_path: Path) -> None:
    assert main(["traces", "convert", str(tmp_path / "missing"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert not (tmp_path / "o.jsonl").exists()
