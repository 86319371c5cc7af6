"""scripts/bench_runtime.py runs and prints the figures the issue asks for (no timing
is asserted here: the figures are for people, in the closing note and the README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_benchmark_prints_every_required_figure(overlay: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    png = tmp_path / "runtime.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_runtime.py"),
            "--json",
            "--quick",
            "--no-docker",
            "-n",
            "4",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout)
    for key in (
        "overlay_fork_p50_ms",
        "overlay_fork_exec_p50_ms",
        "overlay_version_10files_ms",
        "hash_gb_per_s",
        "overlay_commit_p50_ms",
        "step_via_fork_p50_ms",
        "step_fork_commit_overhead_p50_ms",
        "step_direct_p50_ms",
        "fork_while_root_runs_p50_ms",
        "overlay_pause_p50_ms",
        "overlay_resume_p50_ms",
    ):
        assert figures[key] > 0
    assert png.stat().st_size > 1000
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_runtime.py"), "--json", "--cycles", "20"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    leaks = json.loads(proc.stdout)
    assert leaks["overlay_cycles"] == 20
    assert {k: v for k, v in leaks.items() if k.startswith("overlay_leaked_")} == {
        f"overlay_leaked_{k}": 0 for k in ("mounts", "processes", "cgroups", "fds", "state_dirs", "sandbox_processes")
    }


def test_the_mount_index_benchmark_prints_both_modes(overlay: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_mount_index.py"), "--json", "--repeats", "2", "--commands", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"index=on", "index=off"}
    for kinds in doc.values():
        for kind in ("root_command_ms", "fork_run_commit_ms"):
            assert len(kinds[kind]["runs"]) == 2 and kinds[kind]["median"] > 0
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_mount_index.py"), "--repeats", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "at least 1" in bad.stderr and "Traceback" not in bad.stderr
