"""``aospec serve-trace``: a recorded trajectory's replies over an OpenAI-compatible HTTP API,
streamed at a given time per output token.

The server answers ``POST /v1/chat/completions`` and ``POST /v1/responses`` (the Responses
API: the same replies as ``message`` and ``function_call`` output items, streamed as its
typed events; see aospec.live.responses) (streamed or not) and ``GET /v1/models``.
A request's conversation is the trace chosen by ``--trace-id`` (or the ``X-Trace-Id``
request header), else the only trace served, else the trace whose instruction (or task)
text appears in the request's first user message (the longest such, so one server serves
many conversations). Its reply is reply *i* of that trace, where *i* is the number of
assistant messages already in the request (for the Responses API, the number of replies
already in its ``input``: runs of assistant message, function_call and reasoning items;
the task text is then every user message's before the first reply): concurrent requests for different history
lengths (provisional branches) each get the right reply, and a repeated request gets the
same one. The reply text is the step's recorded ``reply`` when the trace has one that
parses back to its action, else the action as a ```` ```bash ```` block; with ``tools`` in the request the action also comes as
one tool call. The reply streams in chunks so that it takes about
``ttft + output_tokens * tpot``; usage (``completion_tokens`` = the step's recorded
``output_tokens``) comes in the final chunk when ``stream_options.include_usage`` is set,
and in every plain response. A client that disconnects stops its stream at once, however
long the tpot.

Programmatic use: :func:`serve_trace_app` builds the ASGI app; :func:`serve_trace` (async)
and :func:`serving` (plain) context managers run it on a free loopback port in a thread of
their own (any event loop, or none, in the caller) and yield a :class:`TraceServer`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from aospec.live.chat import ChatFormat, estimate_tokens
from aospec.live.responses import as_items, item_text, reply_count, task_text

from aospec._http import GuardMiddleware, HttpGuard, port_number, quiet_shutdown, resolve_token
from aospec.errors import ConfigError
from aospec.types import Step, Trace, canonical_json

__all__ = [
    "ServeStats",
    "TraceServer",
    "register",
    "reply_text",
    "serve_trace",
    "serve_trace_app",
    "serving",
]

_FORMAT = ChatFormat()
#: The largest request body (``--max-body-mb``).
MAX_BODY_BYTES = 32 << 20


def reply_text(step: Step) -> str:
    """What serve-trace answers for ``step``: the recorded reply when the default
    :class:`ChatFormat` parses it back to the recorded action, else the action as a
    ```` ```bash ```` block (a reply with nested code fences, say, whose recorder parsed it
    differently), so a client always decodes the recorded action."""
    if step.reply is not None and _FORMAT.parse(step.reply) == step.action:
        return step.reply
    return _FORMAT.render_action(step.action)


@dataclass
class ServeStats:
    """What a serve-trace app has seen. ``log`` holds ``(trace_id, index, outcome)`` per
    request, outcome ``"done"``, ``"disconnected"`` (the client went away mid-reply) or an
    HTTP status for errors."""

    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: int = 0
    active: int = 0
    log: list[tuple[str | None, int | None, str]] = field(default_factory=list)


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status_code=status)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def _bounds(tokens: int, per_chunk: int) -> list[int]:
    """Token counts at which chunks end: 1, then every ``per_chunk``, then ``tokens``."""
    return sorted({1, *range(1 + per_chunk, tokens, per_chunk), tokens})


async def _race_disconnect(receive: Callable[[], Awaitable[Any]], work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` until it ends or the client disconnects; True when it disconnected."""
    gone = False
    async with anyio.create_task_group() as tg:

        async def listen() -> None:
            nonlocal gone
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone = True
                    tg.cancel_scope.cancel()
                    return

        async def run() -> None:
            try:
                await work()
            except OSError:  # the transport closed under a send
                nonlocal gone
                gone = True
            tg.cancel_scope.cancel()

        tg.start_soon(listen)
        tg.start_soon(run)
    return gone


@dataclass
class _Reply:
    """The ASGI response of one chat-completions reply: timed, and stopped when the client
    leaves. :class:`_ResponsesReply` renders the same reply as a Responses API one."""

    stats: ServeStats
    ttft_s: float
    tpot_s: float
    per_chunk: int
    tid: str
    index: int
    rid: str
    name: str
    text: str
    tokens: int
    calls: list[dict[str, Any]]
    finish: str
    usage: dict[str, int]
    stream: bool
    include_usage: bool

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": self.name,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        return b"data: " + canonical_json(obj).encode() + b"\n\n"

    def whole(self) -> bytes:
        """The plain (non-streamed) response body."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        obj = {
            "id": self.rid,
            "object": "chat.completion",
            "created": 0,
            "model": self.name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish}],
            "usage": self.usage,
        }
        return canonical_json(obj).encode()

    def head(self) -> bytes:
        """The stream's first frames, before any text."""
        return self.chunk({"role": "assistant", "content": ""})

    def delta(self, piece: str) -> bytes:
        return self.chunk({"content": piece})

    def tail(self) -> bytes:
        """The stream's last frames, after the text."""
        tail = b""
        if self.calls:
            tail += self.chunk({"tool_calls": self.calls})
        tail += self.chunk({}, self.finish)
        if self.include_usage:
            obj = {"id": self.rid, "object": "chat.completion.chunk", "created": 0, "model": self.name,
                   "choices": [], "usage": self.usage}  # fmt: skip
            tail += b"data: " + canonical_json(obj).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        start = time.monotonic()
        self.stats.active += 1

        async def plain() -> None:
            await anyio.sleep(self.ttft_s + self.tokens * self.tpot_s)
            data = self.whole()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": data})

        async def streamed() -> None:
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": self.head(), "more_body": True})
            # The first token alone (a true time to first token), then per_chunk at a time.
            bounds = _bounds(self.tokens, self.per_chunk)
            n = len(self.text)
            for k, done_tokens in enumerate(bounds):
                piece = self.text[n * (bounds[k - 1] if k else 0) // self.tokens : n * done_tokens // self.tokens]
                await anyio.sleep(max(0.0, start + self.ttft_s + done_tokens * self.tpot_s - time.monotonic()))
                if piece:
                    await send({"type": "http.response.body", "body": self.delta(piece), "more_body": True})
            await send({"type": "http.response.body", "body": self.tail()})

        try:
            gone = await _race_disconnect(receive, streamed if self.stream else plain)
        finally:
            self.stats.active -= 1
        if gone:
            self.stats.disconnected += 1
            self.stats.log.append((self.tid, self.index, "disconnected"))
        else:
            self.stats.completed += 1
            self.stats.log.append((self.tid, self.index, "done"))


@dataclass
class _ResponsesReply(_Reply):
    """The same reply as a Responses API response (``POST /v1/responses``): an assistant
    ``message`` item with the text (none when a tool call comes with an empty text), then
    a ``function_call`` item per tool call; streamed as the API's typed events
    (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
    ``response.function_call_arguments.delta``, ``response.output_item.done``,
    ``response.completed``, ...)."""

    seq: int = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + canonical_json(obj).encode() + b"\n\n"

    @property
    def _msg_id(self) -> str:
        return f"msg_{self.tid[:24]}_{self.index}"

    def _items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.text or not self.calls:
            items.append(self._message(self.text, "completed"))
        for i, c in enumerate(self.calls):
            items.append(self._call(i, c, c["function"]["arguments"], "completed"))
        return items

    def _message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": self._msg_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def _call(self, i: int, call: dict[str, Any], arguments: str, status: str) -> dict[str, Any]:
        return {"id": f"fc_{self.tid[:24]}_{self.index}_{i}", "type": "function_call", "status": status,
                "call_id": call["id"], "name": call["function"]["name"], "arguments": arguments}  # fmt: skip

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.rid, "object": "response", "created_at": 0, "status": status, "model": self.name,
                "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                "error": None, "incomplete_details": None, "usage": usage}  # fmt: skip

    def _usage(self) -> dict[str, Any]:
        p, t = self.usage["prompt_tokens"], self.usage["completion_tokens"]
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": t,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + t}  # fmt: skip

    def whole(self) -> bytes:
        return canonical_json(self._response("completed", self._items(), self._usage())).encode()

    @property
    def _streams_text(self) -> bool:
        return bool(self.text) or not self.calls

    def head(self) -> bytes:
        self.seq = 0
        out = self._event("response.created", response=self._response("in_progress", [], None))
        out += self._event("response.in_progress", response=self._response("in_progress", [], None))
        if self._streams_text:
            out += self._event("response.output_item.added", output_index=0, item=self._message(None, "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added", item_id=self._msg_id, output_index=0, content_index=0, part=part
            )
        return out

    def delta(self, piece: str) -> bytes:
        return self._event(
            "response.output_text.delta", item_id=self._msg_id, output_index=0, content_index=0, delta=piece,
            logprobs=[],
        )  # fmt: skip

    def tail(self) -> bytes:
        out = b""
        index = 0
        if self._streams_text:
            done = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out += self._event("response.output_text.done", item_id=self._msg_id, output_index=0, content_index=0,
                               text=self.text, logprobs=[])  # fmt: skip
            out += self._event("response.content_part.done", item_id=self._msg_id, output_index=0, content_index=0,
                               part=done)  # fmt: skip
            out += self._event("response.output_item.done", output_index=0, item=self._message(self.text, "completed"))
            index = 1
        for i, c in enumerate(self.calls):
            item = self._call(i, c, c["function"]["arguments"], "completed")
            out += self._event("response.output_item.added", output_index=index + i,
                               item=self._call(i, c, "", "in_progress"))  # fmt: skip
            out += self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index + i,
                               delta=item["arguments"])  # fmt: skip
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index + i,
                               name=item["name"], arguments=item["arguments"])  # fmt: skip
            out += self._event("response.output_item.done", output_index=index + i, item=item)
        return out + self._event(
            "response.completed", response=self._response("completed", self._items(), self._usage())
        )


