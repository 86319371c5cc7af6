"""scripts/sweep.sh, the README's first command, in a scratch copy of the repository whose
``.venv`` is this environment (so nothing is installed): it runs ``aospec sweep --bundled``
with the options given after it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sweep_sh_replays_the_bundled_traces_with_the_options_given(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    (work / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "sweep.sh", work / "scripts" / "sweep.sh")
    (work / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    proc = subprocess.run(
        ["scripts/sweep.sh", "--tpot-ms", "10", "--policies", "serial,aospec", "--jobs", "1", "--no-progress",
         "--out", "out"],
        cwd=work, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = [json.loads(line) for line in (work / "out" / "summary.jsonl").read_text().splitlines()]
    assert {(s["policy"], s["tpot_ms"]) for s in summary} == {("serial", 10.0), ("aospec", 10.0)}
    assert all(s["traces"] == 10 for s in summary)  # the bundled sample
    assert "saving vs serial" in proc.stdout

