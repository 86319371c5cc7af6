"""``aospec sweep --executor ray`` on a local Ray (``ray.init``, two CPUs): results.jsonl
equals the local ``--jobs 2`` sweep's byte for byte; a trace that fails on every try is
reported by trace, policy and TPOT, with the traces that finished before it on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from aospec.cli import main as cli_main  # noqa: E402

FAULTY = "aospec.replay.faults.FaultyObservationDrafter"


def _sweep(out: Path, *args: str) -> int:
    return cli_main(
        ["sweep", "--bundled", "--policies", "serial,aospec", "--tpot-ms", "20,1", "--no-progress", "--out", str(out), *args]
    )


def test_sweep_on_ray_equals_the_local_sweep_record_for_record(local_ray, tmp_path: Path, capsys) -> None:
    assert _sweep(tmp_path / "local", "--jobs", "2") == 0
    assert _sweep(tmp_path / "ray", "--executor", "ray", "--jobs", "2") == 0
    local = (tmp_path / "local" / "results.jsonl").read_bytes()
    assert local and (tmp_path / "ray" / "results.jsonl").read_bytes() == local
    assert (tmp_path / "ray" / "summary.jsonl").read_bytes() == (tmp_path / "local" / "summary.jsonl").read_bytes()
    assert "- executor: ray (a local Ray, 2 workers)\n" in (tmp_path / "ray" / "summary.md").read_text()
    assert ray.is_initialized()  # the Ray it found connected is left as it was


def test_a_trace_failing_twice_on_ray_is_reported_and_the_finished_ones_kept(local_ray, tmp_path: Path, capsys) -> None:
    options = json.dumps({FAULTY: {"fail_on_task": "oom"}})
    code = cli_main(
        [
            "sweep",
            "--bundled",
            "--policies",
            f"serial,aospec:obs_drafter={FAULTY}",
            "--tpot-ms",
            "10",
            "--executor",
            "ray",
            "--jobs",
            "1",
            "--drafter-options",
            options,
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert (
        f"trace 'oom.1-of-1.2025-08-07__20-46-16', policy aospec:obs_drafter={FAULTY}, TPOT 10 ms: "
        "failed 2 times on Ray: InjectedFault" in err
    )
    finished = {json.loads(line)["task"] for line in (tmp_path / "results.jsonl").read_text().splitlines()}
    # one worker, traces in task order: the two tasks before oom finished and are on disk
    assert finished == {"cartpole-rl-training", "grid-pattern-transform"}
