"""Issue 9, items 9-11 through the real ``aospec`` entry point: every bad input is one line
(or one summarised list) on stderr naming file[:line][:field], exit status 2, no traceback
and no hang; ``--skip-invalid`` skips and counts; drafter failures are never silent;
``--tpot-ms`` values are distinct and positive."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path

from aospec.cli import main

TESTS = Path(__file__).resolve().parents[1]
TB1_TRIAL = next((TESTS / "replay" / "data" / "tb1" / "2025-08-15__16-23-45").glob("*.jsonl"))
QUICK = ["--policies", "serial,aospec", "--tpot-ms", "10", "--jobs", "1", "--no-progress"]

FAILING_DRAFTER = '''
from aospec.errors import DrafterError


class AlwaysFails:
    """An observation drafter whose every call fails (a backend that is down)."""

    async def draft(self, history, action, n):
        raise DrafterError("backend unreachable")
'''


def _aospec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -m aospec ARGS`` (a hang fails the test through TimeoutExpired)."""
    return subprocess.run(
        [sys.executable, "-m", "aospec", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _fails_cleanly(proc: subprocess.CompletedProcess[str], *needles: str) -> list[str]:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    return proc.stderr.splitlines()


def _bundled_copy(dest: Path) -> Path:
    shutil.copytree(bundled_traces_path(), dest)
    return dest


# ---------------------------------------------------------------- item 9: files that must not hang or crash


def test_symlink_loop_fifo_and_device_are_named_errors_not_hangs(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").symlink_to("b.jsonl")
    (tmp_path / "b.jsonl").symlink_to("a.jsonl")
    os.mkfifo(tmp_path / "x.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    lines = _fails_cleanly(_aospec("traces", "stats", str(tmp_path)), "4 file(s) could not be imported")
    assert f"  {tmp_path / 'a.jsonl'}: symlink loop (too many levels of symbolic links)" in lines
    assert any(line.startswith(f"  {tmp_path / 'x.jsonl'}: a FIFO") for line in lines)
    assert any(line.startswith(f"  {tmp_path / 'zero.jsonl'}: a character device") for line in lines)


def test_max_file_mb_caps_and_raises_the_file_size_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = _bundled_copy(tmp_path / "set")
    assert main(["traces", "stats", str(sample), "--max-file-mb", "0.001", "--format", "json"]) == 2
    err = capsys.readouterr().err
    assert "MiB limit for one trace file; raise it with --max-file-mb" in err
    assert main(["traces", "stats", str(sample), "--max-file-mb", "64", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["trials"] == 10
    assert main(["traces", "stats", str(sample), "--max-file-mb", "0"]) == 2
    assert "--max-file-mb must be a positive number" in capsys.readouterr().err


def test_infinite_tb1_duration_stops_sweep_on_read_not_with_overflow_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(TB1_TRIAL, run)
    step_file = run / TB1_TRIAL.name
    lines = step_file.read_text().split("\n")
    rec = json.loads(lines[0])
    rec["tool_duration_s"] = "@@"
    lines[0] = json.dumps(rec).replace('"@@"', "1e999")
    step_file.write_text("\n".join(lines))
    expected = f"{step_file}:1: field 'tool_duration_s': a number too large for a 64-bit float"
    for args in (["traces", "stats", str(run)], ["sweep", str(run), "--out", str(tmp_path / "out"), *QUICK]):
        (line,) = _fails_cleanly(_aospec(*args), expected)
        assert line.startswith("aospec: error: ")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_lone_surrogate_without_writing(tmp_path: Path) -> None:
    src = tmp_path / "s.jsonl"
    header = {"type": "trace", "schema": 1, "id": "t", "task": "t", "harness": "h", "actor_model": "m", "source": "s"}
    step = {"type": "step", "action": {"tool": "bash", "args": {"command": "ls"}}, "observation": "o", "output_tokens": 1}
    src.write_text(json.dumps({**header, "meta": {"x": "\ud800"}}) + "\n" + json.dumps(step) + "\n")
    out = tmp_path / "out.jsonl"
    (line,) = _fails_cleanly(_aospec("traces", "convert", str(src), "-o", str(out)), f"{src}:1: field 'meta.x'")
    assert "surrogate" in line and not out.exists()


def test_ten_thousand_empty_files_print_a_summarised_error(tmp_path: Path) -> None:
    for i in range(10_000):
        (tmp_path / f"{i:05}.jsonl").touch()
    lines = _fails_cleanly(_aospec("traces", "stats", str(tmp_path)), "10000 file(s) could not be imported")
    assert len(lines) == 22 and lines[-1] == "  ... and 9980 more"
    assert lines[1] == f"  {tmp_path / '00000.jsonl'}: empty file"


# ---------------------------------------------------------------- item 9: --skip-invalid


def test_one_bad_file_stops_a_sweep_unless_skip_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = _bundled_copy(tmp_path / "set")
    bad = sample / "bad.jsonl"
    bad.write_text('{"type": "trace", "type": "trace"}\n')
    out = tmp_path / "out"
    assert main(["sweep", str(sample), "--out", str(out), *QUICK]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"aospec: error: {bad}:1: invalid JSON: duplicate key 'type' (--skip-invalid imports the rest)"
    assert not out.exists()

    assert main(["sweep", str(sample), "--out", str(out), "--skip-invalid", *QUICK]) == 0
    captured = capsys.readouterr()
    assert f"aospec: skipped {bad}:1: invalid JSON: duplicate key 'type'" in captured.err
    assert "1 invalid trace files skipped" in captured.err
    assert "- invalid files skipped: 1" in (out / "summary.md").read_text()
    assert {json.loads(r)["traces"] for r in (out / "summary.jsonl").read_text().splitlines()} == {10}


def test_skip_invalid_in_traces_stats_and_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sample = _bundled_copy(tmp_path / "set")
    (sample / "empty.jsonl").touch()
    assert main(["traces", "stats", str(sample), "--skip-invalid", "--format", "json"]) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert stats["trials"] == 10 and stats["skipped_files"] == 1
    assert stats["skipped"] == [f"{sample / 'empty.jsonl'}: empty file"]
    assert main(["traces", "stats", str(sample), "--skip-invalid"]) == 0
    assert "invalid files skipped" in capsys.readouterr().out
    out = tmp_path / "all.jsonl"
    assert main(["traces", "convert", str(sample), "-o", str(out), "--skip-invalid", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["traces"], summary["skipped_files"]) == (10, 1)
    (sample / "2025-08-07__20-46-16").rename(tmp_path / "moved")  # leave only the bad file
    assert main(["traces", "convert", str(sample), "-o", str(tmp_path / "none.jsonl"), "--skip-invalid"]) == 2
    assert "no file was valid" in capsys.readouterr().err and not (tmp_path / "none.jsonl").exists()


# ---------------------------------------------------------------- item 10: drafters


def test_a_drafter_that_cannot_be_built_stops_the_sweep_before_it_starts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _aospec(
        "sweep", "--bundled", "--out", str(out), "--policies", "serial,aospec:obs_drafter=lm", "--tpot-ms", "10",
        "--no-progress", "--drafter-options", '{"lm": {"model": "/nonexistent"}}',
    )  # fmt: skip
    (line,) = _fails_cleanly(proc, "model '/nonexistent' is neither a shape")
    assert line.startswith("aospec: error: LMObservationDrafter: ") and not out.exists()


def test_failing_drafter_calls_are_counted_in_results_summary_and_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "failing_drafter.py").write_text(FAILING_DRAFTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    policies = "serial,aospec:obs_drafter=patterns,aospec:obs_drafter=failing_drafter.AlwaysFails+patterns"
    args = ["sweep", "--bundled", "--out", str(out), "--policies", policies, "--tpot-ms", "10", "--jobs", "1"]
    assert main([*args, "--no-progress"]) == 0
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if line.startswith("aospec: warning: ")]
    assert len(warning) == 1 and "first error: AlwaysFails: backend unreachable" in warning[0]
    assert "drafter fails" in captured.out
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_policy: dict[str, list[dict]] = {}
    for r in results:
        by_policy.setdefault(r["policy"], []).append(r)
    failing = by_policy["aospec:obs_drafter=failing_drafter.AlwaysFails+patterns"]
    assert all(r["drafter_failures"] > 0 and r["drafter_error"] for r in failing)
    assert all(r["drafter_failures"] == 0 for r in by_policy["aospec:obs_drafter=patterns"])
    # The failing drafter lost only its own candidates: patterns' still ran, at the same cost.
    plain = {r["trace_id"]: r for r in by_policy["aospec:obs_drafter=patterns"]}
    assert all(r["latency_ns"] == plain[r["trace_id"]]["latency_ns"] for r in failing)
    assert sum(r["drafts_hit"] for r in failing) > 0
    summary = {json.loads(s)["policy"]: json.loads(s) for s in (out / "summary.jsonl").read_text().splitlines()}
    assert summary[failing[0]["policy"]]["drafter_failures"] == sum(r["drafter_failures"] for r in failing)
    assert "drafter fails: " in (out / "summary.md").read_text()


def test_a_sweep_without_drafter_failures_shows_no_failure_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", "--bundled", "--out", str(tmp_path / "out"), *QUICK]) == 0
    captured = capsys.readouterr()
    assert "drafter fails" not in captured.out and "warning" not in captured.err


# ---------------------------------------------------------------- item 11: TPOTs


@pytest.mark.parametrize(
    ("tpots", "message"),
    [
        ("10,10", "--tpot-ms: 10 listed twice (each value once)"),
        ("20,10,20.0", "--tpot-ms: 20 listed twice (each value once)"),
        ("10,0", "--tpot-ms: expected positive finite numbers, got '10,0'"),
        ("10,nan", "--tpot-ms: expected positive finite numbers, got '10,nan'"),
        ("inf", "--tpot-ms: expected positive finite numbers, got 'inf'"),
        ("-5", "--tpot-ms: expected positive finite numbers, got '-5'"),
    ],
)
def test_tpots_must_be_distinct_positive_and_finite(
    tpots: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", "--bundled", "--tpot-ms", tpots, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"aospec: error: {message}" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", [["--tpot-ms", "nan"], ["--tpot-ms", "0"], ["--prefill-ms-per-ktok", "nan"]])
def test_replay_rejects_nan_and_non_positive_speeds(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--bundled", "--policies", "serial", "--no-progress", *flag]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("aospec: error: ") and flag[0] in line