def _request_problem(body: Any) -> str | None:
    """What makes a chat request unservable, as one line; None when nothing does."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return "the body must be a JSON object with a 'messages' list"
    for key, kind, name in (("stream", bool, "true or false"), ("stream_options", dict, "an object")):
        if body.get(key) is not None and not isinstance(body[key], kind):
            return f"{key!r} must be {name}, got {_json_type(body[key])}"
    return None


def _responses_problem(body: Any) -> str | None:
    """What makes a Responses request unservable, as one line; None when nothing does."""
    if not isinstance(body, dict) or as_items(body.get("input")) is None:
        return "the body must be a JSON object with an 'input' string or list"
    if body.get("previous_response_id") is not None:
        return "'previous_response_id' is not served (serve-trace keeps no responses): send the whole input"
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        return f"'stream' must be true or false, got {_json_type(body['stream'])}"
    return None


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def serve_trace_app(
    traces: Sequence[Trace],
    tpot_ms: float,
    *,
    ttft_ms: float = 0.0,
    trace_id: str | None = None,
    model: str = "serve-trace",
    chunk_ms: float = 5.0,
    guard: HttpGuard | None = None,
) -> Any:
    """The ASGI app (starlette) that serves ``traces``; ``app.state.stats`` is its
    :class:`ServeStats`. ``chunk_ms`` groups tokens so a chunk spans at least that long
    (one token per chunk when tpot >= chunk_ms). ``guard`` checks every request first
    (:mod:`aospec._http`; default: a loopback server's Host/Origin checks and
    :data:`MAX_BODY_BYTES`, no token)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.routing import Route

    if tpot_ms < 0 or ttft_ms < 0 or chunk_ms <= 0 or not math.isfinite(tpot_ms + ttft_ms + chunk_ms):
        raise ConfigError("serve-trace: tpot_ms and ttft_ms must be finite and >= 0, chunk_ms > 0")
    traces = list(traces)
    if not traces:
        raise ConfigError("serve-trace: no traces to serve")
    by_id = {t.id: t for t in traces}
    if trace_id is not None and trace_id not in by_id:
        raise ConfigError(f"serve-trace: no trace {trace_id!r} (have {', '.join(sorted(by_id)[:10])})")
    stats = ServeStats()
    tpot_s, ttft_s = tpot_ms / 1000, ttft_ms / 1000
    per_chunk = max(1, math.ceil(chunk_ms / tpot_ms)) if tpot_ms > 0 else 1 << 30

    def pick(first_user: str, header: str | None) -> Trace | None:
        wanted = header or trace_id
        if wanted is not None:
            return by_id.get(wanted)
        if len(traces) == 1:
            return traces[0]
        best: Trace | None = None
        best_len = -1
        for t in traces:
            for text in (t.instruction, t.task):
                if text and text in first_user and len(text) > best_len:
                    best, best_len = t, len(text)
        return best

    async def models(request: Request) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(
            {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "aospec"}]}
        )

    async def completions(request: Request) -> Any:
        return await answer(request, responses=False)

    async def responses(request: Request) -> Any:
        return await answer(request, responses=True)

    async def answer(request: Request, responses: bool) -> Any:
        stats.requests += 1
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            body = None
        problem = _responses_problem(body) if responses else _request_problem(body)
        if problem is not None:
            stats.errors += 1
            stats.log.append((None, None, "400"))
            return _error(400, f"serve-trace: {problem}")
        if responses:
            items = [i for i in as_items(body["input"]) or () if isinstance(i, Mapping)]
            first_user, index = task_text(items), reply_count(items)
            texts = [t for t in map(item_text, items) if t is not None]
        else:
            messages = [m for m in body["messages"] if isinstance(m, Mapping)]
            first_user = next((_text_of(m.get("content")) for m in messages if m.get("role") == "user"), "")
            index = sum(1 for m in messages if m.get("role") == "assistant")
            texts = [_text_of(m.get("content")) for m in messages]
        trace = pick(first_user, request.headers.get("x-trace-id"))
        if trace is None:
            stats.errors += 1
            stats.log.append((None, None, "404"))
            return _error(
                404,
                "serve-trace: no served trace matches this conversation (its first user message holds no served "
                "task text; name one with the X-Trace-Id header or --trace-id)",
                code="trace_not_found",
            )
        if index >= len(trace.steps):
            stats.errors += 1
            stats.log.append((trace.id, index, "400"))
            return _error(
                400,
                f"serve-trace: trace {trace.id!r} has {len(trace.steps)} replies; this request asks for reply "
                f"{index + 1} (it holds {index} {'replies' if responses else 'assistant messages'})",
                code="trace_exhausted",
            )
        step = trace.steps[index]
        text = reply_text(step)
        tokens = max(1, step.output_tokens)
        tools = bool(body.get("tools")) and not step.action.is_none
        calls = (
            [
                {
                    "index": 0,
                    "id": f"call_{trace.id[:24]}_{index}",
                    "type": "function",
                    "function": {"name": step.action.tool, "arguments": canonical_json(step.action.to_json()["args"])},
                }
            ]
            if tools
            else []
        )
        finish = "tool_calls" if calls else "stop"
        prompt_tokens = estimate_tokens("".join(texts))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
        rid = f"{'resp' if responses else 'chatcmpl'}-{trace.id[:32]}-{index}"
        name = body.get("model") if isinstance(body.get("model"), str) else model
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        kind = _ResponsesReply if responses else _Reply
        return kind(
            stats,
            ttft_s,
            tpot_s,
            per_chunk,
            trace.id,
            index,
            rid,
            name,
            text,
            tokens,
            calls,
            finish,
            usage,
            stream,
            include_usage,
        )

    async def not_found(request: Request, exc: Exception) -> Any:
        return _error(404, f"serve-trace: no route {request.method} {request.url.path}", code="not_found")

    guard = guard if guard is not None else HttpGuard.for_bind("127.0.0.1", None, MAX_BODY_BYTES)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/chat/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/responses", responses, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
        ],
        middleware=[Middleware(GuardMiddleware, guard=guard)],
    )
    app.add_exception_handler(404, not_found)
    app.state.stats = stats
    app.state.traces = tuple(traces)
    return app


