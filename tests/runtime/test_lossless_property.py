"""Losslessness, measured: the live engine on real overlay sandboxes, serial against
speculative, on the in-memory, disk-spilled, durable and compacting sandbox configurations
(runtime/lossless.py). Long runs: scripts/check_lossless.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from aospec.runtime import open_sandbox
from aospec.runtime.lossless import (
    SANDBOX_CONFIGS,
    CaseOutcome,
    LosslessCase,
    RunRecord,
    check_case,
    compare_runs,
    make_case,
    snapshot_sandbox,
    snapshot_tree,
)
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from aospec.types import Action

ROOT = Path(__file__).resolve().parents[2]

# Seeds, each run on all four sandbox configurations (a reference run, then a serial and a
# speculative run per configuration): 4 runs per seed.
SEEDS = 50


@pytest.mark.root
@settings(
    max_examples=SEEDS,
    deadline=None,
    derandomize=True,
    database=None,
    # a seed is not a structure: shrinking it finds nothing smaller (check_lossless.py minimises)
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seed=st.integers(0, 2**31 - 1))
# Found by scripts/check_lossless.py when snapshots compared hard-link groups (which are
# not part of the state: docs/runtime.md). 24: `touch` through a symlink copies up a file
# that has a hard link in a lower layer, which breaks the link without changing the
# version; a fork taken before it is then committed and the link is back. 17: compaction
# loses hard links made inside the layers it merges. Kept: every other field must match.
@example(seed=24)
@example(seed=17)
@example(seed=4)  # as 24, through an action drafter's fork: `chmod 644 /w/h` (mode unchanged), then `false`
def test_speculative_runs_equal_serial_runs_on_every_sandbox_configuration(
    overlay: str, runtime_dirs: dict[str, Path], seed: int
) -> None:
    async def main() -> list[str]:
        failures = []
        reference = None
        for config in SANDBOX_CONFIGS:
            for _ in range(3):  # inconclusive: a millisecond command timed out on a loaded machine
                outcome, reference = await check_case(
                    make_case(seed, config), reference=reference, state_root=runtime_dirs["state"]
                )
                if outcome.kind != "inconclusive":
                    break
                reference = None
            if not outcome.ok:
                failures.append(outcome.summary())
        return failures

    failures = anyio.run(main)
    assert not failures, "\n".join(
        [*failures, f"reproduce and minimise: scripts/check_lossless.py --seed {seed} --runs {len(SANDBOX_CONFIGS)}"]
    )


@pytest.mark.root
def test_the_check_speculates_with_right_and_wrong_guesses(overlay: str, runtime_dirs: dict[str, Path]) -> None:
    async def main() -> list[CaseOutcome]:
        # two seeds with wide speculation (fork_width 4, branch_budget 3)
        return [(await check_case(make_case(seed, "memory"), state_root=runtime_dirs["state"]))[0] for seed in (3, 7)]

    outcomes = anyio.run(main)
    for outcome in outcomes:
        assert outcome.ok, outcome.summary()
    launched = sum(o.forks_launched for o in outcomes)
    reused = sum(o.forks_reused for o in outcomes)
    assert reused > 0, "no speculative fork passed JASV: the check would prove nothing"
    assert reused < launched, "every fork was a right guess: no wrong one was checked"
    assert sum(o.drafts_hit for o in outcomes) > 0, "no drafted observation was right"


@pytest.mark.root
def test_the_check_sees_contents_that_the_version_does_not_name(overlay: str) -> None:
    async def main() -> tuple[RunRecord, RunRecord]:
        async with open_sandbox(backend="overlay", base="busybox") as sb:
            await sb.run("mkdir /w && echo a > /w/a")
            before = RunRecord([], sb.version, await snapshot_sandbox(sb))
            await sb.run("true")  # mounts the merged root on the host
            # a host process writes into the sandbox behind the version's back
            (sb.root_path / "w" / "planted").write_text("x")
            after = RunRecord([], sb.version, await snapshot_sandbox(sb))
        return before, after

    before, after = anyio.run(main)
    assert before.version == after.version
    problems = compare_runs(before, after, "planted")
    assert any("filesystem contents differ" in p for p in problems)
    assert any("/w/planted" in p for p in problems)


def test_a_snapshot_records_types_modes_owners_contents_targets_and_hard_links(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o750)
    (tmp_path / "d" / "f").write_text("one")
    os.chmod(tmp_path / "d" / "f", 0o4755)
    os.link(tmp_path / "d" / "f", tmp_path / "g")
    (tmp_path / "s").symlink_to("d/f")
    os.mkfifo(tmp_path / "p")  # never opened: a read would block
    snap = snapshot_tree(tmp_path, links=True)
    assert set(snap) == {"d", "d/f", "g", "s", "p"}
    assert snap["d"][:2] == ("d", 0o750)
    assert snap["d/f"][:2] == ("-", 0o4755) and snap["d/f"][-1] == "link:d/f" == snap["g"][-1]
    assert snap["s"][0] == "l" and snap["s"][-1] == "d/f"
    assert snap["p"][0] == "p"
    st_ = os.lstat(tmp_path / "d" / "f")
    assert snap["d/f"][2:4] == (st_.st_uid, st_.st_gid)

    (tmp_path / "d" / "f").write_text("two")  # content: both names change
    assert snapshot_tree(tmp_path, links=True)["g"][4] != snap["g"][4]
    os.unlink(tmp_path / "g")
    (tmp_path / "g").write_text("two")  # same content, no longer the same file
    again = snapshot_tree(tmp_path, links=True)
    assert again["g"][4] == again["d/f"][4] and len(again["g"]) == 5
    assert stat.S_IMODE(os.lstat(tmp_path / "d").st_mode) == 0o750
    os.link(tmp_path / "d" / "f", tmp_path / "h")
    assert len(snapshot_tree(tmp_path)["h"]) == 5  # by default, as in versions: no link groups


def test_a_case_is_a_function_of_its_seed_and_survives_json() -> None:
    a, b = make_case(7, "memory"), make_case(7, "compact")
    assert a == make_case(7, "memory")
    assert (a.pool, a.steps, dict(a.engine)) == (b.pool, b.steps, dict(b.engine))
    assert LosslessCase.from_json(json.loads(json.dumps(b.to_json()))) == b
    assert make_case(8, "memory").pool != a.pool
    with pytest.raises(ValueError, match="unknown sandbox configuration"):
        make_case(7, "tape")
    assert all(isinstance(Action.bash(c), Action) for c in a.pool if c)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_lossless.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.root
def test_check_lossless_script_prints_one_json_document(overlay: str, tmp_path: Path) -> None:
    proc = _script("--runs", "1", "--configs", "memory", "--json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["runs"] == 1 and doc["configs"]["memory"] == {
        "runs": 1,
        "ok": 1,
        "divergence": 0,
        "aborted": 0,
        "leak": 0,
        "inconclusive": 0,
    }
    assert doc["failures"] == [] and doc["runs_per_s"] > 0
    assert "1/1 runs" in proc.stderr


def test_check_lossless_script_rejects_unknown_configurations() -> None:
    proc = _script("--configs", "memory,tape")
    assert proc.returncode == 2
    assert "--configs" in proc.stderr and "memory, disk, durable, compact" in proc.stderr
