"""OpenAIChatActor over real HTTP on loopback: against serve-trace (recorded actions, usage,
memo, concurrency, cancellation seen by the server, tool calls, determinism) and against
small starlette fault servers (retries, clear errors, cut streams, bounded timeouts)."""

from __future__ import annotations

import json

import anyio
import pytest
from aospec.live.actors import OpenAIChatActor
from aospec.live.chat import ActorError, ChatFormat
from aospec.live.serve_trace import reply_text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from aospec.protocols import Actor
from aospec.types import Action, History

pytestmark = pytest.mark.anyio


def _chunk(delta: dict, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


GOOD_STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"content": "THOUGHT: look\n\n```bash\nls\n"}),
    _chunk({"content": "```"}),
    _chunk({}, "stop"),
    "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 7, "prompt_tokens": 3}}) + "\n\n",
    "data: [DONE]\n\n",
]


def _app(handler) -> Starlette:
    return Starlette(routes=[Route("/v1/chat/completions", handler, methods=["POST"])])


def _sse(parts: list[str]) -> StreamingResponse:
    async def gen():
        for p in parts:
            yield p

    return StreamingResponse(gen(), media_type="text/event-stream")


async def test_decodes_reproduce_a_bundled_trace_with_its_usage(trace_server, bundled_traces) -> None:
    trace = bundled_traces[1]
    async with OpenAIChatActor(trace_server.base_url, "m") as actor:
        assert isinstance(actor, Actor)
        for k, step in enumerate(trace.steps):
            history = trace.history(k)
            assert await actor.decode(history) == step.action
            reply = actor.reply_for(history)
            assert reply.text == reply_text(step)
            assert reply.output_tokens == step.output_tokens and not reply.tokens_estimated
            assert reply.finish_reason == "stop" and reply.first_token_ns is not None
            assert reply.latency_ns >= reply.first_token_ns
        # Earlier assistant turns are the memoised reply texts.
        messages = actor.messages_for(trace.history(3))
        assert [m["content"] for m in messages if m["role"] == "assistant"] == [
            actor.reply_for(trace.history(k)).text for k in range(3)
        ]
        assert actor.stats.requests == actor.stats.replies == len(trace.steps)
        assert actor.stats.output_tokens == sum(s.output_tokens for s in trace.steps)


async def test_the_memo_answers_a_history_decoded_before(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]
    async with OpenAIChatActor(trace_server.base_url, "m") as actor:
        h = trace.history(2)
        first = await actor.decode(h)
        again = await actor.decode(History(h.task, h.turns))
        assert first == again == trace.steps[2].action
        assert actor.stats.requests == 1 and actor.stats.memo_hits == 1
        assert actor.reply_for(trace.history(1)) is None


async def test_concurrent_decodes_of_different_histories(trace_server, bundled_traces) -> None:
    trace = bundled_traces[2]
    got: dict[int, Action] = {}
    async with OpenAIChatActor(trace_server.base_url, "m") as actor:

        async def one(k: int) -> None:
            got[k] = await actor.decode(trace.history(k))

        async with anyio.create_task_group() as tg:
            for k in range(len(trace.steps)):
                tg.start_soon(one, k)
    assert got == {k: s.action for k, s in enumerate(trace.steps)}


async def test_concurrent_decodes_of_one_history_agree(serve_app) -> None:
    # A server that answers differently each time: both decodes must still agree.
    count = 0

    async def handler(request: Request) -> StreamingResponse:
        nonlocal count
        count += 1
        await anyio.sleep(0.05 * count)
        return _sse([_chunk({"content": f"```bash\necho {count}\n```"}), _chunk({}, "stop"), "data: [DONE]\n\n"])

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", backoff_s=0) as actor:
        h = History("task")
        out: list[Action] = []
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: _append(out, actor.decode(h)))
        assert out[0] == out[1] == actor.reply_for(h).action
        assert actor.stats.duplicate_replies == 1


async def _append(out: list, coro) -> None:
    out.append(await coro)


async def test_cancelling_a_decode_closes_the_stream_on_the_server(serve_traces, bundled_traces) -> None:
    trace = bundled_traces[0]
    server = serve_traces([trace], tpot_ms=1e7)
    async with OpenAIChatActor(server.base_url, "m") as actor:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(actor.decode, trace.history(0))
                for _ in range(4000):
                    if server.stats.active:
                        break
                    await anyio.sleep(0.005)
                assert server.stats.active == 1
                scope.cancel()
        for _ in range(4000):
            if server.stats.disconnected:
                break
            await anyio.sleep(0.005)
        assert server.stats.disconnected == 1 and server.stats.active == 0
        assert actor.stats.cancelled_requests == 1 and actor.reply_for(trace.history(0)) is None


