"""Prometheus metrics (aospec.metrics, issue 26 #5): ``aospec mcp`` over HTTP (``GET
/metrics`` behind the server's guard) and over stdio (``--metrics-port``), and ``aospec
run --metrics-port``, scraped with a real HTTP client (httpx) and parsed with
prometheus_client's own parser, after real tool calls on real sandboxes. Needs root and
overlayfs (but the missing-package check)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.integrations.conftest import AOSPEC, mcp_http_server, mcp_session

pytestmark = pytest.mark.anyio
pytest.importorskip("prometheus_client", reason="metrics need prometheus_client: pip install 'aospec[metrics]'")

SLOW_OK = ["--timeout", "600"]
TOKEN = "t0ken-for-the-metrics"
#: Setup, a read, and the same read again: the second is served from the fork the first's
#: repeat prediction launched.
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("bash", {"command": "mkdir -p /tmp/m && echo hello > /tmp/m/f"}),
    ("read_file", {"path": "/tmp/m/f"}),
    ("bash", {"command": "echo more >> /tmp/m/f"}),
    ("read_file", {"path": "/tmp/m/f"}),
    ("read_file", {"path": "/tmp/m/f"}),
    ("read_file", {"path": "/tmp/m/missing"}),  # a tool error
]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(got: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return got[(name, tuple(sorted(labels.items())))]


async def _calls(session: Any) -> list[Any]:
    return [await session.call_tool(n, a, read_timeout_seconds=300) for n, a in CALLS]


def _check_counters(got: dict[Any, float], results: list[Any]) -> None:
    served = sum(bool(r.meta["aospec"]["speculated"]) for r in results)
    assert served >= 1  # the repeated read came from a fork
    assert _value(got, "aospec_requests_total") == len(CALLS)
    assert _value(got, "aospec_steps_total") == len(CALLS)
    assert _value(got, "aospec_errors_total", kind="tool") == 1
    assert _value(got, "aospec_speculations_hit_total", kind="action") == served
    assert _value(got, "aospec_speculations_launched_total", kind="action") >= served
    assert _value(got, "aospec_speculations_launched_total", kind="observation") == 0  # no drafts in MCP
    assert _value(got, "aospec_tool_seconds_total") > 0
    assert 0 <= _value(got, "aospec_tool_seconds_hidden_total") <= _value(got, "aospec_tool_seconds_total")
    assert _value(got, "aospec_step_seconds_count") == len(CALLS)
    assert _value(got, "aospec_tool_call_seconds_count") == len(CALLS)
    assert _value(got, "aospec_live_forks") >= 0


async def test_mcp_over_http_serves_metrics_behind_its_guard(mcp_state_root: Path, tmp_path: Path) -> None:
    env = {"AOSPEC_STATE_ROOT": str(mcp_state_root), "AOSPEC_TOKEN": TOKEN}
    async with mcp_http_server(SLOW_OK, tmp_path / "mcp.log", env) as (_, url, _token):
        metrics_url = url.removesuffix("/mcp") + "/metrics"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(timeout=60) as http:
            before = samples((await http.get(metrics_url, headers=auth)).text)
            assert _value(before, "aospec_requests_total") == 0
            async with mcp_session(url, TOKEN) as session:
                results = await _calls(session)
            r = await http.get(metrics_url, headers=auth)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            _check_counters(samples(r.text), results)
            assert (await http.get(metrics_url)).status_code == 401  # the token, as on /mcp
            assert (await http.get(metrics_url, headers={**auth, "Host": "evil.example"})).status_code == 421
            assert (await http.post(metrics_url, headers=auth)).status_code == 405


async def test_mcp_over_stdio_serves_metrics_on_its_metrics_port(mcp_state_root: Path, tmp_path: Path) -> None:
    from mcp import ClientSession, StdioServerParameters, stdio_client

    env = {k: v for k, v in os.environ.items() if k != "AOSPEC_TOKEN"}
    env["AOSPEC_STATE_ROOT"] = str(mcp_state_root)
    params = StdioServerParameters(command=AOSPEC, args=["mcp", *SLOW_OK, "--metrics-port", "0"], env=env)
    log = tmp_path / "stderr.log"
    with log.open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            with anyio.fail_after(300):  # a hang guard
                await session.initialize()
            results = await _calls(session)
            text = log.read_text()
            assert "aospec mcp: metrics on http://127.0.0.1:" in text, text
            metrics_url = text.split("metrics on ", 1)[1].split()[0]
            async with httpx.AsyncClient(timeout=60) as http:
                r = await http.get(metrics_url)
                assert r.status_code == 200
                _check_counters(samples(r.text), results)
                assert (await http.get(metrics_url.removesuffix("metrics") + "other")).status_code == 404


def _count_trace() -> Any:
    from aospec.live.chat import ChatFormat

    from aospec.types import Step, Trace

    replies = [
        "THOUGHT: Make the directory.\n\n```bash\nmkdir -p /work\n```",
        "THOUGHT: Write the file.\n\n```bash\necho 1 2 3 > /work/n.txt\n```",
        "THOUGHT: Check it.\n\n```bash\ncat /work/n.txt\n```",
        "THOUGHT: Check it again.\n\n```bash\ncat /work/n.txt\n```",
        "THOUGHT: Done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    ]
    fmt = ChatFormat()
    steps = tuple(Step(action=fmt.parse(r), observation="", output_tokens=40, reply=r) for r in replies)
    return Trace("metrics-demo", "count", "mini-swe-agent", "demo-model", "tests", steps, instruction="count to 3")


def test_aospec_run_serves_metrics_while_it_runs(mcp_state_root: Path, tmp_path: Path) -> None:
    from aospec.live.serve_trace import serve_trace_app, serving

    env = {k: v for k, v in os.environ.items() if k != "AOSPEC_TOKEN"}
    env["AOSPEC_STATE_ROOT"] = str(mcp_state_root)
    log = tmp_path / "run.log"
    seen: list[dict[Any, float]] = []
    # 40 tokens at 25 ms: each reply takes about a second, so the run lasts long enough to scrape
    with serving(serve_trace_app([_count_trace()], 25.0)) as server, log.open("w") as err:
        proc = subprocess.Popen(
            [AOSPEC, "run", "count to 3", "--model", server.base_url, "--metrics-port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
        try:
            url = None
            with httpx.Client(timeout=10) as http:
                while proc.poll() is None:  # bounded by the run itself
                    text = log.read_text()
                    if url is None and "metrics on " in text:
                        url = text.split("metrics on ", 1)[1].split()[0]
                    if url is not None:
                        # (a refused scrape: the run ended between the poll and the scrape)
                        with contextlib.suppress(httpx.TransportError):
                            seen.append(samples(http.get(url).text))
                    time.sleep(0.05)
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=120)
    assert proc.returncode == 0, log.read_text()
    assert url is not None and url.startswith("http://127.0.0.1:"), log.read_text()
    steps = [_value(s, "aospec_steps_total") for s in seen]
    assert steps == sorted(steps) and steps[-1] >= 1  # counters only grow, and they moved
    last = seen[-1]
    assert _value(last, "aospec_requests_total") >= steps[-1]  # a model request per committed step at least
    assert _value(last, "aospec_step_seconds_count") == steps[-1]
    assert _value(last, "aospec_speculations_launched_total", kind="action") >= 0


@pytest.mark.parametrize(
    "verb", [["mcp", "--metrics-port", "0"], ["run", "t", "--model", "http://127.0.0.1:9", "--metrics-port", "0"]]
)
def test_without_prometheus_client_metrics_port_is_one_line(verb: list[str]) -> None:
    code = f"import sys; sys.modules['prometheus_client'] = None\nfrom aospec.cli import main\nsys.exit(main({verb!r}))"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--metrics-port" in lines[0] and "pip install 'aospec[metrics]'" in lines[0], r.stderr
