"""scripts/bench_live.py in a tiny configuration: one task, one TPOT, on the busybox base
(so no Debian base is needed; python and gcc are missing there, so those commands fail
fast, the same way in serial and speculative runs). Checks the JSON shape, that the
speculative runs reproduced the serial ones, and that concurrent sessions leave nothing
behind. No timing is asserted: the figures are for people."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--base", "busybox", "--tasks", "inventory-discount", "--train-traces", "none", "--json"]


def _skip_reason() -> str | None:
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    return "; ".join(problems) if problems else None


pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _needs_overlay() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(f"overlay sandbox cannot run here: {reason}")


def _bench(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # a private state root: the leak check counts every state dir and mount under it, and
    # other tests (and other aospec users of the host) use the default one
    env = dict(os.environ, PYTHONPATH=str(ROOT), AOSPEC_STATE_ROOT=str(tmp_path / "state-root"))
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_live.py"), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )


def test_one_json_line_per_tpot_and_lossless(tmp_path: Path) -> None:
    png = tmp_path / "live.png"
    proc = _bench("--tpots", "1,2", "--plot", str(png), "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    rows = [r for r in lines if "saving" in r and "tasks" in r]
    assert [r["tpot_ms"] for r in rows] == [1.0, 2.0]
    for r in rows:
        assert r["lossless"] is True and r["diverged"] == []
        assert r["steps"] == 10 and r["tasks"] == 1
        for key in (
            "serial_s",
            "speculative_s",
            "tool_hidden_s",
            "obs_hit_rate",
            "action_hit_rate",
            "wasted_cpu_s",
            "fork_wasted_cpu_s",
            "overhead_ms_per_step",
            "peak_rss_mb",
            "predicted_saving",
            "prediction_error",
        ):
            assert isinstance(r[key], (int, float)), key
        assert 0 <= r["obs_hit_rate"] <= 1 and 0 <= r["action_hit_rate"] <= 1
        # the discarded guesses' own CPU (their cgroups) is never negative, unlike the
        # difference of the two runs' sandbox CPU, and is 0 when no guess was thrown away
        assert r["fork_wasted_cpu_s"] >= 0
        if r["forks_wasted"] == 0:
            assert r["fork_wasted_cpu_s"] == 0
    bytecode = [r for r in lines if "cache_only_steps" in r]
    assert len(bytecode) == 1 and bytecode[0]["diverged_without"] == []
    assert png.stat().st_size > 1000
    recorded = (tmp_path / "out" / "live.jsonl").read_text().splitlines()
    headers = [json.loads(x) for x in recorded if '"type":"trace"' in x]
    assert len(headers) == 4  # serial and speculative at two TPOTs
    steps = [json.loads(x) for x in recorded if '"type":"step"' in x]
    assert all(s["version_before"] and s["version_after"] for s in steps)


def test_concurrent_sessions_leave_nothing(tmp_path: Path) -> None:
    proc = _bench("--tpots", "1", "--sessions", "4", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["sessions"] == 4 and res["completed"] == 4
    assert res["failed"] == [] and res["diverged"] == [] and res["leaked"] == {}
    assert res["ok"] is True


def test_load_conditions_with_repeats_and_the_replays_prediction(tmp_path: Path) -> None:
    """--compare: two sessions at once beside one background process, two interleaved
    repeats; the quiet serial reference records each step's CPU time for the replay."""
    png = tmp_path / "load.png"
    args = ["--tpots", "1", "--compare", "--sessions", "2", "--background-load", "1", "--repeats", "2", "--carry-model"]
    prof = tmp_path / "prof"
    args += ["--profile-cpu", str(prof)]
    proc = _bench(*args, "--no-bytecode-check", "--plot", str(png), "--out", str(tmp_path / "o"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    # --profile-cpu: the condition's two arms' CPU profiles (both repeats together), readable
    # by pstats, and the speculative arm's extra CPU by function
    import pstats

    assert sorted(p.name for p in prof.iterdir()) == [
        "tpot1.n2.k1.aospec.prof",
        "tpot1.n2.k1.diff.txt",
        "tpot1.n2.k1.serial.prof",
    ]
    for arm in ("serial", "aospec"):
        assert pstats.Stats(str(prof / f"tpot1.n2.k1.{arm}.prof")).total_calls > 0
    diff = (prof / "tpot1.n2.k1.diff.txt").read_text()
    assert diff.startswith("aospec - serial, tpot1.n2.k1: ") and "cumulative CPU s" in diff
    assert (row["sessions"], row["background_load"], row["repeats"], row["tasks"]) == (2, 1, 2, 2)
    assert row["lossless"] is True and row["diverged"] == [] and row["carry_model"] is True
    for key in ("serial_s", "speculative_s", "saving"):
        assert row[f"{key}_min"] <= row[key] <= row[f"{key}_max"], key
    for key in ("predicted_saving", "prediction_error", "predicted_saving_no_contention", "replay_serial_s"):
        assert isinstance(row[key], (int, float)), key
    assert row["replay_host"].startswith(f"{row['cores']:g} core") and "1 background process;" in row["replay_host"]
    assert png.stat().st_size > 1000
    recorded = [json.loads(x) for x in (tmp_path / "o" / "live.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in recorded if r["type"] == "trace"]
    assert len(ids) == len(set(ids)) == 1 + 2 * 2 * 2  # the quiet reference, 2 repeats x 2 sessions x 2 modes
    quiet = ids.index("inventory-discount.a.serial.tpot1.quiet")
    at = [i for i, r in enumerate(recorded) if r["type"] == "trace"]
    steps = recorded[at[quiet] + 1 : at[quiet + 1] if quiet + 1 < len(at) else None]
    assert steps and all(isinstance(s["tool_cpu_s"], float) for s in steps)


def test_integration_rows_identical(tmp_path: Path) -> None:
    """One row per integration (mini-swe-agent, proxy, MCP), each reproducing its baseline,
    and a third-party harness's row (the OpenAI Agents SDK, the quickest: in process) in the
    same shape, or its one-line skip where it is not installed."""
    import importlib.util

    which = "mini-swe-agent,proxy,mcp,openai-agents"
    proc = _bench("--tpots", "1", "--integrations", which, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    agents = importlib.util.find_spec("agents") is not None
    assert [r["integration"] for r in rows] == [
        "mini-swe-agent",
        "proxy",
        "mcp",
        *(["openai-agents"] if agents else []),
    ]
    if not agents:
        assert "skip openai-agents: the OpenAI Agents SDK is not installed (pip install openai-agents)" in proc.stderr
    for r in rows:
        assert r["tpot_ms"] == 1.0 and r["tasks"] == 1
        assert r["identical"] is True and r["diverged"] == [], r
        for key in ("baseline_s", "aospec_s", "saving"):
            assert isinstance(r[key], (int, float)), key
    for r in rows[:3]:
        assert set(r["per_task"]) == {"inventory-discount.a"}
    if agents:  # the harness's own task, one run per mode; its stdio server's counters read
        harness = rows[3]
        assert harness["repeats"] == 1 and set(harness["per_task"]) == {"agents-sdk-task"}
        assert harness["per_task"]["agents-sdk-task"]["mcp_calls"] == 7 and harness["hits"] >= 1


def test_several_policies_against_the_same_serial_runs(tmp_path: Path) -> None:
    """--policy repeated: a row per policy in the order given, each against the same serial
    run, with its forks launched, wasted and rebased (also per task); read-set validation off
    rebases nothing; every run recorded under its own id."""
    off = "aospec:depth=3:read_sets=false"
    args = ["--tpots", "1", "--no-bytecode-check", "--policy", "aospec", "--policy", off, "--repeats", "2"]
    proc = _bench(*args, "--out", str(tmp_path / "o"), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["policy"] for r in rows] == ["aospec", off]
    on_row, off_row = rows
    assert on_row["serial_s"] == off_row["serial_s"]  # the same serial runs
    for r in rows:
        assert r["lossless"] is True and r["repeats"] == 2
        task = r["per_task"]["inventory-discount.a"]
        for key in ("forks_launched", "forks_wasted", "forks_rebased", "state_changing_steps"):
            # the row holds the median over repeats (x.5 where two repeats differ), the
            # per-task figures the first repeat's counts
            assert isinstance(r[key], (int, float)) and r[key] >= 0, key
            assert isinstance(task[key], int) and task[key] >= 0, key
        # the median of two repeats is their mean, so each repeat's bound holds for it too
        assert 0 <= r["forks_rebased"] <= r["forks_launched"] - r["forks_wasted"]
        assert 0 <= task["forks_rebased"] <= task["forks_launched"] - task["forks_wasted"]
    assert off_row["forks_rebased"] == 0
    recorded = [json.loads(x) for x in (tmp_path / "o" / "live.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in recorded if r["type"] == "trace"]
    assert len(ids) == len(set(ids)) == 2 * 3  # 2 repeats x (serial + 2 policies)
    assert "inventory-discount.a.spec.aospec_depth=3_read_sets=false.tpot1" in ids


@pytest.mark.parametrize(
    ("policies", "message"),
    [
        (["aospec", "aospec"], "--policy listed twice: aospec"),
        (["aospec:depht=3"], "unknown key 'depht'"),
    ],
)
def test_a_bad_policy_is_one_usage_line(tmp_path: Path, policies: list[str], message: str) -> None:
    args = [x for p in policies for x in ("--policy", p)]
    proc = _bench("--tpots", "1", *args, tmp_path=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