async def test_plain_requests_and_determinism_check(trace_server, bundled_traces) -> None:
    trace = bundled_traces[3]
    async with OpenAIChatActor(trace_server.base_url, "m", stream=False) as actor:
        assert await actor.decode(trace.history(1)) == trace.steps[1].action
        reply = actor.reply_for(trace.history(1))
        assert reply.first_token_ns is None and reply.output_tokens == trace.steps[1].output_tokens
        report = await actor.check_determinism(trace.history(1))
        assert report.identical and report.differs_at is None
        assert actor.stats.requests == 3 and actor.stats.replies == 1


async def test_determinism_check_sees_different_replies(serve_app) -> None:
    count = 0

    async def handler(request: Request) -> JSONResponse:
        nonlocal count
        count += 1
        text = f"```bash\necho {count}\n```"
        return JSONResponse({"choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop"}]})

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", stream=False) as actor:
        report = await actor.check_determinism(History("t"))
        assert not report.identical and report.differs_at == len("```bash\necho ")
        assert report.first.tokens_estimated  # no usage sent


async def test_tool_call_format_round_trip(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]
    fmt = ChatFormat(action_format="tools")
    async with OpenAIChatActor(trace_server.base_url, "m", chat_format=fmt) as a1:
        for k in range(3):
            assert await a1.decode(trace.history(k)) == trace.steps[k].action
        body = a1.request_body(trace.history(2))
    assert body["tools"][0]["function"]["name"] == "bash"
    assistant = [m for m in body["messages"] if m["role"] == "assistant"]
    tools = [m for m in body["messages"] if m["role"] == "tool"]
    assert [m["tool_calls"][0]["id"] for m in assistant] == ["call_0", "call_1"]
    assert [m["tool_call_id"] for m in tools] == ["call_0", "call_1"]
    assert [m["content"] for m in tools] == [s.observation for s in trace.steps[:2]]
    # A second run gives byte-identical requests (ids from the step index, not the server).
    async with OpenAIChatActor(trace_server.base_url, "m", chat_format=fmt) as a2:
        for k in range(2):
            await a2.decode(trace.history(k))
        assert json.dumps(a2.request_body(trace.history(2))) == json.dumps(body)


async def test_decode_under_trio(trace_server, bundled_traces) -> None:
    trace = bundled_traces[0]

    async def main() -> Action:
        async with OpenAIChatActor(trace_server.base_url, "m") as actor:
            return await actor.decode(trace.history(1))

    # The test itself runs on asyncio; run a trio loop in a worker thread.
    action = await anyio.to_thread.run_sync(lambda: anyio.run(main, backend="trio"))
    assert action == trace.steps[1].action


# -- faults ----------------------------------------------------------------------------------


async def test_a_500_then_success_is_retried(serve_app) -> None:
    count = 0

    async def handler(request: Request):
        nonlocal count
        count += 1
        if count == 1:
            return PlainTextResponse("overloaded", status_code=500)
        return _sse(GOOD_STREAM)

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", backoff_s=0) as actor:
        assert await actor.decode(History("t")) == Action.bash("ls")
        reply = actor.reply_for(History("t"))
        assert reply.output_tokens == 7 and not reply.tokens_estimated
        assert actor.stats.requests == 2 and actor.stats.retries == 1


async def test_a_500_always_is_one_clear_error(serve_app) -> None:
    count = 0

    async def handler(request: Request):
        nonlocal count
        count += 1
        return JSONResponse({"error": {"message": "the GPU caught fire"}}, status_code=503)

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", retries=2, backoff_s=0) as actor:
        with pytest.raises(ActorError) as err:
            await actor.decode(History("t"))
    msg = str(err.value)
    assert server.base_url in msg and "HTTP 503" in msg and "the GPU caught fire" in msg and "3 attempts" in msg
    assert err.value.status == 503 and count == 3


async def test_a_4xx_is_not_retried(serve_app) -> None:
    count = 0

    async def handler(request: Request):
        nonlocal count
        count += 1
        return JSONResponse({"error": {"message": "The model `nope` does not exist."}}, status_code=404)

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "nope", backoff_s=0) as actor:
        with pytest.raises(ActorError, match="HTTP 404: The model `nope` does not exist"):
            await actor.decode(History("t"))
        assert count == 1 and actor.stats.failed_requests == 1


