"""Sweeps over trace sets: folds, parallelism, summaries, reports and the CLI."""

from __future__ import annotations

import json
import math

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.metrics import summarize
from aospec.replay.policies import parse_policies
from aospec.replay.report import PLOTS, write_report
from aospec.replay.sweep import run_sweep

from aospec.cli import main as cli_main
from aospec.errors import ConfigError
from aospec.testing import FitRecorder
from aospec.types import Trace

JSON_KEYS = {
    "policy",
    "tpot_ms",
    "traces",
    "mean_saving",
    "p50_s",
    "p99_s",
    "hidden_tool_s",
    "obs_hit_rate",
    "action_hit_rate",
    "wasted_tool_s",
}


@pytest.fixture(scope="module")
def bundled() -> list[Trace]:
    return load_traces([bundled_traces_path()])


def test_leave_one_task_out_fits_drafters_only_on_other_tasks(bundled):
    FitRecorder.fits.clear()
    policies = parse_policies(["obs-only:obs_drafter=aospec.testing.FitRecorder"])
    subset = bundled[:3]
    run_sweep(subset, policies, tpots_ms=[10.0], jobs=1)
    by_id = {t.id: t for t in subset}
    assert len(FitRecorder.fits) == len({t.task for t in subset})
    for ids in FitRecorder.fits:
        tasks = {by_id[i].task for i in ids}
        assert len(tasks) == len(subset) - 1  # every task but the evaluated one


def test_given_training_set_is_the_only_one_drafters_see(bundled):
    FitRecorder.fits.clear()
    policies = parse_policies(["obs-only:obs_drafter=aospec.testing.FitRecorder"])
    train, evaluate = bundled[:4], bundled[4:6]
    run_sweep(evaluate, policies, train_traces=train, tpots_ms=[10.0], jobs=1)
    assert FitRecorder.fits == [tuple(t.id for t in train)]


def test_unknown_drafter_names_fail_before_any_work(bundled):
    with pytest.raises(ConfigError, match="unknown observation drafter 'psychic'"):
        run_sweep(bundled, parse_policies("aospec:obs_drafter=psychic"), tpots_ms=[10.0], jobs=2)
    with pytest.raises(ConfigError, match="unknown EVD kernel 'telepathy'"):
        run_sweep(bundled, parse_policies("aospec:kernel=telepathy"), tpots_ms=[10.0])


def test_leave_one_task_out_needs_two_tasks(bundled):
    with pytest.raises(ConfigError, match="at least two tasks"):
        run_sweep(bundled[:1], parse_policies("aospec"), tpots_ms=[10.0])


def test_parallel_sweep_equals_sequential_and_reports_every_output(bundled, tmp_path):
    policies = parse_policies("serial,oracle-action,spec-actions,aospec,obs-only")
    subset = bundled[:5]
    seq = run_sweep(subset, policies, tpots_ms=[20.0, 1.0], jobs=1)
    par = run_sweep(subset, policies, tpots_ms=[20.0, 1.0], jobs=2)
    assert seq == par
    summaries = summarize(seq)
    assert [(s.policy, s.tpot_ms) for s in summaries][:2] == [("serial", 20.0), ("oracle-action", 20.0)]
    serial = next(s for s in summaries if s.policy == "serial")
    assert serial.mean_saving == 0.0 and serial.obs_hit_rate == serial.action_hit_rate == 0.0
    aospec = next(s for s in summaries if s.policy == "aospec" and s.tpot_ms == 20.0)
    assert 0.0 < aospec.mean_saving <= aospec.mean_ceiling_saving
    assert math.isclose(aospec.mean_saving, sum(r.saving for r in seq if r.policy == "aospec" and r.tpot_ms == 20) / 5)
    written = write_report(tmp_path, seq, summaries, {"traces": 5})
    names = {p.name for p in written}
    assert {"results.jsonl", "summary.md", *PLOTS} <= names
    for p in written:
        assert p.stat().st_size > 0
    assert (tmp_path / "saving_vs_tpot.png").read_bytes()[:4] == b"\x89PNG"
    assert "| aospec | 20 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_sweep_cli_prints_one_json_object_per_policy_and_tpot(tmp_path, capsys, fmt):
    code = cli_main(
        [
            "sweep",
            "--bundled",
            "--policies",
            "serial,aospec,aospec:rank=likelihood",
            "--tpot-ms",
            "10,1",
            "--jobs",
            "1",
            "--no-progress",
            "--format",
            fmt,
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    # json: one document (an array); jsonl: one object per line
    rows = json.loads(out) if fmt == "json" else [json.loads(line) for line in out.splitlines()]
    assert [(r["policy"], r["tpot_ms"]) for r in rows] == [
        ("serial", 10.0),
        ("aospec", 10.0),
        ("aospec:rank=likelihood", 10.0),
        ("serial", 1.0),
        ("aospec", 1.0),
        ("aospec:rank=likelihood", 1.0),
    ]
    for r in rows:
        assert set(r) >= JSON_KEYS
        assert r["traces"] == 10
    assert (tmp_path / "out" / "results.jsonl").exists()


def test_replay_cli_with_train_and_eval_prints_per_trace_results(tmp_path, capsys):
    root = bundled_traces_path()
    files = sorted(root.rglob("*.jsonl"))
    train_dir, eval_dir = tmp_path / "train", tmp_path / "eval"
    train_dir.mkdir()
    eval_dir.mkdir()
    for i, f in enumerate(files):
        dest = train_dir if i >= 2 else eval_dir
        (dest / f.name).write_bytes(f.read_bytes())
        res = f.with_name(f.name.replace(".jsonl", ".results.json"))
        if res.exists():
            (dest / res.name).write_bytes(res.read_bytes())
    code = cli_main(
        [
            "replay",
            "--train-traces",
            str(train_dir),
            "--eval",
            str(eval_dir),
            "--policies",
            "serial,aospec",
            "--jobs",
            "1",
            "--format",
            "json",
        ]
    )
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 2 and {r["policy"] for r in rows} == {"serial", "aospec"}
    assert all(r["latency_ns"] <= r["serial_ns"] for r in rows)


def test_cli_errors_are_one_line(capsys):
    assert cli_main(["sweep", "--bundled", "--policies", "aospec:budget=3", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aospec: error: policy 'aospec:budget=3': unknown key 'budget'")
    assert cli_main(["sweep", "--bundled", "--tpot-ms", "10,x"]) == 2
    assert "expected comma-separated numbers" in capsys.readouterr().err
    assert cli_main(["replay", "--policies", "serial"]) == 2
    assert "no traces" in capsys.readouterr().err
    assert cli_main(["sweep", "--bundled", "--drafter-options", "{bad json"]) == 2
    assert "--drafter-options: not valid JSON" in capsys.readouterr().err


def test_a_sweep_with_a_slow_policy_says_so_with_an_estimate_first():
    from aospec.replay.cli.sweep import slow_policy_note

    assert slow_policy_note(parse_policies("serial,aospec,ceiling"), steps=929, tpots=5, jobs=2) is None
    note = slow_policy_note(parse_policies("serial,aospec:kernel=embedding"), steps=929, tpots=5, jobs=2)
    assert note is not None and note.startswith("aospec:kernel=embedding (embedding kernel): replays about ")
    assert "roughly 15 min for 929 steps x 5 TPOTs on 2 workers" in note
