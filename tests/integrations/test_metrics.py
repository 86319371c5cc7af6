"""Prometheus metrics (aospec.metrics, issue 26 #5): ``aospec mcp`` over HTTP (``GET
/metrics`` behind the server's guard) and over stdio (``--metrics-port``), and ``aospec
run --metrics-port``, scraped with a real HTTP client (httpx) and parsed with
prometheus_client's own parser, after real tool calls on real sandboxes (those need root and
overlayfs); ``aospec proxy`` (``GET /metrics`` behind its guard) after real ``openai`` SDK
requests to a serve-trace upstream (no root needed)."""

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

from aospec.types import Action, Step, Trace
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


# -- aospec proxy ------------------------------------------------------------------------------

#: The harness's answer to a reply without an action, which the proxy drafts from the last one.
FORMAT_ERROR = "Please always provide EXACTLY ONE action in triple backticks."


def _actionless_trace() -> Trace:
    """Replies that hold no action: the harness answers each with its format-error message."""
    steps = tuple(
        Step(action=Action.none(), observation=FORMAT_ERROR, output_tokens=5, reply=f"THOUGHT: thinking, step {i}")
        for i in range(10)
    )
    return Trace("proxy-metrics", "think", "mini-swe-agent", "demo-model", "tests", steps, instruction="count to 3")


@contextlib.contextmanager
def _proxy(upstream: str, *, code: str | None = None) -> Any:
    """``aospec proxy`` in front of ``upstream`` (``code``: run through ``python -c`` instead,
    with ``sys.argv[1:]`` the verb's arguments); yields its base URL (``.../v1``)."""
    args = ["proxy", "--upstream", upstream, "--port", "0"]
    cmd = [AOSPEC, *args] if code is None else [sys.executable, "-c", code, *args]
    env = {**os.environ, "AOSPEC_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert " at http://" in line, (line, proc.stderr.read() if proc.poll() is not None else "")  # type: ignore[union-attr]
        yield line.split(" at ", 1)[1].split()[0]
        proc.terminate()
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _scrape(http: httpx.Client, url: str, settled: Any) -> dict[Any, float]:
    """A scrape once ``settled(samples)`` holds: a request is counted before its response goes
    out, its latency once its handler returns, just after the client has the response."""
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while True:
        got = samples(http.get(url, headers={"Authorization": f"Bearer {TOKEN}"}).text)
        if settled(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_proxy_serves_metrics_behind_its_guard() -> None:
    import openai
    from aospec.live.serve_trace import serve_trace_app, serving

    with serving(serve_trace_app([_actionless_trace()], 0.0)) as up, _proxy(up.base_url) as base:
        metrics_url = base.removesuffix("/v1") + "/metrics"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(timeout=60) as http:
            before = samples(http.get(metrics_url, headers=auth).text)
            assert _value(before, "aospec_requests_total", endpoint="chat/completions") == 0
            assert _value(before, "aospec_steps_total") == 0
            client = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "count to 3"}]
            # six turns: the format is learned from the second request, so the third, fourth
            # and fifth meet their speculative twin; the sixth answers the fifth reply with
            # another message (a miss), closing the speculation drafted for it
            for answer in [FORMAT_ERROR] * 4 + ["something else"]:
                r = client.chat.completions.create(model="m", messages=messages, temperature=0)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": answer}]  # fmt: skip
            client.chat.completions.create(model="m", messages=messages, temperature=0)
            client.responses.create(model="m", input="count to 3", temperature=0, store=False)
            client.models.list()
            with pytest.raises(openai.BadRequestError):  # the upstream refuses it: relayed as it is
                client.chat.completions.create(model="m", messages=messages, extra_body={"messages": "not a list"})
            with pytest.raises(openai.AuthenticationError):  # the proxy's guard refuses it
                openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
            assert http.get(metrics_url).status_code == 401  # the token, as on /v1
            assert http.get(metrics_url, headers={**auth, "Host": "evil.example"}).status_code == 421
            assert http.post(metrics_url, headers=auth).status_code == 405
            r = http.get(metrics_url, headers=auth)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            model_requests = 6 + 1 + 1  # chat, the bad one, Responses
            got = _scrape(http, metrics_url, lambda g: _value(g, "aospec_step_seconds_count") == model_requests)
            stats = http.get(base.removesuffix("/v1") + "/aospec/stats", headers=auth).json()
    assert _value(got, "aospec_requests_total", endpoint="chat/completions") == 7
    assert _value(got, "aospec_requests_total", endpoint="responses") == 1
    assert _value(got, "aospec_requests_total", endpoint="other") == 1  # GET /v1/models
    assert _value(got, "aospec_requests_total", endpoint="aospec/stats") == 0  # (scraped after)
    assert _value(got, "aospec_steps_total") == model_requests
    assert _value(got, "aospec_step_seconds_count") == model_requests
    assert _value(got, "aospec_step_seconds_sum") > 0
    assert _value(got, "aospec_tool_call_seconds_count") == 0  # the harness runs the tools
    # a speculation after each of requests 2 to 6; 3, 4 and 5 hit; 6 closed the one for it
    assert _value(got, "aospec_speculations_launched_total", kind="observation") == 5
    assert _value(got, "aospec_speculations_hit_total", kind="observation") == 3
    assert _value(got, "aospec_speculations_wasted_total", kind="observation") == 1
    assert _value(got, "aospec_speculations_launched_total", kind="action") == 0  # no --mcp
    assert _value(got, "aospec_decode_seconds_hidden_total") > 0
    assert _value(got, "aospec_wasted_seconds_total", kind="decode") > 0
    assert _value(got, "aospec_errors_total", kind="model") == 1
    assert _value(got, "aospec_errors_total", kind="request") == 3  # wrong key, no token, bad Host
    assert _value(got, "aospec_errors_total", kind="upstream") == 0
    assert 0 <= _value(got, "aospec_live_forks") <= 2  # the last speculation may still be in flight
    assert (stats["hits"], stats["speculated"], stats["refused"], stats["error_replies"]) == (3, 5, 3, 1)


def test_proxy_counts_an_unreachable_upstream() -> None:
    """In process (``proxy_app`` makes metrics of its own): a refused upstream is a 502 and
    an ``upstream`` error."""
    from aospec.integrations.proxy import proxy_app
    from aospec.live.serve_trace import serving

    with serving(proxy_app("http://127.0.0.1:9/v1")) as px:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
        assert httpx.post(f"{px.base_url}/chat/completions", json=body, timeout=60).status_code == 502
        got = samples(httpx.get(f"{px.url}/metrics", timeout=60).text)
    assert _value(got, "aospec_errors_total", kind="upstream") == 1
    assert _value(got, "aospec_requests_total", endpoint="chat/completions") == 1


def test_proxy_without_prometheus_client_answers_one_501_line() -> None:
    from aospec.live.serve_trace import serve_trace_app, serving

    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from aospec.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    with serving(serve_trace_app([_actionless_trace()], 0.0)) as up, _proxy(up.base_url, code=code) as base:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        metrics_url = base.removesuffix("/v1") + "/metrics"
        r = httpx.get(metrics_url, headers=auth, timeout=60)
        assert r.status_code == 501, r.text
        assert len(r.text.strip().splitlines()) == 1 and "pip install 'aospec[metrics]'" in r.json()["error"]["message"]
        assert httpx.get(metrics_url, timeout=60).status_code == 401  # the guard still comes first
        assert httpx.get(f"{base}/models", headers=auth, timeout=60).status_code == 200  # the proxy still serves
