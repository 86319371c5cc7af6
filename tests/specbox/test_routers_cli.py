"""``aospec routers eval``: output fields, the split, the gamma sweep, and bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from aospec.replay import bundled_traces_path, load_traces, write_jsonl

from aospec.cli import main

ROUTER_FIELDS = {
    "router",
    "micro_f1",
    "precision",
    "recall",
    "top3_hit",
    "coverage",
    "fire_position_mean",
    "fire_position_p50",
    "us_per_token",
}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def split_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # The first steps of each bundled trace keep the test quick.
    traces = [dataclasses.replace(t, steps=t.steps[:4]) for t in load_traces([bundled_traces_path()])]
    tasks = sorted({t.task for t in traces})
    assert len(tasks) >= 2
    held = set(tasks[: len(tasks) // 2])
    root = tmp_path_factory.mktemp("split")
    write_jsonl([t for t in traces if t.task not in held], root / "train.jsonl")
    write_jsonl([t for t in traces if t.task in held], root / "eval.jsonl")
    return root / "train.jsonl", root / "eval.jsonl"


def test_eval_json_has_one_record_per_router_and_assembly(
    split_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    train, evals = split_dirs
    rc, out, err = _run(["routers", "eval", "--train-traces", str(train), "--eval", str(evals), "--format", "json"], capsys)
    assert rc == 0, err
    records = json.loads(out)
    names = [r["router"] for r in records]
    assert names == [
        "keyword",
        "tfidf",
        "parse",
        "union",
        "intersection",
        "weighted",
        "union+parse",
        "union+parse(no-prior)",
        "markov",
    ]
    for r in records[:-1]:
        assert set(r) >= ROUTER_FIELDS
        assert 0.0 <= r["precision"] <= 1.0 and 0.0 <= r["coverage"] <= 1.0
        assert r["calls"] > 0 and r["split"] == "given" and r["shared_tasks"] == 0
    by_name = {r["router"]: r for r in records}
    # The prior gate only ever drops learned guesses: never a false positive more.
    assert by_name["union+parse"]["precision"] >= by_name["union+parse(no-prior)"]["precision"]
    markov = records[-1]
    assert 0.0 <= markov["next_tool_top1"] <= markov["next_tool_top3"] <= 1.0
    assert "warning" not in err


def test_eval_jsonl_and_table(split_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    train, evals = split_dirs
    rc, out, _ = _run(["routers", "eval", "--train-traces", str(train), "--eval", str(evals), "--format", "jsonl"], capsys)
    assert rc == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 9
    rc, out, _ = _run(["routers", "eval", "--train-traces", str(train), "--eval", str(evals)], capsys)
    assert rc == 0 and "micro_f1" in out and "union+parse" in out


def test_shared_tasks_are_warned_about(split_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    train, _ = split_dirs
    rc, out, err = _run(["routers", "eval", "--train-traces", str(train), "--eval", str(train), "--format", "json"], capsys)
    assert rc == 0
    assert "in both --train-traces and --eval" in err
    assert json.loads(out)[0]["shared_tasks"] > 0


def test_bundled_split_by_task_and_gamma_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["routers", "eval", "--bundled", "--gamma-sweep", "--format", "json"], capsys)
    assert rc == 0, err
    records = json.loads(out)
    assert [r["gamma"] for r in records] == [1, 2, 3, 4]
    assert all(r["split"] == "by-task" and r["eval_tasks"] >= 1 for r in records)
    # A higher threshold never fires on more calls.
    cov = [r["coverage"] for r in records]
    assert cov == sorted(cov, reverse=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["routers", "eval"], "no traces"),
        (["routers", "eval", "--train-traces", "x.jsonl"], "give both --train-traces and --eval"),
        (["routers", "eval", "/nonexistent/traces"], "no such file"),
        (["routers", "eval", "--bundled", "--gamma", "0"], "--gamma must be >= 1"),
        (["routers", "eval", "--bundled", "--max-file-mb", "-1"], "--max-file-mb"),
        (["routers", "eval", "--bundled", "--min-prior", "2"], "--min-prior must be in [0, 1]"),
    ],
)
def test_bad_input_is_one_error_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(argv, capsys)
    assert rc == 2
    assert message in err and "Traceback" not in err
    assert err.count("\n") == 1 and out == ""


def test_malformed_trace_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "trace", "schema": 1}\n')
    rc, _, err = _run(["routers", "eval", "--train-traces", str(bad), "--eval", str(bad)], capsys)
    assert rc == 2 and "bad.jsonl" in err and "Traceback" not in err
