"""serve-trace over real HTTP: the official openai SDK as its client, the reply-index rule,
errors in OpenAI's shape, disconnects, and the real command under SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from aospec.live.chat import ChatFormat
from aospec.live.serve_trace import reply_text, serve_trace, serve_trace_app

from aospec.errors import ConfigError
from aospec.types import Action, Trace

FMT = ChatFormat()


def _messages(trace: Trace, upto: int) -> list[dict]:
    return FMT.messages(trace.history(upto))


def test_openai_sdk_streams_the_recorded_reply_with_usage(trace_server, bundled_traces) -> None:
    trace = bundled_traces[1]
    client = openai.OpenAI(base_url=trace_server.base_url, api_key="x", max_retries=0)
    for upto in (0, 3):
        stream = client.chat.completions.create(
            model="any", messages=_messages(trace, upto), stream=True, stream_options={"include_usage": True}
        )
        text, finish, usage = "", None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert text == reply_text(trace.steps[upto])
        assert FMT.parse(text) == trace.steps[upto].action
        assert finish == "stop"
        assert usage.completion_tokens == trace.steps[upto].output_tokens


def test_openai_sdk_plain_response_and_models(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]
    client = openai.OpenAI(base_url=trace_server.base_url, api_key="x", max_retries=0)
    resp = client.chat.completions.create(model="m", messages=_messages(trace, 2))
    assert resp.choices[0].message.content == reply_text(trace.steps[2])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == trace.steps[2].output_tokens
    assert [m.id for m in client.models.list()] == ["serve-trace"]


def test_openai_sdk_tool_call_when_the_request_has_tools(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]
    client = openai.OpenAI(base_url=trace_server.base_url, api_key="x", max_retries=0)
    tools = FMT.__class__(action_format="tools").tool_request_bodies()["tools"]
    resp = client.chat.completions.create(model="m", messages=_messages(trace, 0), tools=tools)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls"
    assert Action(call.function.name, json.loads(call.function.arguments)) == trace.steps[0].action
    stream = client.chat.completions.create(model="m", messages=_messages(trace, 0), tools=tools, stream=True)
    calls = [tc for chunk in stream for ch in chunk.choices for tc in (ch.delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == dict(trace.steps[0].action.args)


def test_reply_index_is_the_number_of_assistant_messages_and_repeats(trace_server, bundled_traces) -> None:
    trace = bundled_traces[2]
    body = {"model": "m", "messages": _messages(trace, 4)}
    with httpx.Client(base_url=trace_server.base_url) as client:
        a = client.post("/chat/completions", json=body).json()
        b = client.post("/chat/completions", json=body).json()
        # Different reply texts in the history do not matter, only their count.
        body["messages"][2]["content"] = "something else the actor wrote"
        c = client.post("/chat/completions", json=body).json()
    assert a == b
    assert a["choices"] == c["choices"]
    assert a["choices"][0]["message"]["content"] == reply_text(trace.steps[4])
    assert [entry[:2] for entry in trace_server.stats.log] == [(trace.id, 4)] * 3


def test_unknown_conversation_and_exhausted_trace_are_openai_errors(trace_server, bundled_traces) -> None:
    client = openai.OpenAI(base_url=trace_server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "an unknown task"}])
    assert "no served trace matches" in err.value.message
    trace = bundled_traces[3]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=_messages(trace, len(trace.steps)))
    assert f"has {len(trace.steps)} replies" in err.value.message
    r = httpx.post(trace_server.base_url + "/chat/completions", content=b"not json")
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.get(trace_server.url + "/v2/nothing").json()["error"]["code"] == "not_found"


def test_trace_id_header_and_option_pick_the_conversation(serve_traces, bundled_traces) -> None:
    a, b = bundled_traces[0], bundled_traces[1]
    server = serve_traces(bundled_traces)
    body = {"model": "m", "messages": [{"role": "user", "content": "whatever"}]}
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers={"X-Trace-Id": b.id})
    assert r.json()["choices"][0]["message"]["content"] == reply_text(b.steps[0])
    only = serve_traces(bundled_traces, trace_id=a.id)
    r = httpx.post(only.base_url + "/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == reply_text(a.steps[0])
    with pytest.raises(ConfigError, match="no trace"):
        serve_trace_app(bundled_traces, 1, trace_id="nope")


def test_a_reply_that_does_not_parse_back_is_served_as_its_action(bundled_traces) -> None:
    odd = 0
    for trace in bundled_traces:
        for step in trace.steps:
            cmd = step.action.command
            if cmd is not None and cmd != cmd.strip():
                # A bash block cannot carry a command's surrounding whitespace (mini-swe-agent
                # strips it too); the sample has one such step, with a format-error observation.
                odd += 1
                assert FMT.parse(reply_text(step)) == Action.bash(cmd.strip())
                continue
            assert FMT.parse(reply_text(step)) == step.action
    assert odd <= 1


def test_stream_is_chunked_and_a_disconnect_stops_a_huge_tpot(serve_traces, bundled_traces) -> None:
    trace = bundled_traces[0]
    server = serve_traces([trace], tpot_ms=1e7)  # ~ a day per token
    body = {"model": "m", "messages": _messages(trace, 0), "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", server.base_url + "/chat/completions", json=body) as r,
    ):
        first = next(r.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    for _ in range(2000):  # bounded wait for the server to notice
        if server.stats.disconnected:
            break
        time.sleep(0.005)
    assert server.stats.disconnected == 1 and server.stats.active == 0


def test_serve_trace_async_context_manager_under_trio(bundled_traces) -> None:
    async def main() -> str:
        async with serve_trace(bundled_traces[:1], tpot_ms=0) as server, httpx.AsyncClient() as client:
            r = await client.post(server.base_url + "/chat/completions", json={"model": "m", "messages": []})
            return r.json()["choices"][0]["message"]["content"]

    assert anyio.run(main, backend="trio") == reply_text(bundled_traces[0].steps[0])


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_command_serves_and_stops_cleanly_on_a_signal(tmp_path: Path, bundled_traces, sig) -> None:
    aospec = Path(sys.executable).with_name("aospec")
    proc = subprocess.Popen(
        [str(aospec), "serve-trace", "--bundled", "--tpot-ms", "0", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving 10 trace(s) at http://127.0.0.1:"), line
        base = line.split(" at ")[1].split()[0]
        port = int(base.rsplit(":", 1)[1].split("/")[0])
        trace = bundled_traces[4]
        r = httpx.post(base + "/chat/completions", json={"model": "m", "messages": _messages(trace, 1)}, timeout=30)
        assert r.json()["choices"][0]["message"]["content"] == reply_text(trace.steps[1])
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert _free(port)


def test_the_command_needs_traces(tmp_path: Path) -> None:
    aospec = Path(sys.executable).with_name("aospec")
    r = subprocess.run([str(aospec), "serve-trace", "--tpot-ms", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--bundled" in r.stderr


def test_sigterm_with_a_reply_in_flight_still_exits_cleanly(bundled_traces) -> None:
    aospec = Path(sys.executable).with_name("aospec")
    proc = subprocess.Popen(
        [str(aospec), "serve-trace", "--bundled", "--tpot-ms", "1e7", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        base = proc.stdout.readline().split(" at ")[1].split()[0]
        trace = bundled_traces[0]
        body = {"model": "m", "messages": _messages(trace, 0), "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", base + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # streaming, a day per token
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # the server ends the stream: cut, never completed
                for line in lines:
                    assert "[DONE]" not in line
                raise httpx.RemoteProtocolError("closed")
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err


def test_the_first_token_comes_alone_then_chunks_of_chunk_ms(serve_traces, bundled_traces) -> None:
    trace = bundled_traces[0]
    step = trace.steps[0]
    server = serve_traces([trace], tpot_ms=0.5)  # chunk_ms 5: 10 tokens a chunk
    body = {"model": "m", "messages": _messages(trace, 0), "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content = [d["choices"][0]["delta"].get("content") for d in deltas if d["choices"]]
    pieces = [c for c in content if c]
    assert "".join(pieces) == reply_text(step)
    assert len(pieces) == 1 + -(-(step.output_tokens - 1) // 10)
    assert len(pieces[0]) == len(reply_text(step)) // step.output_tokens


def _raw(base: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        base + "/chat/completions", content=body, headers={"content-type": "application/json", **(headers or {})}
    )


def test_malformed_requests_are_one_400_not_a_500_with_a_traceback(trace_server, bundled_traces, capfd) -> None:
    """Deep JSON and ``"stream_options": "yes"`` were a 500 and a traceback (issue 20)."""
    base = trace_server.base_url
    messages = _messages(bundled_traces[4], 1)
    cases = {
        "deep": b'{"messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "stream_options": json.dumps({"messages": messages, "stream": True, "stream_options": "yes"}).encode(),
        "stream": json.dumps({"messages": messages, "stream": "yes"}).encode(),
        "not utf-8": b'{"messages": ["\xff\xfe"]}',
    }
    for why, body in cases.items():
        r = _raw(base, body)
        assert r.status_code == 400, (why, r.text)
        assert r.json()["error"]["message"].startswith("serve-trace: "), why
    assert "stream_options' must be an object, got a string" in _raw(base, cases["stream_options"]).text
    assert "Traceback" not in capfd.readouterr().err


def test_host_origin_and_body_limits_are_checked(serve_traces, bundled_traces) -> None:
    """Any Host and Origin were accepted (DNS rebinding), and any body size (issue 20)."""
    from aospec._http import HttpGuard

    server = serve_traces(bundled_traces, 0.0, guard=HttpGuard.for_bind("127.0.0.1", None, 4096))
    base = server.base_url
    body = json.dumps({"model": "m", "messages": _messages(bundled_traces[4], 1)}).encode()
    assert _raw(base, body).status_code == 200
    assert _raw(base, body, {"Host": "attacker.example"}).status_code == 421
    assert _raw(base, body, {"Origin": "http://attacker.example"}).status_code == 403
    assert _raw(base, body, {"Origin": f"http://localhost:{server.port}"}).status_code == 200
    assert httpx.get(base + "/models", headers={"Host": "attacker.example"}).status_code == 421
    big = httpx.post(base + "/chat/completions", content=(b" " * 1024 for _ in range(64)))  # streamed
    assert big.status_code == 413 and "--max-body-mb" in big.json()["error"]["message"]
    assert _raw(base, b" " * 5000).status_code == 413  # declared


def _serve_trace(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    aospec = Path(sys.executable).with_name("aospec")
    return subprocess.Popen(
        [str(aospec), "serve-trace", "--bundled", "--tpot-ms", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def test_a_token_is_required_when_given_and_off_loopback(bundled_traces) -> None:
    for args, says in [
        (["--port", "99999"], "a port is 0 to 65535"),
        (["--port", "0", "--host", "0.0.0.0"], "give it a token (--token-file FILE or AOSPEC_TOKEN)"),
        (["--port", "0", "--max-body-mb", "0"], "--max-body-mb must be a finite number > 0"),
    ]:
        proc = _serve_trace(*args, env={"AOSPEC_TOKEN": ""})
        try:
            _out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:  # it served instead of refusing
                proc.kill()
                proc.wait()
        assert proc.returncode == 2 and says in err and "Traceback" not in err, err
    proc = _serve_trace("--port", "0", env={"AOSPEC_TOKEN": "st-token"})
    try:
        base = proc.stdout.readline().split(" at ")[1].split()[0]  # type: ignore[union-attr]
        messages = _messages(bundled_traces[4], 1)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=messages
            )
        r = openai.OpenAI(base_url=base, api_key="st-token", max_retries=0).chat.completions.create(
            model="m", messages=messages
        )
        assert r.choices[0].message.content == reply_text(bundled_traces[4].steps[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