@dataclass
class TraceServer:
    """A server running in a thread: ``base_url`` is the API root (``http://host:port/v1``)."""

    host: str
    port: int
    app: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def stats(self) -> ServeStats | None:
        return getattr(self.app.state, "stats", None) if hasattr(self.app, "state") else None


def _bind(host: str, port: int, prog: str = "serve-trace") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:  # OverflowError: a port over 65535
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"{prog}: cannot listen on {host}:{port}: {reason}") from None
    sock.listen(512)
    sock.setblocking(False)
    return sock


def _uvicorn_server(app: Any, lifespan: str = "off", **kw: Any) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan=lifespan, timeout_graceful_shutdown=1, **kw
    )
    return uvicorn.Server(config)


@contextmanager
def serving(
    app: Any, *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0
) -> Iterator[TraceServer]:
    """Run any ASGI ``app`` with uvicorn in a thread (its own event loop) on ``host:port``
    (0: a free port) until the block ends. The app's lifespan runs when it has one (the
    proxy keeps its speculation there)."""
    sock = _bind(host, port)
    server = _uvicorn_server(app, lifespan="auto")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as exc:  # reported to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"serve-{sock.getsockname()[1]}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        if not server.started:
            server.should_exit = True
            thread.join(5)
            raise ConfigError(f"serve-trace: the server did not start: {failure[0] if failure else 'timed out'}")
        yield TraceServer(host, sock.getsockname()[1], app)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@asynccontextmanager
