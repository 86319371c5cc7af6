"""``scripts/check_lossless.py`` stopped by SIGTERM or SIGHUP ends as on Ctrl-C (issue 20
#10): exit 130 with one line, every private state root unmounted and removed, no worker
left. Needs root and overlayfs (the runs mount real sandboxes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def overlay() -> None:
    from aospec.runtime.host import host_support

    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")


@pytest.mark.root
@pytest.mark.parametrize(
    ("sig", "jobs", "group"),
    [(signal.SIGTERM, 2, False), (signal.SIGHUP, 2, False), (signal.SIGTERM, 1, False), (signal.SIGTERM, 2, True)],
)
def test_a_signal_stops_the_runs_and_leaves_no_state(
    overlay: None, tmp_path: Path, sig: int, jobs: int, group: bool
) -> None:
    """``group``: the signal goes to every process of the run (as ``kill -- -PGID`` or a
    service manager sends it), the workers included."""
    from aospec.runtime._fs import mounts_under

    roots = tmp_path / "roots"
    roots.mkdir()
    argv = [sys.executable, str(ROOT / "scripts" / "check_lossless.py"), "--runs", "400", "--jobs", str(jobs),
            "--no-minimise", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AOSPEC_LOSSLESS_TMPDIR": str(roots)}, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
        while time.monotonic() < deadline and proc.poll() is None and not mounts_under(str(roots)):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        time.sleep(1.0)  # into the runs
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
        deadline = time.monotonic() + 60  # a hang guard: workers exit once the parent is gone
        while time.monotonic() < deadline and _in_session(proc.pid):
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "check_lossless: interrupted" in err
    assert not mounts_under(str(roots)), "mounts left behind"
    assert list(roots.iterdir()) == [], "state roots left behind"
    assert not _in_session(proc.pid), "workers left behind"


def _in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` still alive (zombies aside)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                alive.append(int(entry.name))
    return alive
