"""scripts/bench_live/load.py: the benchmark's background load is CPU-bound and never
outlives its block or the benchmark (not even ``kill -9`` of it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_live.load import background_load  # noqa: E402


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s  # a hang guard, not a speed target
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_load_runs_on_the_cpu_and_ends_with_its_block() -> None:
    excluded: list[int] = []
    with background_load(2, exclude=excluded.append) as pids:
        assert len(pids) == 2 and excluded == pids and all(alive(p) for p in pids)
        before = [cpu_ticks(p) for p in pids]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(cpu_ticks(p) > b for p, b in zip(pids, before, strict=True)):
            time.sleep(0.05)
        assert all(cpu_ticks(p) > b for p, b in zip(pids, before, strict=True))
    assert not any(alive(p) for p in pids)


def test_the_load_ends_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), background_load(1) as pids:
        raise RuntimeError("boom")
    assert not any(alive(p) for p in pids)


def test_the_load_ends_by_itself_when_the_benchmark_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT / "scripts")!r})
        from bench_live.load import background_load
        with background_load(2) as pids:
            print(" ".join(map(str, pids)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids), "a loader outlived the benchmark"
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)
