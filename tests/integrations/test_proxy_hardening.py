"""``aospec proxy`` under attack and misuse (issue 20): upstream URLs built from parts (no
SSRF through the request target), the token (never forwarded), Host/Origin checks on every
route, body limits, pass-through of what it cannot parse, one-line errors for bad options,
and SIGTERM/SIGHUP stopping it cleanly. Real servers on loopback (in threads, or the
command as a process), httpx and the openai SDK as clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aospec.integrations.proxy import proxy_app
from aospec.live.serve_trace import TraceServer, serve_trace_app, serving
from aospec.replay import bundled_traces_path, load_traces
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aospec._http import HttpGuard

AOSPEC = str(Path(sys.executable).with_name("aospec"))


@pytest.fixture
def servers() -> Iterator[Callable[[Any], TraceServer]]:
    with ExitStack() as stack:
        yield lambda app: stack.enter_context(serving(app))


def _recorder() -> tuple[Any, list[dict[str, Any]]]:
    """An upstream that answers every request with what it received (and records it)."""
    seen: list[dict[str, Any]] = []

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        seen.append({"path": request.url.path, "query": request.url.query, "headers": dict(request.headers),
                     "body": body})  # fmt: skip
        return JSONResponse({"path": request.url.path, "bytes": len(body)})

    routes = [Route("/{path:path}", echo, methods=["GET", "POST"])]
    return Starlette(routes=routes), seen


def _raw_request(port: int, target: bytes) -> bytes:
    """A request line no client library sends, straight on the socket."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_the_request_target_cannot_name_another_host(servers) -> None:
    """With ``--upstream http://127.0.0.1:A`` (no path), the target ``@127.0.0.1:B/x`` made the
    proxy fetch and relay ``http://127.0.0.1:A@127.0.0.1:B/x`` (issue 20 #8)."""
    upstream_app, upstream_seen = _recorder()
    secret_app, secret_seen = _recorder()
    upstream, secret = servers(upstream_app), servers(secret_app)
    proxy = servers(proxy_app(f"http://127.0.0.1:{upstream.port}"))
    for target in (b"@127.0.0.1:%d/x" % secret.port, b"//127.0.0.1:%d/x" % secret.port,
                   b"http://127.0.0.1:%d/x" % secret.port, b"/v1/../x", b"/v1/%2e%2e/x"):  # fmt: skip
        reply = _raw_request(proxy.port, target)
        assert reply.startswith(b"HTTP/1.1 400"), (target, reply[:200])
    assert secret_seen == [] and upstream_seen == []
    # plain targets join the upstream's path, and keep their query
    proxy2 = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/api/v1/"))
    r = httpx.get(f"{proxy2.url}/v1/models?x=1&y=%2F")
    assert r.json()["path"] == "/api/v1/models" and upstream_seen[-1]["query"] == "x=1&y=%2F"
    assert secret_seen == []


def test_the_token_is_required_and_never_forwarded(servers) -> None:
    upstream_app, seen = _recorder()
    upstream = servers(upstream_app)
    guard = HttpGuard.for_bind("127.0.0.1", "proxy-token", 1 << 20)
    proxy = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/v1", guard=guard))
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert httpx.get(f"{proxy.url}/aospec/stats").status_code == 401  # every route
    assert seen == []
    # the SDK's api_key is the proxy's token: it stops at the proxy
    openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="proxy-token", max_retries=0).models.with_raw_response.list()
    assert "authorization" not in seen[-1]["headers"]
    # X-Aospec-Token instead: the client's own Authorization (the upstream's key) passes
    httpx.get(f"{proxy.url}/v1/models", headers={"X-Aospec-Token": "proxy-token", "Authorization": "Bearer up-key"})
    assert seen[-1]["headers"]["authorization"] == "Bearer up-key" and "x-aospec-token" not in seen[-1]["headers"]
    # an upstream token (AOSPEC_UPSTREAM_TOKEN) replaces whatever the client sent
    proxy3 = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/v1", guard=guard, upstream_token="upstream-secret"))
    httpx.get(f"{proxy3.url}/v1/models", headers={"Authorization": "Bearer proxy-token"})
    assert seen[-1]["headers"]["authorization"] == "Bearer upstream-secret"


def test_host_origin_and_body_limits_guard_every_route(servers) -> None:
    """DNS rebinding reached /aospec/stats; streamed 1 GiB bodies took GBs of memory (issue 20)."""
    upstream_app, seen = _recorder()
    upstream = servers(upstream_app)
    guard = HttpGuard.for_bind("127.0.0.1", None, 64 << 10)
    proxy = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/v1", guard=guard))
    stats = f"{proxy.url}/aospec/stats"
    assert httpx.get(stats).status_code == 200
    assert httpx.get(stats, headers={"Host": "rebound.example"}).status_code == 421
    assert httpx.get(stats, headers={"Origin": "http://rebound.example"}).status_code == 403
    chat = f"{proxy.url}/v1/chat/completions"
    streamed = httpx.post(chat, content=(b" " * 4096 for _ in range(64)))  # chunked, 256 KiB
    assert streamed.status_code == 413 and "--max-body-mb" in streamed.json()["error"]["message"]
    assert httpx.post(chat, content=b" " * (65 << 10)).status_code == 413  # declared Content-Length
    assert seen == []  # none of them reached the upstream


