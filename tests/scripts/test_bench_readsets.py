"""scripts/bench_readsets.py in a tiny configuration: one task, one run of each kind, on
the busybox base (python and gcc are missing there, so those commands fail fast, traced
and plain alike). Checks the JSON shape and that every command was tracked; no timing is
asserted: the figures are for people."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _bench(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_readsets.py"), "--base", "busybox", "--reps", "1",
         "--tasks", "inventory-discount", "--json"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT), **env), cwd=tmp_path,
    )  # fmt: skip


def test_the_benchmark_prints_every_figure(tmp_path: Path) -> None:
    from aospec.runtime.host import host_support
    from aospec.runtime.readsets import tracer_support

    problems = host_support()[0].problems()
    if problems or not tracer_support().ok:
        pytest.skip(f"cannot trace sandboxes here: {'; '.join(problems) or tracer_support().detail}")
    proc = _bench(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["reps"] == 1 and doc["tracer"].startswith("on: ")
    tracers = doc["tracers"]
    assert tracers and set(tracers) <= {"ebpf", "strace"} and set(doc["by_tracer"]) == set(tracers)
    assert (doc["ebpf_start_s"] is not None) == ("ebpf" in tracers)
    keys = {"what", "tracer", "commands", "plain_s", "traced_s", "wall_overhead", "plain_cpu_s", "traced_cpu_s",
            "cpu_overhead", "read_set_s", "trace_lines", "untracked"}  # fmt: skip
    for tracer in tracers:
        (task,) = doc["by_tracer"][tracer]["tasks"]
        assert set(task) == keys == set(doc["by_tracer"][tracer]["all"]) and task["what"] == "inventory-discount"
        assert task["tracer"] == tracer and task["commands"] == len(doc["steps"]) == 10 and task["untracked"] == 0
        assert task["traced_s"] > 0 and task["plain_s"] > 0 and task["trace_lines"] > 0
        assert task["plain_cpu_s"] > 0 and task["traced_cpu_s"] > 0
        assert all(r[f"{tracer}_tracked"] and r[f"{tracer}_trace_lines"] > 0 for r in doc["steps"])
    assert doc["tasks"] == doc["by_tracer"][tracers[0]]["tasks"]


def test_without_the_tracer_one_line_and_status_2(tmp_path: Path) -> None:
    proc = _bench(tmp_path, AOSPEC_READ_SETS="off")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "bench_readsets: read sets are off: AOSPEC_READ_SETS=off"
