"""docs/replay.md documents every key a sweep writes, and no key a sweep does not write."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "replay.md"


def documented_fields(doc: str, file: str) -> set[str]:
    """The names in the first column of the table that follows the ``**`file`**`` line."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"**`{file}`**")), None)
    assert start is not None, f"docs/replay.md has no **`{file}`** field table"
    names: set[str] = set()
    in_table = False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            in_table = True
            first = line.split("|")[1]
            if first.strip() in ("field", "---"):
                continue
            names.update(re.findall(r"`([^`]+)`", first))
        elif in_table:
            break
    return names


def test_documented_fields_reads_the_first_column_only() -> None:
    doc = "**`x.jsonl`**: one\n\n| field | meaning |\n| --- | --- |\n| `a`, `b` | not `c` |\n| `d` | |\n\n| `e` | |\n"
    assert documented_fields(doc, "x.jsonl") == {"a", "b", "d"}


@pytest.fixture(scope="module")
def sweep_output(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    aospec = Path(sys.executable).with_name("aospec")
    # An observation drafter, an action drafter and canonical acceptance: every counter is
    # exercised (the keys do not depend on the policy, but this keeps it honest).
    done = subprocess.run(
        [str(aospec), "sweep", "--bundled", "--policies", "serial,aospec:accept=canonical", "--tpot-ms", "10",
         "--jobs", "1", "--no-progress", "--out", str(out)],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("file", ["results.jsonl", "summary.jsonl"])
def test_every_key_a_sweep_writes_is_documented(sweep_output: Path, file: str) -> None:
    written: set[str] = set()
    for line in (sweep_output / file).read_text().splitlines():
        written.update(json.loads(line))
    documented = documented_fields(DOC.read_text(encoding="utf-8"), file)
    assert not written - documented, f"{file} keys missing from docs/replay.md: {sorted(written - documented)}"
    assert not documented - written, f"docs/replay.md lists keys {file} does not have: {sorted(documented - written)}"
