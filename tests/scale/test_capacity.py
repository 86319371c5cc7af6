"""scripts/capacity.py: the per-session ledger of a replay and the fleet it implies."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "capacity.py"


@pytest.fixture(scope="module")
def capacity():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("aospec_capacity_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report(capacity):  # type: ignore[no-untyped-def]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert capacity.main(["--json", "--sessions", "1000,10000", "--tpot", "5"]) == 0
    return json.loads(out.getvalue())


def test_the_ledger_counts_what_the_engine_did(report) -> None:
    default, lean = report["per_session"]
    assert (default["config"], lean["config"]) == ("default", "lean")
    for ps in (default, lean):
        assert ps["traces"] == report["traces"] > 0 and ps["steps"] > 0
        assert ps["forks_per_step"] > 0 and ps["mean_live_forks"] > 0
        assert 0 < ps["mean_live_forks"] <= ps["peak_live_forks"]
        assert ps["drafter_calls_per_step"] > 0
    # the lean configuration forks less and keeps fewer forks alive
    assert lean["forks_per_step"] < default["forks_per_step"]
    assert lean["mean_live_forks"] < default["mean_live_forks"]
    assert lean["peak_live_forks"] <= default["peak_live_forks"]


def test_the_fleet_scales_with_sessions(report) -> None:
    fleets = {(f["config"], f["sessions"]): f for f in report["fleet"]}
    assert set(fleets) == {(c, n) for c in ("default", "lean") for n in (1000, 10000)}
    for c in ("default", "lean"):
        small, big = fleets[(c, 1000)], fleets[(c, 10000)]
        assert big["live_forks_mean"] == pytest.approx(10 * small["live_forks_mean"])
        assert big["cpu_cores"] == pytest.approx(10 * small["cpu_cores"])
        assert small["live_forks_mean"] <= small["live_forks_provisioned"]
        assert big["memory_gib"] > small["memory_gib"] > 0
        assert big["drafter_servers"] >= small["drafter_servers"] >= 1
        # servers = the token rate over one server's throughput, rounded up
        per_server = report["assumed"]["server_tok_s"]
        assert (big["drafter_servers"] - 1) * per_server < big["drafter_tok_s"] <= big["drafter_servers"] * per_server


def test_the_table_prints(capacity, capsys) -> None:
    assert capacity.main(["--sessions", "1000"]) == 0
    out = capsys.readouterr().out
    assert "| default | 1,000 |" in out and "| lean | 1,000 |" in out
