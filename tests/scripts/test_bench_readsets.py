"""scripts/bench_readsets.py in a tiny configuration: one task, one run of each kind, on
the busybox base (python and gcc are missing there, so those commands fail fast, traced
and plain alike). Checks the JSON shape and that every command was tracked; no timing is
asserted: the figures are for people."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _bench(tmp_path: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_readsets.py"), "--base", "busybox", "--reps", "1",
         "--tasks", "inventory-discount", "--json", *extra],
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
    assert doc["committed"] is None  # not asked for


def test_the_committed_path_with_the_tracer_stopped_and_running(tmp_path: Path) -> None:
    from aospec.runtime.host import host_support
    from aospec.runtime.readsets import tracer_support

    problems = host_support()[0].problems()
    if problems or tracer_support().kind != "ebpf":
        pytest.skip(f"the eBPF tracer does not run here: {'; '.join(problems) or tracer_support().detail}")
    proc = _bench(tmp_path, "--tracers", "ebpf", "--committed", "--calls", "1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["ebpf_start_s"] > 0 and doc["ebpf_start_cpu_s"] > 0
    c = doc["committed"]
    assert c["reps"] == 1 and c["calls"] == 1000
    whats = [r["what"] for r in c["rows"]]
    assert whats == ["inventory-discount wall s", "inventory-discount CPU s", "all wall s", "all CPU s",
                     "getppid ns", "stat ns"]  # fmt: skip
    for r in c["rows"]:
        assert r["off"] > 0 and r["on"] > 0 and r["off_range"] == [r["off"]] * 2 and r["on_range"] == [r["on"]] * 2
    # run 1 stops the tracer first, then starts it again (once, its start measured)
    (start,) = c["starts"]
    assert start["wall_s"] > 0 and start["cpu_s"] > 0
    assert "tracer off" in proc.stderr and proc.stderr.index("tracer off") < proc.stderr.index("tracer on")


def test_the_tracers_start_beside_busy_processes(tmp_path: Path) -> None:
    """--start-under-load: one busy process burning 0.5 CPU-seconds, without the tracer
    starting beside it, with it, with it on tracefs's own available_events and asked for as a
    fork asks (once the host has a core to spare); the figures' shape, and that each start
    was timed."""
    from aospec.runtime.host import host_support
    from aospec.runtime.readsets import tracer_support

    problems = host_support()[0].problems()
    if problems or tracer_support().kind != "ebpf":
        pytest.skip(f"the eBPF tracer does not run here: {'; '.join(problems) or tracer_support().detail}")
    proc = _bench(tmp_path, "--start-under-load", "1", "--work", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert (doc["load"], doc["work_s"], doc["reps"]) == (1, 0.5, 1)
    none, start, plain, asked = doc["rows"]
    assert [r["mode"] for r in doc["rows"]] == ["none", "start", "start-tracefs", "asked"]
    assert none["ready_s"] is None and none["busy_late_s"]["median"] >= 0
    for row in (start, plain, asked):
        assert row["ready_s"]["median"] > 0 and row["start_cpu_s"]["median"] > 0
        assert row["busy_late_s"]["min"] == row["busy_late_s"]["max"]  # one run
    bad = _bench(tmp_path, "--start-under-load", "1", "--work", "0")
    assert bad.returncode == 2 and "--work > 0" in bad.stderr


def test_committed_without_the_ebpf_tracer_is_one_clear_error(tmp_path: Path) -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    proc = _bench(tmp_path, "--committed", AOSPEC_READ_SETS="strace")  # strace only: no bpftrace to stop
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("error: --committed: the eBPF tracer does not run here")


def test_without_the_tracer_one_line_and_status_2(tmp_path: Path) -> None:
    proc = _bench(tmp_path, AOSPEC_READ_SETS="off")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "bench_readsets: read sets are off: AOSPEC_READ_SETS=off"