async def test_a_stream_cut_midway_is_retried_then_an_error(serve_app) -> None:
    count = 0

    async def handler(request: Request):
        nonlocal count
        count += 1
        if count == 1 or request.query_params.get("always"):
            return _sse(GOOD_STREAM[:2])  # ends cleanly, but before finish_reason and [DONE]
        return _sse(GOOD_STREAM)

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", backoff_s=0) as actor:
        assert await actor.decode(History("t")) == Action.bash("ls")
        assert actor.stats.retries == 1
    url = server.base_url + "/chat/completions?always=1"
    async with OpenAIChatActor(url, "m", retries=1, backoff_s=0) as actor:
        with pytest.raises(ActorError, match="stream ended before the reply finished"):
            await actor.decode(History("t"))


async def test_a_connection_dropped_mid_body_is_an_error(serve_app) -> None:
    # A raw ASGI app that promises more body and then dies: the connection breaks.
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10000")]})
        await send(
            {"type": "http.response.body", "body": _chunk({"content": "```bash\nls"}).encode(), "more_body": True}
        )
        raise RuntimeError("the server died")

    server = serve_app(app)
    async with OpenAIChatActor(server.base_url, "m", retries=1, backoff_s=0) as actor:
        with pytest.raises(ActorError, match=r"connection broke|stream ended") as err:
            await actor.decode(History("t"))
        assert "2 attempts" in str(err.value)


async def test_an_error_in_the_stream_and_a_malformed_chunk(serve_app) -> None:
    async def handler(request: Request):
        if request.query_params.get("bad"):
            return _sse(["data: {not json\n\n"])
        return _sse([_chunk({"content": "x"}), 'data: {"error": {"message": "out of memory"}}\n\n'])

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", retries=0) as actor:
        with pytest.raises(ActorError, match="error mid-stream: out of memory"):
            await actor.decode(History("t"))
    async with OpenAIChatActor(server.base_url + "/chat/completions?bad=1", "m", retries=0) as actor:
        with pytest.raises(ActorError, match="malformed chunk"):
            await actor.decode(History("t"))


async def test_a_read_timeout_is_bounded(serve_app) -> None:
    async def handler(request: Request):
        if request.query_params.get("trickle"):

            async def gen():
                while True:  # a byte now and then, never finishing
                    yield ": keep-alive\n\n"
                    await anyio.sleep(0.05)

            return StreamingResponse(gen(), media_type="text/event-stream")
        await anyio.sleep(3600)
        return PlainTextResponse("never")

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", timeout_s=0.3, retries=1, backoff_s=0) as actor:
        with pytest.raises(ActorError, match=r"timed out after 0\.3 s"):
            await actor.decode(History("t"))
        assert actor.stats.requests == 2
    url = server.base_url + "/chat/completions?trickle=1"
    async with OpenAIChatActor(url, "m", timeout_s=0.3, retries=0) as actor:
        with pytest.raises(ActorError, match=r"timed out after 0\.3 s"):
            await actor.decode(History("t"))


async def test_nothing_listening_is_a_connection_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with OpenAIChatActor(f"http://127.0.0.1:{port}/v1", "m", retries=0) as actor:
        with pytest.raises(ActorError, match="cannot connect"):
            await actor.decode(History("t"))


def test_bad_configuration() -> None:
    from aospec.errors import ConfigError

    with pytest.raises(ConfigError):
        OpenAIChatActor("localhost:8000", "m")
    with pytest.raises(ConfigError, match="stream"):
        OpenAIChatActor("http://x/v1", "m", sampling={"stream": False})


async def test_a_shared_client_is_usable_after_a_cancelled_stream(serve_app) -> None:
    import httpx

    async def handler(request: Request):
        if request.query_params.get("slow"):

            async def forever():
                yield _chunk({"content": "```bash\n"})
                await anyio.sleep(3600)

            return StreamingResponse(forever(), media_type="text/event-stream")
        return _sse(GOOD_STREAM)

    server = serve_app(_app(handler))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
        slow = OpenAIChatActor(server.base_url + "/chat/completions?slow=1", "m", client=client)
        fast = OpenAIChatActor(server.base_url, "m", client=client)
        with anyio.move_on_after(0.2):
            await slow.decode(History("t"))
        assert slow.stats.cancelled_requests == 1
        # The one pooled connection was closed, not handed on half-read.
        assert await fast.decode(History("t")) == Action.bash("ls")
        await slow.aclose()  # a shared client stays open
        assert await fast.decode(History("u")) == Action.bash("ls")


async def test_a_server_that_ignores_stream_true_is_read_as_json(serve_app) -> None:
    async def handler(request: Request) -> JSONResponse:
        message = {"role": "assistant", "content": "```bash\npwd\n```"}
        usage = {"completion_tokens": 4, "prompt_tokens": 9}
        return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage})

    server = serve_app(_app(handler))
    async with OpenAIChatActor(server.base_url, "m", retries=0) as actor:
        assert await actor.decode(History("t")) == Action.bash("pwd")
        assert actor.reply_for(History("t")).output_tokens == 4
