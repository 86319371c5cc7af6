"""``aospec sweep`` stopped by SIGTERM or SIGHUP ends as on Ctrl-C (issue 20 #10): exit 128 + N
with one line, its worker processes gone, the traces finished so far on disk. A real sweep
in a subprocess, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_ends_a_sweep_as_ctrl_c_does(tmp_path: Path, sig: int) -> None:
    out = tmp_path / "results"
    argv = [sys.executable, "-m", "aospec", "sweep", "--bundled", "--tpot-ms", "20,15,10,5,1", "--no-progress",
            "--policies", "serial,aospec", "--jobs", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers: set[int] = set()
        deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
        while time.monotonic() < deadline and proc.poll() is None:
            workers |= _children(proc.pid)
            results = out / "results.jsonl"
            if len(workers) >= 2 and results.exists() and results.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err  # as a shell reports a death by the signal
    said = "aospec: interrupted" if sig == signal.SIGINT else f"aospec: terminated by {signal.Signals(sig).name}"
    assert err.strip().splitlines()[-1] == said and "Traceback" not in err
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "sweep workers outlived the sweep"
    assert (out / "results.jsonl").read_text().count("\n") >= 1  # what finished is kept