def test_a_body_it_cannot_parse_passes_through_byte_for_byte(servers) -> None:
    """A 5,000-deep JSON body hit the proxy's own RecursionError (issue 20)."""
    upstream_app, seen = _recorder()
    upstream = servers(upstream_app)
    proxy = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/v1"))
    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    nested = json.loads("[" * 900 + "]" * 900)  # parses, but deeper than speculation looks
    medium = json.dumps({"model": "m", "temperature": 0, "messages": [{"role": "user", "content": nested}]}).encode()
    for body in (deep, medium):
        r = httpx.post(f"{proxy.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 200 and seen[-1]["body"] == body


def test_serve_trace_upstream_still_matches_through_a_guarded_proxy(servers) -> None:
    """The documented setup: the openai SDK's api_key is the proxy's token."""
    trace = load_traces(bundled_traces_path())[1]
    up = servers(serve_trace_app([trace], 0.0))
    guard = HttpGuard.for_bind("127.0.0.1", "tok", 1 << 20)
    proxy = servers(proxy_app(up.base_url, guard=guard))
    messages = [{"role": "user", "content": trace.instruction}]
    direct = openai.OpenAI(base_url=up.base_url, api_key="none").chat.completions.create(
        model="m", messages=messages, temperature=0
    )
    through = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="tok").chat.completions.create(
        model="m", messages=messages, temperature=0
    )
    assert through.choices[0].message.content == direct.choices[0].message.content


def _proxy_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [AOSPEC, "proxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "AOSPEC_TOKEN": "", **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--upstream", "http://127.0.0.1:9/v1", "--port", "99999"], "a port is 0 to 65535"),
        (["--upstream", "http://[::1", "--port", "0"], "is not a valid URL"),
        (["--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--host", "0.0.0.0"], "give it a token"),
        (["--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--max-body-mb", "nan"], "--max-body-mb must be"),
        (["--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--mcp", "http://127.0.0.1:9/mcp"], "--mcp needs"),
        (["--upstream", "http://127.0.0.1:9/v1", "--port", "0", "--mcp-tool-prefix", "aospec_"], "give --mcp URL"),
    ],
)
def test_bad_options_are_one_line(args: list[str], says: str) -> None:
    proc = _proxy_cmd(*args)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # it served instead of refusing
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_the_command_cleanly_with_a_request_in_flight(sig: int) -> None:
    """SIGHUP killed the proxy outright (issue 20 #10)."""
    trace = load_traces(bundled_traces_path())[1]
    with serving(serve_trace_app([trace], 1e7)) as up:  # a day per token: the request stays in flight
        proc = _proxy_cmd("--upstream", up.base_url, "--port", "0", "--no-speculate")
        try:
            lines = [proc.stdout.readline(), proc.stdout.readline()]  # type: ignore[union-attr]
            token = lines[0].split(": token ", 1)[1].split()[0]
            base = lines[1].split(" at ", 1)[1].split()[0]
            body = {"model": "m", "messages": [{"role": "user", "content": trace.instruction}], "stream": True}
            with httpx.stream(
                "POST", f"{base}/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
            ) as r:
                stream = r.iter_lines()
                assert next(stream).startswith("data: ")
                proc.send_signal(sig)
                with pytest.raises(httpx.HTTPError):
                    for line in stream:
                        assert "[DONE]" not in line
                    raise httpx.RemoteProtocolError("closed")
            _out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "aospec proxy: stopped" in err and "Traceback" not in err


def test_an_upstream_response_past_the_limit_is_an_error_not_an_unbounded_buffer(servers) -> None:
    """A hostile or broken upstream streaming without end: the proxy holds at most
    ``max_response_bytes`` of one response (it keeps responses to serve them again)."""
    from starlette.responses import StreamingResponse

    async def flood(request: Request) -> StreamingResponse:
        async def chunks() -> Any:
            for _ in range(64):  # 4 MiB in 64 KiB chunks
                yield b"x" * (64 << 10)

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def small(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    upstream = servers(
        Starlette(routes=[Route("/v1/flood", flood, methods=["POST"]), Route("/v1/small", small, methods=["POST"])])
    )
    proxy = servers(proxy_app(f"http://127.0.0.1:{upstream.port}/v1", max_response_bytes=1 << 20))
    try:
        r = httpx.post(f"{proxy.url}/v1/flood", content=b"{}", timeout=30)
    except httpx.RemoteProtocolError:
        pass  # cut mid-stream: the client sees that the response did not end (never a silent partial body)
    else:
        assert r.status_code == 502, (r.status_code, len(r.content))
    r = httpx.post(f"{proxy.url}/v1/small", content=b"{}", timeout=30)
    assert r.status_code == 200 and r.json() == {"ok": True}  # the proxy goes on serving
