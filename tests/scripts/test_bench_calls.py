"""scripts/bench_calls.py in a tiny configuration: recorded function-calling sessions of a
small shop (a customer lookup whose result lists order ids, then each order read in
turn), replayed through the real ``aospec mcp`` proxy in front of the script's own
recording-serving MCP server. Checks that the speculative runs saw the serial runs'
results (the script fails otherwise) and that the calls drafter's prefetches of the
order ids a result listed were served. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "drafters"))

pytestmark = pytest.mark.slow


def test_bench_calls_serves_the_ids_a_result_listed(tmp_path: Path) -> None:
    from aospec.replay.io import write_jsonl
    from test_calls import traces

    write_jsonl(traces(6), tmp_path / "shop.jsonl")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_calls.py"),
            str(tmp_path / "shop.jsonl"),
            "--limit", "2", "--tpot", "1", "--latency-ms", "100",
            "--trust-tools", "get_customer,get_order", "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    total = report["total"]
    assert total["trajectories"] == 2 and len(report["rows"]) == 2
    # each session reads 2-4 orders after the lookup: the first and later ones are prefetched
    assert total["served"] >= 2 and total["launched"] >= total["served"]
    assert "[2/2]" in out.stderr  # progress on stderr


def test_bench_calls_chat_harness_the_proxy_fills_in_what_the_user_said(tmp_path: Path) -> None:
    """``--harness chat``: the same sessions through aospec proxy on serve-trace. The
    customer id is only in the user's first message: the proxy's drafters, which see the
    conversation, prefetch that lookup; the MCP server's, which see only calls, cannot."""
    from aospec.replay.io import write_jsonl
    from test_calls import traces

    write_jsonl(traces(6), tmp_path / "shop.jsonl")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_calls.py"),
            str(tmp_path / "shop.jsonl"),
            "--harness", "chat", "--configs", "mcp,proxy",
            "--limit", "2", "--tpot", "20", "--latency-ms", "100",
            "--trust-tools", "get_customer,get_order", "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    total = json.loads(out.stdout)["total"]
    assert set(total["configs"]) == {"serial", "mcp", "proxy"} and total["trajectories"] == 2
    assert total["configs"]["serial"]["served"] == 0
    # both lookups, besides the orders both see in the lookup's result
    assert total["configs"]["proxy"]["served"] >= total["configs"]["mcp"]["served"] + 2
    assert "[2/2]" in out.stderr


def test_bench_calls_offline_accuracy_counts_what_only_the_conversation_shows(tmp_path: Path) -> None:
    from aospec.replay.io import write_jsonl
    from test_calls import traces

    write_jsonl(traces(6), tmp_path / "shop.jsonl")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_calls.py"), str(tmp_path / "shop.jsonl"), "--offline", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    calls, conversation = report["accuracy"]["calls"], report["accuracy"]["conversation"]
    # the orders a lookup listed: both views; the customer the user named: only the conversation
    assert report["calls"] > 6 and 0 < calls["1"] < conversation["1"] and conversation["4"] >= conversation["1"]


def test_bench_calls_on_one_task_is_one_line(tmp_path: Path) -> None:
    from aospec.replay.io import write_jsonl

    from aospec.types import Action, Step, Trace

    write_jsonl(
        [Trace(id="b", task="t", harness="h", actor_model="m", source="test", steps=(Step(Action.bash("ls"), "", 2),))],
        tmp_path / "bash.jsonl",
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_calls.py"), str(tmp_path / "bash.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and "two tasks or more" in out.stderr
    assert "Traceback" not in out.stderr


def test_bench_calls_on_a_missing_path_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_calls.py"), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no such file" in out.stderr