async def serve_trace(
    traces: Sequence[Trace],
    tpot_ms: float,
    *,
    ttft_ms: float = 0.0,
    trace_id: str | None = None,
    model: str = "serve-trace",
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[TraceServer]:
    """Serve ``traces`` on a free loopback port for the duration of the block (works under
    asyncio and trio: the server runs in its own thread)."""
    app = serve_trace_app(traces, tpot_ms, ttft_ms=ttft_ms, trace_id=trace_id, model=model)
    cm = serving(app, host=host, port=port)
    server = await anyio.to_thread.run_sync(cm.__enter__)
    try:
        yield server
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(cm.__exit__, None, None, None)


# -- the verb --------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve-trace",
        help="serve a recorded trajectory's replies as an OpenAI-compatible chat endpoint at a given TPOT",
        description="Serve recorded replies over POST /v1/chat/completions and POST /v1/responses (streamed or "
        "not) and GET /v1/models: reply i of the matching trace for a request holding i replies, streamed so that it takes "
        "about ttft + output_tokens * tpot. Stops on Ctrl-C or SIGTERM. "
        "Example: aospec serve-trace --bundled --tpot-ms 20 --port 8000",
    )
    p.add_argument("trace", nargs="*", help="trace files or directories (any format aospec reads)")
    p.add_argument("--bundled", action="store_true", help="serve the bundled tb1 sample")
    p.add_argument("--tpot-ms", type=float, required=True, help="milliseconds per output token")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="milliseconds before the first token (default 0)")
    p.add_argument("--trace-id", default=None, help="serve this trace to every conversation")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; any other than a loopback one needs --token-file or "
        "AOSPEC_TOKEN)",
    )
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--model", default="serve-trace", help="the model name /v1/models lists (default serve-trace)")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="a bearer token every request must carry (the client's API key; default: $AOSPEC_TOKEN, else none "
        "on a loopback address)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_BYTES / (1 << 20),
        metavar="MB",
        help=f"the largest request body (default {MAX_BODY_BYTES >> 20})",
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from aospec.replay import bundled_traces_path, load_traces

    paths = list(args.trace) + ([str(bundled_traces_path())] if args.bundled else [])
    if not paths:
        raise ConfigError("serve-trace: give TRACE paths or --bundled")
    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise ConfigError("serve-trace: --max-body-mb must be a finite number > 0")
    # it serves recorded replies and runs nothing: a token is optional on loopback
    token, _ = resolve_token("serve-trace", args.host, args.token_file, required=False)
    traces = load_traces(paths)
    guard = HttpGuard.for_bind(args.host, token, int(args.max_body_mb * (1 << 20)))
    app = serve_trace_app(
        traces, args.tpot_ms, ttft_ms=args.ttft_ms, trace_id=args.trace_id, model=args.model, guard=guard
    )
    sock = _bind(args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"serving {len(traces)} trace(s) at http://{host}:{sock.getsockname()[1]}/v1 "
        f"(tpot {args.tpot_ms:g} ms, ttft {args.ttft_ms:g} ms); Ctrl-C stops",
        flush=True,
    )
    server = _uvicorn_server(app)
    quiet_shutdown()
    # uvicorn stops on SIGINT/SIGTERM (and SIGHUP, which aospec.signals makes a SIGINT) and
    # then raises the signal again for the handler it found: with these, that second raise
    # is a no-op and the command exits 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("serve-trace: stopped", file=sys.stderr, flush=True)
    return 0
