"""The device check script runs end to end at smoke sizes on the CPU (no trivial crash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_device_check_smoke_run_writes_a_complete_summary(tmp_path: Path) -> None:
    from aospec.replay import bundled_traces_path

    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_train_check.sh"), "--smoke", "--traces", str(bundled_traces_path())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "device_check.json").read_text())
    assert json.loads(proc.stdout) == summary
    assert summary["errors"] == [], summary["errors"]
    stages = summary["stages"]
    for name in ("environment", "load_traces", "latency_big", "train_small", "latency_trained_small"):
        assert stages[name].get("ok"), (name, stages[name])
    paths = summary["latency_big_shape"]["paths"]
    for key in ("generate/b1", "dynamic/b1", "static/b1", "dynamic/b3"):
        assert "ms_per_step" in paths[key], (key, paths[key])
    assert paths["static/b1"]["greedy_prefix_agreement"] == "32/32"
    training = summary["training"]
    assert training["steps"] == 3 and training["evaluated"] == 4
    assert 0.0 <= training["top1"] <= training["top5"] <= 1.0
    assert (tmp_path / "train_metrics.json").is_file()
