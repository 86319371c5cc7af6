"""``aospec proxy``: an OpenAI-compatible reverse proxy that speculates tool observations
across the HTTP boundary (issue 12, section 2). See docs/integrations.md.

A harness changes only its base URL (``http://127.0.0.1:PORT/v1``). Every request goes to
``--upstream`` (an API root such as ``http://host:8000/v1``; the request path's leading
``/v1`` is replaced by it) with its body bytes unchanged, and the upstream's status, headers
(less hop-by-hop ones, ``date`` and ``server``) and body bytes (plain or SSE, chunk by
chunk) come back unchanged. A client that disconnects closes its upstream request at once.
Chat completions are asked for uncompressed (``accept-encoding: identity``: the proxy reads
them); other requests carry the client's ``accept-encoding`` (identity when it sent none).
Upstream failures without a response (refused, reset, timed out) are a 502 naming the
upstream, OpenAI-shaped.

Speculation (``POST .../chat/completions``; ``POST .../responses``, the Responses API,
likewise on its ``input`` items, see :func:`speculable_response` and docs/integrations.md):

- A request is *speculable* when its body is a JSON object without duplicate keys whose
  fields are all in :data:`KNOWN_FIELDS`, sampling is deterministic (``temperature`` 0, or
  an integer ``seed``), ``n`` is absent or 1, and ``messages`` is a list of objects.
  Anything else is pure pass-through.
- After a speculable request's reply (status 200) the proxy predicts the harness's next
  request: the same body with ``messages`` + the assistant reply *as this harness appends
  it* + a drafted observation message *in this harness's format*. Both are learned from
  the harness's own requests (the first request that extends an earlier one shows how it
  appends a reply and how it words an observation); until then nothing is speculated.
  Drafts come from aospec observation drafters (default: the ``aospec`` replay policy's
  ``patterns`` + ``cache``) on the conversation's History; the best ``max_speculative``
  (K) are issued upstream at once, with the earlier request's headers.
- A request is answered from a speculative request when both are equal: the canonical
  JSON of the bodies (objects compared regardless of key order; values never normalised:
  ``0`` and ``0.0``, ``"a"`` and ``"\\u0061"`` differ only as JSON text, so they compare
  as parsed) and the forwarded headers (less the SDK's per-attempt ones, see
  :data:`VOLATILE_HEADERS`). Chunks already received are replayed at once, the rest
  streamed as they arrive; a speculative request that failed or answered non-200 is never
  served (the request goes upstream live). All other speculative requests from the same
  parent are closed upstream when the real request arrives.

Action speculation (``--mcp URL``, see ``integrations/_proxy_actions.py``): while any chat
completion's 200 reply goes to the harness, the proxy reads it too, and as soon as an
action the harness executes through the ``aospec mcp --http`` server at URL is complete in
the stream (a sandbox-tool call, named ``PREFIX + tool`` with ``--mcp-tool-prefix PREFIX``
as opencode names an MCP server's tools; a ``--command-tool`` call; a ```` ```bash ````
block), it asks that server to start the call in a fork (``POST /aospec/prefetch``). The
harness's own call is answered from the fork only when the server's JASV accepts it.

Concurrency: a live request's upstream request runs in that request's task group; every
speculation (speculative requests, action watchers, prefetches) in the task group of the
app's ASGI lifespan, so nothing outlives the app (without a lifespan: pass-through only).

Programmatic use: :func:`proxy_app` builds the ASGI app (``app.stats`` is its
:class:`ProxyStats`, also served at ``GET /aospec/stats``); run it with any ASGI server
(``aospec.live.serve_trace.serving(app)`` in tests).

Metrics: ``GET /metrics`` (behind the same guard) is the Prometheus scrape of ``app.metrics``
(:mod:`aospec.metrics`, which reads :meth:`SpeculatingProxy.statistics` at each scrape),
or a 501 naming the install when ``prometheus_client`` is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from aospec.integrations._proxy_actions import Prefetcher, map_call, watch
from aospec.live.chat import ChatFormat
from aospec.live.responses import call_of, is_reply_item, item_text, replies, task_text

from aospec._http import (
    TOKEN_HEADER,
    UPSTREAM_TOKEN_ENV,
    HttpGuard,
    error_response,
    guarded,
    port_number,
    quiet_shutdown,
    resolve_token,
    token_of,
)
from aospec.errors import ConfigError, MissingDependencyError
from aospec.ledger import EngineStatistics
from aospec.metrics import Metrics, metrics_route
from aospec.protocols import ObservationDrafter
from aospec.types import History, Turn, canonical_json, version_hash

if TYPE_CHECKING:
    from aospec.host import SpeculationBudget, SpeculationLease

__all__ = [
    "KNOWN_FIELDS",
    "RESPONSES_FIELDS",
    "VOLATILE_HEADERS",
    "ProxyStats",
    "SpeculatingProxy",
    "proxy_app",
    "register",
]

#: Request fields the proxy understands; a request with any other field is pass-through.
KNOWN_FIELDS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "temperature", "seed", "top_p", "n", "max_tokens",
        "max_completion_tokens", "stop", "tools", "tool_choice", "parallel_tool_calls", "frequency_penalty",
        "presence_penalty", "response_format", "logprobs", "top_logprobs", "user", "logit_bias",
    }
)  # fmt: skip

#: Request headers never forwarded (hop-by-hop, or recomputed).
_DROP_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "proxy-connection", "proxy-authorization", TOKEN_HEADER}
)  # fmt: skip
#: A chat request nested deeper than this is pass-through: the proxy's own processing of a
#: speculable request recurses over it (an iterative check, so any depth is safe to forward).
MAX_SPECULABLE_DEPTH = 64
#: The largest request body (``--max-body-mb``): a long conversation, images included.
MAX_BODY_BYTES = 32 << 20
#: the largest upstream response the proxy holds (it keeps each one to serve it again, or to
#: answer from a speculation): a larger one ends as an upstream error, never an unbounded buffer
MAX_RESPONSE_BYTES = 64 << 20
#: Response headers never forwarded (hop-by-hop, or the proxy's server sets its own).
_DROP_RESPONSE = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server"})
#: Headers that differ between attempts of the same request (the openai SDK's retry
#: counter and timeouts); ignored when a request is matched to a speculative one.
VOLATILE_HEADERS = frozenset(
    {"x-stainless-retry-count", "x-stainless-read-timeout", "x-stainless-timeout", "accept-encoding"}
)

#: Responses API request fields the proxy understands (``previous_response_id``,
#: ``conversation``, ``background``, ``prompt`` name state kept upstream: pass-through).
RESPONSES_FIELDS = frozenset(
    {
        "model", "input", "instructions", "stream", "stream_options", "temperature", "seed", "top_p",
        "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls", "store", "include", "reasoning", "text",
        "truncation", "user", "metadata", "max_tool_calls", "top_logprobs", "prompt_cache_key", "safety_identifier",
        "service_tier",
    }
)  # fmt: skip

_CHAT_PATHS = ("/chat/completions",)
_RESPONSES_PATHS = ("/responses",)


@dataclass
class ProxyStats:
    """What the proxy has done. ``hits`` counts requests answered from a speculative
    request (``midstream_hits`` those whose speculative reply was still streaming);
    ``speculated`` the speculative upstream requests issued, ``cancelled`` those closed
    unused, ``wasted`` those that finished unused. ``hidden_s``: upstream time of the hits'
    speculative requests before their real request arrived (generation the harness did not
    wait for); ``wasted_s``: upstream time of the cancelled and wasted ones.
    ``upstream_errors``: upstream requests that failed without a whole response (a 502, a
    cut stream); ``error_replies``: upstream responses with an error status (relayed as
    they are); ``refused``: requests the proxy refused itself (its guard's 401, 403, 413 and
    421, a request target it does not forward); ``budget_refused``: speculative requests
    not issued because every slot of the host's speculation budget was held."""

    requests: int = 0
    chat_requests: int = 0
    passthrough: int = 0
    speculable: int = 0
    speculated: int = 0
    hits: int = 0
    midstream_hits: int = 0
    misses: int = 0
    cancelled: int = 0
    wasted: int = 0
    upstream_errors: int = 0
    error_replies: int = 0
    refused: int = 0
    budget_refused: int = 0
    disconnects: int = 0
    learned: bool = False
    drafter_errors: int = 0
    drafting_s: float = 0.0
    waited_s: float = 0.0
    hidden_s: float = 0.0
    wasted_s: float = 0.0
    actions_prefetched: int = 0
    prefetch_refused: int = 0
    prefetch_errors: int = 0
    calls_predicted: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# -- JSON helpers ------------------------------------------------------------------------------


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _strict_json(data: bytes) -> Any:
    """The JSON value of ``data``; ValueError on bad JSON, duplicate keys, NaN, or nesting
    deeper than the parser's recursion allows."""

    def bad_constant(name: str) -> Any:
        raise ValueError(f"non-finite number {name}")

    try:
        return json.loads(data, object_pairs_hook=_no_dupes, parse_constant=bad_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iteratively: any depth is safe)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _msg_digest(prev: str, message: Any) -> str:
    return version_hash(prev, canonical_json(message))


def _digests(messages: Sequence[Any], kind: str = "messages") -> list[str]:
    """The digest of every prefix of ``messages`` (index L: the first L messages)."""
    d = version_hash(kind)
    out = [d]
    for m in messages:
        d = _msg_digest(d, m)
        out.append(d)
    return out


def speculable(body: Any) -> bool:
    """Whether a chat request may be answered from a speculative one (module doc)."""
    if not isinstance(body, dict) or not set(body) <= KNOWN_FIELDS or _depth(body) > MAX_SPECULABLE_DEPTH:
        return False
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        return False
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        return False
    return _deterministic(body)


def speculable_response(body: Any) -> bool:
    """Whether a Responses API request may be answered from a speculative one: the chat
    rules (known fields, deterministic sampling) on ``input`` (a list of objects), and
    ``store`` false (a speculative request must not leave a stored response upstream; the
    API's default is true)."""
    if not isinstance(body, dict) or not set(body) <= RESPONSES_FIELDS or _depth(body) > MAX_SPECULABLE_DEPTH:
        return False
    items = body.get("input")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        return False
    return body.get("store") is False and _deterministic(body)


def _deterministic(body: dict[str, Any]) -> bool:
    t, seed = body.get("temperature"), body.get("seed")
    zero_t = isinstance(t, (int, float)) and not isinstance(t, bool) and t == 0
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    return zero_t or seeded


# -- reply reconstruction ----------------------------------------------------------------------


def reply_message(body: bytes, stream: bool) -> dict[str, Any] | None:
    """The assistant message of a complete 200 reply (plain JSON or SSE), None when it is
    not exactly one choice."""
    try:
        if not stream:
            obj = json.loads(body)
            if _depth(obj) > MAX_SPECULABLE_DEPTH:
                return None
            choices = obj.get("choices")
            if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0].get("message"), dict):
                return None
            return dict(choices[0]["message"])
        role: str | None = None
        content: str | None = None
        refusal: str | None = None
        calls: dict[int, dict[str, Any]] = {}
        done = False
        for line in body.decode("utf-8").splitlines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if _depth(obj) > MAX_SPECULABLE_DEPTH:
                return None
            for choice in obj.get("choices") or ():
                if choice.get("index", 0) != 0:
                    return None
                delta = choice.get("delta") or {}
                role = delta.get("role") or role
                if isinstance(delta.get("content"), str):
                    content = (content or "") + delta["content"]
                if isinstance(delta.get("refusal"), str):
                    refusal = (refusal or "") + delta["refusal"]
                for tc in delta.get("tool_calls") or ():
                    slot = calls.setdefault(int(tc.get("index", 0)), {"function": {"name": "", "arguments": ""}})
                    if tc.get("id"):
                        slot["id"] = tc["id"]
                    if tc.get("type"):
                        slot["type"] = tc["type"]
                    fn = tc.get("function") or {}
                    if fn.get("name"):
                        slot["function"]["name"] += fn["name"]
                    if fn.get("arguments"):
                        slot["function"]["arguments"] += fn["arguments"]
        if not done:
            return None
        msg: dict[str, Any] = {"role": role or "assistant", "content": content}
        if refusal is not None:
            msg["refusal"] = refusal
        if calls:
            msg["tool_calls"] = [
                {"id": c.get("id"), "type": c.get("type", "function"), "function": c["function"]}
                for _, c in sorted(calls.items())
            ]
        return msg
    except (ValueError, AttributeError, TypeError, UnicodeDecodeError, RecursionError):
        return None


def response_output(body: bytes, stream: bool) -> list[dict[str, Any]] | None:
    """The output items of a complete 200 Responses API reply (plain JSON, or the
    ``response.completed`` event of a stream), None when it did not complete."""
    try:
        if stream:
            obj = None
            for line in body.decode("utf-8").splitlines():
                if line.startswith("data:") and '"response.completed"' in line:
                    event = json.loads(line[5:])
                    if isinstance(event, dict) and event.get("type") == "response.completed":
                        obj = event.get("response")
        else:
            obj = json.loads(body)
        if not isinstance(obj, dict) or obj.get("status") != "completed" or _depth(obj) > MAX_SPECULABLE_DEPTH:
            return None
        output = obj.get("output")
        if not isinstance(output, list) or not output or not all(isinstance(i, dict) for i in output):
            return None
        return output
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _stream_ended(chunks: Sequence[bytes]) -> bool:
    """Whether a stream's last event ends a whole reply: ``[DONE]`` (chat completions) or
    ``response.completed`` (the Responses API)."""
    if b"".join(chunks[-2:]).rstrip().endswith(b"[DONE]"):
        return True
    whole = b"".join(chunks).rstrip()
    last = whole[whole.rfind(b"data:") + 5 :] if b"data:" in whole else b""
    try:
        event = json.loads(last)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(event, dict) and event.get("type") == "response.completed"


# -- learned message shapes --------------------------------------------------------------------

_COPY = ("copy",)


def learn_shape(reply: Any, appended: Any) -> Any:
    """A shape that turns ``reply`` into ``appended``: ``("copy",)``, ``("const", v)``,
    ``("dict", {key: shape})`` (exactly those keys, each from the reply's same key or a
    constant) or ``("list", shape)`` (every element alike)."""
    if reply == appended and type(reply) is type(appended):
        return _COPY
    if isinstance(reply, dict) and isinstance(appended, dict):
        return ("dict", {k: learn_shape(reply[k], v) if k in reply else ("const", v) for k, v in appended.items()})
    if isinstance(reply, list) and isinstance(appended, list) and reply and len(reply) == len(appended):
        shapes = [learn_shape(r, a) for r, a in zip(reply, appended, strict=True)]
        if all(s == shapes[0] for s in shapes):
            return ("list", shapes[0])
    return ("const", appended)


def apply_shape(shape: Any, reply: Any) -> Any:
    kind = shape[0]
    if kind == "copy":
        return reply
    if kind == "const":
        return shape[1]
    if kind == "dict":
        if not isinstance(reply, dict):
            raise ValueError("shape wants an object")
        return {k: apply_shape(s, reply[k]) if s[0] != "const" else s[1] for k, s in shape[1].items()}
    if not isinstance(reply, list):
        raise ValueError("shape wants a list")
    return [apply_shape(shape[1], r) for r in reply]


@dataclass(frozen=True)
class ObservationShape:
    """How this harness words an observation: one message (or Responses item) whose
    ``text_key`` (``content``; ``output`` for a ``function_call_output``) is ``prefix +
    observation + suffix``; ``slots`` maps other keys to ``"call_id"`` or ``"tool_name"``
    (filled from the reply's tool call), the rest constants."""

    constants: Mapping[str, Any]
    slots: Mapping[str, str]
    key_order: tuple[str, ...]
    text_key: str = "content"

    def render(self, content: str, call: Mapping[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self.key_order:
            if k == self.text_key:
                out[k] = content
            elif k in self.slots:
                if call is None:
                    raise ValueError("no tool call")
                out[k] = call.get("id") if self.slots[k] == "call_id" else (call.get("function") or {}).get("name")
            else:
                out[k] = self.constants[k]
        return out


def _learn_observation(
    message: dict[str, Any], call: Mapping[str, Any] | None, text_key: str = "content"
) -> ObservationShape | None:
    if not isinstance(message.get(text_key), str):
        return None
    constants: dict[str, Any] = {}
    slots: dict[str, str] = {}
    for k, v in message.items():
        if k == text_key:
            continue
        if call is not None and v == call.get("id"):
            slots[k] = "call_id"
        elif call is not None and v == (call.get("function") or {}).get("name"):
            slots[k] = "tool_name"
        else:
            constants[k] = v
    return ObservationShape(constants, slots, tuple(message), text_key)


def _wrapper(contents: Sequence[str]) -> tuple[str, str]:
    """The prefix and suffix every observation message shares (the harness's template
    around the tool output), cut back to a line or tag boundary; empty below two."""
    if len(contents) < 2:
        return "", ""
    first = contents[0]
    p = len(first)
    s = len(first)
    for c in contents[1:]:
        p = min(p, next((i for i, (a, b) in enumerate(zip(first, c, strict=False)) if a != b), min(len(first), len(c))))
        s = min(
            s,
            next(
                (i for i, (a, b) in enumerate(zip(reversed(first), reversed(c), strict=False)) if a != b),
                min(len(first), len(c)),
            ),
        )
    shortest = min(len(c) for c in contents)
    s = min(s, shortest - p)
    prefix, suffix = first[:p], first[len(first) - s :] if s else ""
    cut = prefix.rfind("\n") if "\n" in prefix else prefix.rfind(">")
    prefix = prefix[: cut + 1] if cut >= 0 else ""
    start = suffix.find("\n") if "\n" in suffix else suffix.find("<")
    suffix = suffix[start:] if start >= 0 else ""
    return prefix, suffix


def _wrapped(draft: str, prefix: str, suffix: str) -> list[str]:
    """``draft`` in the template ``prefix``/``suffix``: whole, and overlapping where the
    draft already begins with the template's end or ends with its start (a learned
    template can take in a part every observation shares)."""
    out = [prefix + draft + suffix]
    k = next(k for k in range(len(prefix) + 1) if draft.startswith(prefix[k:]))
    j = next(j for j in range(len(suffix), -1, -1) if draft.endswith(suffix[:j]))
    out.append(prefix[:k] + draft + suffix[j:])
    return [w for i, w in enumerate(out) if w != draft and w not in out[:i]]


# -- upstream requests -------------------------------------------------------------------------


class _Closed(Exception):
    """An upstream request the proxy closed before it ended (a speculation no longer
    wanted, a client gone, the proxy stopping)."""


class _TooLarge(Exception):
    """An upstream response past :data:`MAX_RESPONSE_BYTES` (``max_response_bytes``)."""


class _Upstream:
    """One upstream request being received: status, headers and raw chunks, readable from
    the start by any number of consumers while it runs. :meth:`run` runs it in whichever
    task group owns it (the request's, or the proxy's for a speculation); :meth:`cancel`
    closes it alone."""

    def __init__(
        self, method: str, url: Any, headers: list[tuple[str, str]], body: bytes, *, limit: int = MAX_RESPONSE_BYTES
    ) -> None:
        self.request = (method, url, headers, body)
        self.limit = limit
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.done = False
        self.error: BaseException | None = None
        self.started_at: float | None = None  # time.perf_counter() when it went upstream
        self.ended_at: float | None = None
        self._scope = anyio.CancelScope()
        self._changed = anyio.Event()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def run(self, client: Any) -> None:
        method, url, headers, body = self.request
        ended = False
        self.started_at = time.perf_counter()
        try:
            with self._scope:
                try:
                    async with client.stream(method, url, headers=headers, content=body) as resp:
                        self.headers = [
                            (k.lower().encode("latin-1"), v.encode("latin-1"))
                            for k, v in resp.headers.multi_items()
                            if k.lower() not in _DROP_RESPONSE
                        ]
                        self.status = resp.status_code
                        self._pulse()
                        size = 0
                        async for chunk in resp.aiter_raw():
                            size += len(chunk)
                            if size > self.limit:
                                raise _TooLarge(
                                    f"the upstream response is larger than {self.limit} bytes (the proxy's limit)"
                                )
                            self.chunks.append(chunk)
                            self._pulse()
                    ended = True
                except Exception as exc:  # transport failures: reported to the consumer
                    self.error = exc
        finally:
            if not ended and self.error is None:
                self.error = _Closed("closed by the proxy")
            self.ended_at = time.perf_counter()
            self.done = True
            self._pulse()

    async def started(self) -> None:
        while self.status is None and not self.done:
            await self._changed.wait()

    async def wait_done(self) -> None:
        while not self.done:
            await self._changed.wait()

    async def body(self) -> Any:
        """Yield chunks from the first as they arrive."""
        i = 0
        while True:
            ev = self._changed
            while i < len(self.chunks):
                yield self.chunks[i]
                i += 1
            if self.done:
                return
            await ev.wait()

    @property
    def in_flight(self) -> bool:
        return not self.done

    def ran_s(self, until: float | None = None) -> float:
        """Seconds this request ran upstream: from its start to its end (now, while in
        flight), or to ``until`` when earlier; 0 before it started."""
        if self.started_at is None:
            return 0.0
        end = self.ended_at if self.ended_at is not None else time.perf_counter()
        return max(0.0, (end if until is None else min(end, until)) - self.started_at)

    def cancel(self) -> None:
        """Close this request (before it starts, too)."""
        self._scope.cancel()


@dataclass
class _Speculation:
    key: str
    parent: str
    upstream: _Upstream
    wrapped: bool = False


@dataclass
class _Served:
    """A speculable request the proxy answered, and its reply."""

    body: dict[str, Any]
    headers: list[tuple[str, str]]
    reply: dict[str, Any]


@dataclass
class _Format:
    """How a harness appends a reply and words an observation: ``assistant`` is the shape
    of the appended assistant message (chat), or a shape per output item type (the
    Responses API)."""

    assistant: Any
    observation: ObservationShape
    tools: bool


def _error_body(status: int, message: str, code: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    data = json.dumps({"error": {"message": message, "type": "proxy_error", "param": None, "code": code}}).encode()
    return status, [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())], data


def _match_headers(headers: Sequence[tuple[str, str]]) -> str:
    return canonical_json(sorted([k.lower(), v] for k, v in headers if k.lower() not in VOLATILE_HEADERS))


def _list_field(body: Any, key: str) -> list[Any] | None:
    """``body[key]`` when ``body`` is an object and that field a list (a conversation), else None."""
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, list) else None


class _Chat:
    """Chat completions: the conversation is ``messages``; a reply is one assistant message,
    appended as one message and answered by one observation message."""

    name = "chat"
    endpoint = "chat/completions"  # the label of its requests in the metrics
    key = "messages"
    speculable = staticmethod(speculable)
    reply = staticmethod(reply_message)

    @staticmethod
    def conversation(body: Any) -> list[Any] | None:
        return _list_field(body, "messages")

    @staticmethod
    def parents(digests: list[str]) -> list[str]:
        """The prefixes whose reply this request may follow (its last two messages)."""
        return digests[-3:-2]

    @staticmethod
    def learn(reply: dict[str, Any], tail: list[Any]) -> _Format | None:
        calls = reply.get("tool_calls") or []
        if len(tail) != 2 or len(calls) > 1:
            return None
        appended, observation = tail
        assistant = learn_shape(reply, appended)
        try:
            ok = apply_shape(assistant, reply) == appended
        except (ValueError, KeyError):
            ok = False
        obs = _learn_observation(observation, calls[0] if calls else None) if isinstance(observation, dict) else None
        return _Format(assistant, obs, bool(calls)) if ok and obs is not None else None

    @staticmethod
    def calls(reply: dict[str, Any]) -> list[Any]:
        return reply.get("tool_calls") or []

    @staticmethod
    def text(reply: dict[str, Any]) -> str:
        return reply.get("content") if isinstance(reply.get("content"), str) else ""

    @staticmethod
    def appended(fmt: _Format, reply: dict[str, Any]) -> list[Any]:
        return [apply_shape(fmt.assistant, reply)]

    @staticmethod
    def turns(messages: list[Any]) -> list[tuple[str, list[Any], str]]:
        """``(text, tool calls, observation)`` of every reply already answered."""
        out = []
        for i, m in enumerate(messages[:-1]):
            obs = messages[i + 1].get("content") if isinstance(messages[i + 1], dict) else None
            if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(obs, str):
                text = m.get("content") if isinstance(m.get("content"), str) else ""
                out.append((text, list(m.get("tool_calls") or ()), obs))
        return out

    @staticmethod
    def task(messages: list[Any]) -> str | None:
        task = next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)
        return task if isinstance(task, str) else None


class _Responses:
    """The Responses API: the conversation is ``input``; a reply is its output items,
    appended item by item (each output item type in one learned shape) and answered by
    one item (a ``function_call_output``, or a user message)."""

    name = "responses"
    endpoint = "responses"
    key = "input"
    speculable = staticmethod(speculable_response)
    reply = staticmethod(response_output)

    @staticmethod
    def conversation(body: Any) -> list[Any] | None:
        return _list_field(body, "input")

    @staticmethod
    def parents(digests: list[str]) -> list[str]:
        """The prefixes whose reply this request may follow (a reply is any number of
        items): the nearest first."""
        return digests[-3::-1]

    @staticmethod
    def learn(reply: list[dict[str, Any]], tail: list[Any]) -> _Format | None:
        k = len(reply)
        if len(tail) != k + 1 or not isinstance(tail[k], dict):
            return None
        calls = [i for i in reply if i.get("type") == "function_call"]
        if len(calls) > 1:
            return None
        shapes: dict[Any, Any] = {}
        for item, appended in zip(reply, tail[:k], strict=True):
            shape = learn_shape(item, appended)
            if shapes.setdefault(item.get("type"), shape) != shape:
                return None
            try:
                if apply_shape(shape, item) != appended:
                    return None
            except (ValueError, KeyError):
                return None
        answer = tail[k]
        text_key = "output" if answer.get("type") == "function_call_output" else "content"
        obs = _learn_observation(answer, call_of(calls[0]) if calls else None, text_key)
        return _Format(shapes, obs, bool(calls)) if obs is not None else None

    @staticmethod
    def calls(reply: list[dict[str, Any]]) -> list[Any]:
        return [call_of(i) for i in reply if i.get("type") == "function_call"]

    @staticmethod
    def text(reply: list[dict[str, Any]]) -> str:
        return "".join(item_text(i) or "" for i in reply if i.get("type", "message") == "message")

    @staticmethod
    def appended(fmt: _Format, reply: list[dict[str, Any]]) -> list[Any]:
        return [apply_shape(fmt.assistant[i.get("type")], i) for i in reply]

    @staticmethod
    def turns(items: list[Any]) -> list[tuple[str, list[Any], str]]:
        out = []
        for run, answer in replies(items):
            obs = item_text(answer) if answer is not None and not is_reply_item(answer) else None
            if obs is not None:
                out.append((_Responses.text(run), _Responses.calls(run), obs))
        return out

    @staticmethod
    def task(items: list[Any]) -> str | None:
        return task_text(items) or None


_DIALECTS = {"chat": _Chat, "responses": _Responses}


class SpeculatingProxy:
    """The ASGI app (module doc). ``drafters`` are aospec observation drafters (None: none,
    pass-through only); at most ``max_speculative`` speculative requests are in flight.

    ``guard`` (:class:`aospec._http.HttpGuard`; default: a loopback server's Host/Origin
    checks and :data:`MAX_BODY_BYTES`, no token) checks every request first. A token the
    client sent for the proxy (``Authorization: Bearer`` or ``X-Aospec-Token``) is never
    forwarded; ``upstream_token`` (``$AOSPEC_UPSTREAM_TOKEN`` for ``aospec proxy``) goes
    upstream as ``Authorization: Bearer``. ``mcp_token`` is the ``--mcp`` server's token.

    ``metrics`` (:class:`aospec.metrics.Metrics`; default: one of its own, none without
    ``prometheus_client``) is served at ``GET /metrics``, behind the guard too; it watches
    :meth:`statistics`, the requests by endpoint and the errors by kind, and gets each
    model request's latency."""

    def __init__(
        self,
        upstream: str,
        *,
        drafters: Sequence[ObservationDrafter] | None = None,
        max_speculative: int = 2,
        timeout_s: float | None = None,
        client: Any = None,
        max_remembered: int = 1024,
        mcp: str | None = None,
        command_tools: Sequence[str] = (),
        mcp_tool_prefix: str = "",
        mcp_any_tool: bool = False,
        action_drafter: Any = None,
        predict_calls: int = 2,
        guard: HttpGuard | None = None,
        upstream_token: str | None = None,
        mcp_token: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        metrics: Metrics | None = None,
        budget: SpeculationBudget | None = None,
    ) -> None:
        import httpx

        if not upstream.startswith(("http://", "https://")):
            raise ConfigError(f"proxy: --upstream must be an http(s) URL, got {upstream!r}")
        if max_speculative < 0:
            raise ConfigError("proxy: max_speculative must be >= 0")
        try:
            base = httpx.URL(upstream.rstrip("/"))
        except httpx.InvalidURL as exc:
            raise ConfigError(f"proxy: --upstream {upstream!r} is not a valid URL: {exc}") from None
        if not base.host or base.query or base.fragment or base.userinfo:
            raise ConfigError(f"proxy: --upstream must be scheme://host[:port][/path], got {upstream!r}")
        self._base = base
        self._base_path = base.raw_path.rstrip(b"/")
        self.upstream = upstream.rstrip("/")
        self.guard = guard if guard is not None else HttpGuard.for_bind("127.0.0.1", None, MAX_BODY_BYTES)
        self.upstream_token = upstream_token
        self.drafters = tuple(drafters or ())
        self.max_speculative = max_speculative
        self.budget = budget
        """The host's speculation budget (``--speculation-budget``): each speculative upstream
        request holds one of its slots while in flight (what serving it costs a model server
        on this host), shared with every aospec session of the host; None: no budget."""
        if max_response_bytes < 1:
            raise ConfigError("proxy: max_response_bytes must be >= 1")
        self.max_response_bytes = max_response_bytes
        self.timeout_s = timeout_s
        self.stats = ProxyStats()
        # requests by endpoint, for the metrics (every label there from the first scrape)
        self._requests = dict.fromkeys((_Chat.endpoint, _Responses.endpoint, "aospec/stats", "other"), 0)
        self._client = client
        self._own_client = client is None
        self._served: OrderedDict[str, _Served] = OrderedDict()
        self._specs: dict[str, _Speculation] = {}
        self._formats: dict[str, _Format] = {}
        self._pending: dict[str, anyio.Event] = {}
        # the task group of the app's lifespan: every speculation (speculative upstream
        # requests, action watchers, prefetches) runs in it, so none outlives the app
        self._tg: Any = None
        # which drafts hit: once only verbatim ones have, wrapped ones are not sent
        self._hits_verbatim = 0
        self._hits_wrapped = 0
        self.max_remembered = max_remembered
        self.command_tools = tuple(command_tools)
        # how the harness names the --mcp server's tools (opencode: ``SERVER_tool``)
        self.mcp_tool_prefix = mcp_tool_prefix
        # the --mcp server is `aospec mcp --upstream`: any tool name is one of its tools
        self.mcp_any_tool = mcp_any_tool
        if predict_calls < 0:
            raise ConfigError("proxy: predict_calls must be >= 0")
        self.action_drafter = action_drafter
        """An aospec action drafter (``aospec.integrations._mcp_common.MergedDrafter`` of the
        ``aospec`` policy's, for ``aospec proxy --train-traces``): with ``--mcp``, when a request
        arrives its :attr:`predict_calls` likeliest next calls, drafted on the whole
        conversation, are prefetched while the model decodes (None: only the calls a reply
        holds are)."""
        self.predict_calls = predict_calls
        self._prefetcher: Prefetcher | None = None
        if mcp is not None:
            try:
                self._prefetcher = Prefetcher(mcp, self.stats, token=mcp_token)
            except ValueError as exc:
                raise ConfigError(f"proxy: {exc}") from None
        if metrics is None:
            try:
                metrics = Metrics()
            except MissingDependencyError:  # GET /metrics names the install
                metrics = None
        self.metrics = metrics
        if metrics is not None:
            metrics.watch(
                self.statistics,
                live_forks=self.live_speculations,
                requests=lambda: dict(self._requests),
                errors=lambda: {
                    "upstream": self.stats.upstream_errors,
                    "model": self.stats.error_replies,
                    "request": self.stats.refused,
                    "disconnect": self.stats.disconnects,
                },
            )
        self._guarded = guarded(metrics_route(self._serve, metrics), self.guard, refused=self._refused)

    # -- statistics ------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """:attr:`stats` in the engine's vocabulary, which :mod:`aospec.metrics` reads: a
        model request answered (chat completions, Responses) is a step; a speculative
        upstream request on a drafted observation a draft started, answering the real
        request a draft hit, cancelled or wasted a draft cancelled; the upstream time hits
        hid is decoding hidden, that of the others decoding wasted; a failed drafter or
        prefetch a speculative failure. Tool time and forks are 0 here: the harness runs its
        tools (with ``--mcp``, that server counts its forks in its own metrics)."""
        s = self.stats
        zero = dict.fromkeys((f.name for f in dataclasses.fields(EngineStatistics)), 0)
        return EngineStatistics(
            **{
                **zero,
                "steps": s.chat_requests,
                "drafts_started": s.speculated,
                "drafts_hit": s.hits,
                "drafts_cancelled": s.cancelled + s.wasted,
                "speculative_failures": s.drafter_errors + s.prefetch_errors,
                "decode_hidden_ns": round(s.hidden_s * 1e9),
                "wasted_decode_ns": round(s.wasted_s * 1e9),
            }
        )

    def live_speculations(self) -> int:
        """Speculative upstream requests in flight now."""
        return sum(1 for spec in self._specs.values() if spec.upstream.in_flight)

    def _refused(self, status: int) -> None:
        self.stats.refused += 1

    def _drop(self, spec: _Speculation) -> None:
        """Account for a speculative request no request will use (closing it if in flight)."""
        if spec.upstream.in_flight:
            spec.upstream.cancel()
            self.stats.cancelled += 1
        else:
            self.stats.wasted += 1
        self.stats.wasted_s += spec.upstream.ran_s()

    # -- plumbing --------------------------------------------------------------------------

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s, connect=10.0 if self.timeout_s is None else self.timeout_s),
                limits=limits,
                # no Nagle delay between a request's headers and body (separate writes)
                transport=httpx.AsyncHTTPTransport(
                    limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
                ),
            )
        return self._client

    async def aclose(self) -> None:
        """Close every speculative request and the upstream client (the lifespan's end
        does this)."""
        for spec in list(self._specs.values()):
            spec.upstream.cancel()
        self._specs.clear()
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    def _url(self, raw_path: bytes, query: bytes) -> Any:
        """The upstream URL of a request target: the upstream's scheme and host, its path
        joined with the target's path (less a leading ``/v1``), the target's query. Built
        from parts, never by concatenating the target onto the upstream (a target such as
        ``@host:port/x`` would otherwise name another host); ValueError for a target that is
        not a plain path (``*``, an absolute URL) or holds dot segments."""
        from urllib.parse import unquote_to_bytes

        if not raw_path.startswith(b"/") or raw_path.startswith(b"//"):
            raise ValueError("the request target must be a path starting with one /")
        segments = unquote_to_bytes(raw_path).split(b"/")
        if b".." in segments or b"." in segments:
            raise ValueError("the request path must not hold . or .. segments")
        rest = raw_path[3:] if raw_path == b"/v1" or raw_path.startswith(b"/v1/") else raw_path
        return self._base.copy_with(raw_path=self._base_path + rest + (b"?" + query if query else b""))

    def _speculate_soon(
        self, method: str, url: Any, headers: list[tuple[str, str]], body: bytes, lease: SpeculationLease | None = None
    ) -> _Upstream:
        """A speculative upstream request, started in the lifespan's task group (holding
        ``lease``, a slot of the host's budget, until it ends)."""
        up = _Upstream(method, url, headers, body, limit=self.max_response_bytes)

        async def run(client: Any) -> None:
            try:
                await up.run(client)
            finally:
                if lease is not None:
                    lease.release()

        self._tg.start_soon(run, self._http())
        return up

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self._guarded(scope, receive, send)

    async def _lifespan(self, receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if (await receive())["type"] != "lifespan.startup":
            return
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await send({"type": "lifespan.startup.complete"})
            while (await receive())["type"] != "lifespan.shutdown":
                pass
            # speculation is only a chance taken: stopping drops all of it at once
            self._tg = None
            tg.cancel_scope.cancel()
        await self.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _serve(self, scope: Any, receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        """One request that passed the guard (its whole body is the first message)."""
        if scope["type"] != "http":
            return
        self.stats.requests += 1
        method, path = scope["method"], scope["path"]
        dialect = _Chat if path.endswith(_CHAT_PATHS) else _Responses if path.endswith(_RESPONSES_PATHS) else None
        if method != "POST":
            dialect = None
        stats_route = method == "GET" and path == "/aospec/stats"
        self._requests[dialect.endpoint if dialect is not None else "aospec/stats" if stats_route else "other"] += 1
        msg = await receive()
        if msg["type"] != "http.request":
            return
        body = msg.get("body", b"")
        if method == "GET" and path == "/aospec/stats":
            data = json.dumps(self.stats.to_json()).encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": data})
            return
        try:
            url = self._url(scope.get("raw_path") or path.encode(), scope.get("query_string", b""))
        except ValueError as exc:
            self.stats.refused += 1
            await error_response(send, 400, f"aospec proxy: {exc}", "bad_target")
            return
        _, used = token_of(scope["headers"]) if self.guard.token is not None else (None, None)
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _DROP_REQUEST
            and not (used == "authorization" and k.lower() == b"authorization")  # the proxy's own token
        ]
        if self.upstream_token is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            headers.append(("authorization", f"Bearer {self.upstream_token}"))
        if dialect is not None:
            # replies the proxy reads: ask for them uncompressed
            headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"] + [("accept-encoding", "identity")]
            await self._conversation(dialect, url, headers, body, receive, send)
            return
        if not any(k.lower() == "accept-encoding" for k, _ in headers):
            headers.append(("accept-encoding", "identity"))  # not httpx's default: what the client accepts
        await self._relay(_Upstream(method, url, headers, body, limit=self.max_response_bytes), receive, send, run=True)

    async def _relay(self, up: _Upstream, receive: Any, send: Any, *, run: bool = False) -> bool:
        """Send ``up``'s response to the client (running ``up`` in this request's task group
        when ``run``; a speculation runs in the lifespan's); True when it went out whole
        (every byte of a 200 response sent; the client may hang up right after the last
        one, as SDKs do after ``[DONE]``, even before the upstream has closed its response:
        see :meth:`_ended_whole`). A client disconnect before that cancels ``up``."""
        async with anyio.create_task_group() as tg:
            if run:
                tg.start_soon(up.run, self._http())
            whole = await self._send(up, receive, send)
        return whole

    async def _send(self, up: _Upstream, receive: Any, send: Any) -> bool:
        result: bool | None = None
        cut = sent_all = False
        sent = 0

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async def relay() -> None:
            nonlocal result, cut, sent, sent_all
            try:
                await up.started()
                if up.status is None:
                    self.stats.upstream_errors += 1
                    status, hdrs, data = _error_body(
                        502, f"aospec proxy: upstream {self.upstream} failed: {up.error!r}", "upstream_unreachable"
                    )
                    await send({"type": "http.response.start", "status": status, "headers": hdrs})
                    await send({"type": "http.response.body", "body": data})
                    result = False
                else:
                    if up.status >= 400:
                        self.stats.error_replies += 1
                    await send({"type": "http.response.start", "status": up.status, "headers": up.headers})
                    async for chunk in up.body():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        sent += 1
                    if up.error is not None:
                        self.stats.upstream_errors += 1
                        cut = True
                    else:
                        sent_all = True
                        await send({"type": "http.response.body", "body": b""})
                        result = up.status == 200
            except OSError:  # the transport closed under a send: as a disconnect
                pass
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listen)
            tg.start_soon(relay)
        if cut:
            raise RuntimeError(f"upstream stream cut: {up.error!r}")  # the server aborts the response
        if result is not None:
            return result
        if sent_all:
            return up.status == 200
        if await self._ended_whole(up, sent):
            return True
        up.cancel()
        self.stats.disconnects += 1
        return False

    async def _ended_whole(self, up: _Upstream, sent: int) -> bool:
        """Whether a client that hung up had the whole 200 reply: every chunk received was
        sent, the stream's last event ended a reply (``[DONE]``, ``response.completed``:
        SDKs hang up right after it, maybe before the upstream closes its response) and the
        upstream then ends cleanly with nothing more."""
        if up.status != 200 or sent != len(up.chunks) or not _stream_ended(up.chunks):
            return False
        with anyio.move_on_after(5.0):
            await up.wait_done()
        return up.done and up.error is None and sent == len(up.chunks)

    # -- conversations (chat completions, Responses) ----------------------------------------

    async def _conversation(
        self, dialect: Any, url: Any, headers: list[tuple[str, str]], raw: bytes, receive: Any, send: Any
    ) -> None:
        self.stats.chat_requests += 1
        arrived = time.perf_counter()
        try:
            await self._converse(dialect, url, headers, raw, arrived, receive, send)
        finally:
            if self.metrics is not None:
                self.metrics.step(round((time.perf_counter() - arrived) * 1e9), None)

    async def _converse(
        self,
        dialect: Any,
        url: Any,
        headers: list[tuple[str, str]],
        raw: bytes,
        arrived: float,
        receive: Any,
        send: Any,
    ) -> None:
        try:
            body = _strict_json(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        conv = dialect.conversation(body)
        shallow = conv is not None and _depth(body) <= MAX_SPECULABLE_DEPTH
        digests = _digests(conv, dialect.key) if shallow else []  # type: ignore[arg-type]
        spec_ok = dialect.speculable(body)
        if not spec_ok:
            self.stats.passthrough += 1
            await self._answer(dialect, url, headers, raw, body, digests, False, arrived, receive, send)
            return
        self.stats.speculable += 1
        # the reply this request follows may still be drafting its speculations (they are
        # registered right after its last byte went out): wait for them
        parent = next((self._pending[d] for d in dialect.parents(digests) if d in self._pending), None)
        if parent is not None:
            t0 = time.perf_counter()
            await parent.wait()
            self.stats.waited_s += time.perf_counter() - t0
        mine = self._pending[digests[-1]] = anyio.Event()
        try:
            await self._answer(dialect, url, headers, raw, body, digests, True, arrived, receive, send)
        finally:
            mine.set()
            if self._pending.get(digests[-1]) is mine:
                del self._pending[digests[-1]]

    async def _answer(
        self,
        dialect: Any,
        url: Any,
        headers: list[tuple[str, str]],
        raw: bytes,
        body: Any,
        digests: list[str],
        spec_ok: bool,
        arrived: float,
        receive: Any,
        send: Any,
    ) -> None:
        hit = None
        if spec_ok:
            key = canonical_json(body) + _match_headers(headers)
            hit = self._specs.get(key)
            if hit is not None:
                await hit.upstream.started()
                if hit.upstream.status != 200:
                    hit = None
        # close every sibling speculation whose parent this request extends
        prefixes = set(digests[:-1])
        for k, spec in list(self._specs.items()):
            if spec.parent in prefixes and (hit is None or spec is not hit):
                del self._specs[k]
                self._drop(spec)
        if spec_ok:
            self._learn(dialect, body[dialect.key], digests)
        if hit is not None:
            self._specs.pop(hit.key, None)
            self.stats.hits += 1
            self.stats.hidden_s += hit.upstream.ran_s(until=arrived)
            if hit.wrapped:
                self._hits_wrapped += 1
            else:
                self._hits_verbatim += 1
            self.stats.midstream_hits += int(hit.upstream.in_flight)
            up = hit.upstream
        else:
            if spec_ok:
                self.stats.misses += 1
            up = _Upstream("POST", url, headers, raw, limit=self.max_response_bytes)
        stream = isinstance(body, dict) and bool(body.get("stream"))
        if self._prefetcher is not None and self._tg is not None:
            self._tg.start_soon(self._watch, dialect, up, stream)
            if digests and self.action_drafter is not None and self.predict_calls > 0:
                self._tg.start_soon(self._predict, dialect, body, up)
        whole = await self._relay(up, receive, send, run=hit is None)
        if whole and spec_ok:
            reply = dialect.reply(b"".join(up.chunks), stream)
            if reply is not None:
                self._remember(body, headers, digests[-1], reply)
                await self._speculate(dialect, url, body, headers, digests[-1], reply)

    async def _watch(self, dialect: Any, up: _Upstream, stream: bool) -> None:
        """Prefetch the actions of the reply ``up`` as they complete (module doc)."""
        prefetcher, client, tg = self._prefetcher, self._http(), self._tg
        assert prefetcher is not None
        try:
            await watch(
                up,
                stream,
                self.command_tools,
                lambda tool, args: prefetcher.emit(tg, client, tool, args),
                responses=dialect is _Responses,
                tool_prefix=self.mcp_tool_prefix,
                any_tool=self.mcp_any_tool,
            )
        except Exception:  # a watcher's failure is only a missed chance
            self.stats.prefetch_errors += 1

    async def _predict(self, dialect: Any, body: dict[str, Any], up: _Upstream) -> None:
        """Prefetch the :attr:`predict_calls` calls the action drafter expects next, drafted
        on the request's whole conversation (the task and the user's words included, which
        the MCP server never sees), while the model decodes its reply. Drafting starts a few
        milliseconds after the request went upstream, so that it does not hold it up."""
        while up.started_at is None and not up.done:
            await anyio.sleep(0.001)
        await anyio.sleep(0.002)  # the request's bytes go out first
        try:
            calls = await self._predicted_calls(dialect, body)
        except Exception:  # a drafter's failure loses only its guesses, never the proxy
            self.stats.drafter_errors += 1
            return
        prefetcher, tg, client = self._prefetcher, self._tg, self._http()
        assert prefetcher is not None
        for call in calls:
            self.stats.calls_predicted += 1
            prefetcher.emit(tg, client, *call)

    async def _predicted_calls(self, dialect: Any, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """The MCP calls :meth:`_predict` prefetches, likeliest first."""
        assert self.action_drafter is not None
        fmt = self._formats.get(dialect.name)
        tools = fmt.tools if fmt is not None else bool(body.get("tools"))
        history = self._history(dialect, body[dialect.key], tools)
        if history is None:
            return []
        t0 = time.perf_counter()
        failed = getattr(self.action_drafter, "failures", 0)  # a MergedDrafter's, which it survives
        drafts = await self.action_drafter.propose(history, 4 * self.predict_calls, 1)
        self.stats.drafting_s += time.perf_counter() - t0
        self.stats.drafter_errors += getattr(self.action_drafter, "failures", 0) - failed
        calls: list[tuple[str, dict[str, Any]]] = []
        for d in drafts:
            if d.offset != 0 or d.action.is_none:
                continue
            args = json.dumps(d.action.to_json()["args"])
            call = map_call(d.action.tool, args, self.command_tools, self.mcp_tool_prefix, any_tool=self.mcp_any_tool)
            refused = self._prefetcher.refused_tools if self._prefetcher is not None else set()
            if call is not None and call not in calls and call[0] not in refused:  # not a slot lost
                calls.append(call)
            if len(calls) >= self.predict_calls:
                break
        return calls

    def _remember(
        self, body: dict[str, Any], headers: list[tuple[str, str]], digest: str, reply: dict[str, Any]
    ) -> None:
        self._served[digest] = _Served(body, headers, reply)
        self._served.move_to_end(digest)
        while len(self._served) > self.max_remembered:
            self._served.popitem(last=False)

    def _learn(self, dialect: Any, conv: list[Any], digests: list[str]) -> None:
        """Learn how the harness appends a reply and words an observation from a request
        that extends one the proxy answered (the nearest such)."""
        for n in range(len(conv) - 2, 0, -1):
            parent = self._served.get(digests[n])
            if parent is None:
                continue
            fmt = dialect.learn(parent.reply, conv[n:])
            if fmt is not None:
                self._formats[dialect.name] = fmt
                self.stats.learned = True
            return

    # -- speculation -----------------------------------------------------------------------

    def _history(self, dialect: Any, conv: list[Any], tools: bool) -> History | None:
        """The conversation as an aospec History: the task is the first user message, an
        observation the whole content of the message after an assistant reply (as in
        aospec's traces, where the observation is what the model saw)."""
        task = dialect.task(conv)
        if task is None:
            return None
        chat = ChatFormat(action_format="tools" if tools else "bash")
        return History(task, tuple(Turn(chat.parse(text, calls), obs) for text, calls, obs in dialect.turns(conv)))

    async def _speculate(
        self,
        dialect: Any,
        url: Any,
        body: dict[str, Any],
        headers: list[tuple[str, str]],
        parent: str,
        reply: Any,
    ) -> None:
        fmt = self._formats.get(dialect.name)
        if fmt is None or not self.drafters or self.max_speculative == 0 or self._tg is None:
            return
        calls = dialect.calls(reply)
        if len(calls) > 1 or bool(calls) != fmt.tools:
            return
        chat = ChatFormat(action_format="tools" if fmt.tools else "bash")
        action = chat.parse(dialect.text(reply), calls)
        try:
            appended = dialect.appended(fmt, reply)
        except (ValueError, KeyError):
            return
        conv = body[dialect.key]
        prefix, suffix = _wrapper([obs for _, _, obs in dialect.turns(conv)])
        history = self._history(dialect, conv, fmt.tools)
        if history is None:
            return
        best: dict[str, float] = {}
        if action.is_none:
            # a reply without an action: the harness answers it with its format-error
            # message, drafted as the one it sent the last time
            errors = [t.observation for t in history.turns if t.action.is_none]
            if errors:
                best[errors[-1]] = 1.0
        for drafter in () if action.is_none else self.drafters:
            try:
                t0 = time.perf_counter()
                drafts = await drafter.draft(history, action, self.max_speculative)
                self.stats.drafting_s += time.perf_counter() - t0
            except Exception:  # a drafter's failure loses only its drafts
                self.stats.drafter_errors += 1
                continue
            for d in drafts:
                if math.isfinite(d.probability):
                    best[d.text] = max(best.get(d.text, 0.0), d.probability)
        ranked = sorted(best.items(), key=lambda kv: -kv[1])
        match_headers = _match_headers(headers)
        # drafts verbatim first (drafters fit on traces draft what the model saw), then
        # wrapped in the learned template (drafters that draft raw tool output)
        contents = [draft for draft, _p in ranked]
        verbatim = len(contents)
        if (prefix or suffix) and not (self._hits_verbatim and not self._hits_wrapped):
            contents += [w for d in list(contents) for w in _wrapped(d, prefix, suffix) if w not in contents]
        for i, content in enumerate(contents):
            if sum(1 for s in self._specs.values() if s.upstream.in_flight) >= self.max_speculative:
                break
            try:
                obs_msg = fmt.observation.render(content, calls[0] if calls else None)
            except ValueError:
                return
            new_body = dict(body)
            new_body[dialect.key] = [*conv, *appended, obs_msg]
            key = canonical_json(new_body) + match_headers
            if key in self._specs:
                continue
            lease = None
            if self.budget is not None:
                lease = self.budget.try_acquire()
                if lease is None:  # every slot of the host's budget is held: no more guesses now
                    self.stats.budget_refused += 1
                    break
            data = json.dumps(new_body, ensure_ascii=False).encode()
            self._specs[key] = _Speculation(
                key, parent, self._speculate_soon("POST", url, headers, data, lease), i >= verbatim
            )
            self.stats.speculated += 1
        # speculations of conversations that went away: keep the newest max_remembered
        while len(self._specs) > self.max_remembered:
            self._drop(self._specs.pop(next(iter(self._specs))))


def proxy_app(upstream: str, **kw: Any) -> SpeculatingProxy:
    """The proxy's ASGI app (see :class:`SpeculatingProxy`)."""
    return SpeculatingProxy(upstream, **kw)


# -- the verb ----------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy",
        help="an OpenAI-compatible proxy that speculates tool observations (change only the harness's base URL)",
        description="Forward every request to --upstream unchanged; for deterministic chat completions (and "
        "Responses API requests), draft "
        "the harness's next request while it runs its tool and pre-issue it upstream, answering the real request "
        "from it when they are equal. Harness base URL: http://HOST:PORT/v1, its API key the proxy's token "
        "(printed at start, or --token-file / AOSPEC_TOKEN). Stats: GET /aospec/stats; Prometheus metrics: GET "
        "/metrics, behind the same token (needs prometheus_client: pip install 'aospec[metrics]'). "
        "Example: aospec proxy --upstream http://127.0.0.1:8000/v1 --port 8001",
    )
    p.add_argument("--upstream", required=True, help="the upstream API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; any other than a loopback one needs --token-file or "
        "AOSPEC_TOKEN)",
    )
    p.add_argument("--port", type=port_number, default=8001, help="port (default 8001; 0 picks a free one)")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="the bearer token every request must carry (the harness's API key; default: $AOSPEC_TOKEN, else a "
        "new one, printed at start); the upstream gets $AOSPEC_UPSTREAM_TOKEN instead, when set",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=MAX_BODY_BYTES / (1 << 20),
        metavar="MB",
        help=f"the largest request body (default {MAX_BODY_BYTES >> 20})",
    )
    p.add_argument(
        "--max-response-mb",
        type=float,
        default=MAX_RESPONSE_BYTES / (1 << 20),
        metavar="MB",
        help=f"the largest upstream response the proxy holds; a larger one ends as an error (default {MAX_RESPONSE_BYTES >> 20})",
    )
    p.add_argument("--max-speculative", type=int, default=2, help="speculative upstream requests in flight (default 2)")
    p.add_argument(
        "--speculation-budget",
        default=None,
        metavar="CORES[,MEMORY]",
        help="speculative upstream requests in flight on this host, in cores (and memory: 4G), shared by every "
        "aospec session of the host: each holds a slot; auto: one per two cores (default: none, or "
        "$AOSPEC_SPECULATION_BUDGET)",
    )
    p.add_argument(
        "--train-traces",
        dest="train",
        nargs="*",
        default=[],
        help="traces to fit the drafters on (any format aospec reads)",
    )
    from aospec.cli import add_alias

    add_alias(p, "--train", "--train-traces")
    p.add_argument("--bundled", action="store_true", help="fit the drafters on the bundled tb1 sample too")
    p.add_argument("--no-speculate", action="store_true", help="pure pass-through")
    p.add_argument(
        "--mcp",
        metavar="URL",
        help="the `aospec mcp --http` server (http://HOST:PORT/mcp) that executes the harness's tools: start each "
        "action in a fork there as soon as the reply holds it",
    )
    p.add_argument(
        "--mcp-token-file",
        metavar="FILE",
        help="the --mcp server's token (default: $AOSPEC_MCP_TOKEN, else $AOSPEC_TOKEN)",
    )
    p.add_argument(
        "--command-tool",
        action="append",
        default=[],
        metavar="NAME",
        help="a tool whose calls (argument `command`) the harness runs as the MCP server's bash; repeatable",
    )
    p.add_argument(
        "--mcp-tool-prefix",
        default="",
        metavar="PREFIX",
        help="the harness names the --mcp server's tools PREFIX+TOOL (PREFIX+bash, PREFIX+read_file, ...): only "
        "those are prefetched as that server's tools, a bare `bash` is not. opencode: its opencode.json `mcp` key "
        '(characters other than letters, digits, _ and - as _) and _, e.g. aospec_ for "mcp": {"aospec": ...} '
        "(default: none, the tools' own names)",
    )
    p.add_argument(
        "--mcp-any-tool",
        action="store_true",
        help="the --mcp server is `aospec mcp --upstream` (a speculating proxy of other MCP servers): every tool "
        "call (after --mcp-tool-prefix) is one of its tools, not only its sandbox tools; it starts only those its "
        "--trust file allows",
    )
    p.add_argument(
        "--predict-calls",
        type=int,
        default=2,
        metavar="K",
        help="with --mcp and --train-traces/--bundled: when a request arrives, prefetch the K calls the aospec policy's "
        "action drafters expect next from the whole conversation, while the model decodes (2; 0: only the calls "
        "a reply holds)",
    )
    p.set_defaults(func=_serve)


def action_drafter(train: Sequence[Any], policy: str = "aospec") -> Any:
    """The replay policy ``policy``'s action drafters (``aospec``: history, moves, calls,
    ranking by probabilities calibrated on ``train``), fitted on ``train``, as one drafter
    (most probable first; a failing one loses only its guesses)."""
    from aospec.integrations._mcp_common import MergedDrafter
    from aospec.live.agent import default_drafters as live_defaults

    return MergedDrafter(list(live_defaults(list(train), policy).action), who="aospec proxy")


def default_drafters(train: Sequence[Any] = ()) -> tuple[Any, ...]:
    """The ``aospec`` replay policy's observation drafters (patterns + cache), fitted on
    ``train``."""
    from aospec.live.agent import default_drafters as live_defaults

    return tuple(live_defaults(list(train)).observation)


def _probe(app: SpeculatingProxy) -> None:
    """Warn (not fail: it may start later) when the upstream does not answer now."""
    import httpx

    headers = {"Authorization": f"Bearer {app.upstream_token}"} if app.upstream_token else {}
    try:
        httpx.get(app._url(b"/models", b""), headers=headers, timeout=3.0)
    except httpx.HTTPError as exc:
        print(
            f"aospec proxy: warning: upstream {app.upstream} does not answer now ({type(exc).__name__}: {exc}); "
            "requests get a 502 until it does",
            file=sys.stderr,
            flush=True,
        )


def _mcp_token(args: argparse.Namespace) -> str | None:
    from aospec._http import read_token_file

    if args.mcp_token_file is not None:
        return read_token_file(args.mcp_token_file)
    return os.environ.get("AOSPEC_MCP_TOKEN", "").strip() or os.environ.get("AOSPEC_TOKEN", "").strip() or None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from aospec.live.serve_trace import _bind

    if not (math.isfinite(args.max_body_mb) and args.max_body_mb > 0):
        raise ConfigError("proxy: --max-body-mb must be a finite number > 0")
    if not (math.isfinite(args.max_response_mb) and args.max_response_mb * (1 << 20) >= 1):
        raise ConfigError("proxy: --max-response-mb must be a finite number > 0")
    if args.max_speculative < 0:
        raise ConfigError("proxy: --max-speculative must be >= 0")
    if args.predict_calls < 0:
        raise ConfigError("proxy: --predict-calls must be >= 0")
    token, generated = resolve_token("proxy", args.host, args.token_file)
    if args.mcp_tool_prefix and not args.mcp:
        raise ConfigError("proxy: --mcp-tool-prefix names the tools of the --mcp server: give --mcp URL too")
    if args.mcp_any_tool and not args.mcp:
        raise ConfigError("proxy: --mcp-any-tool describes the --mcp server: give --mcp URL too")
    mcp = None if args.no_speculate else args.mcp
    mcp_token = _mcp_token(args) if mcp else None
    if mcp and mcp_token is None:
        raise ConfigError(
            "proxy: --mcp needs that server's token: --mcp-token-file FILE or AOSPEC_MCP_TOKEN (or AOSPEC_TOKEN, "
            "when the proxy and the server share one)"
        )
    budget = None
    if not args.no_speculate:
        from aospec.host import host_budget

        # none by default: the proxy's guesses are requests to the upstream model, which
        # spends its CPU elsewhere ($AOSPEC_SPECULATION_BUDGET still applies)
        budget = host_budget(args.speculation_budget, default="none")
        for note in budget.notes if budget is not None else ():
            print(f"aospec proxy: note: {note}", file=sys.stderr)
    app = proxy_app(
        args.upstream,
        budget=budget,
        drafters=(),
        max_speculative=args.max_speculative,
        mcp=mcp,
        command_tools=args.command_tool,
        mcp_tool_prefix=args.mcp_tool_prefix,
        mcp_any_tool=args.mcp_any_tool,
        predict_calls=args.predict_calls,
        guard=HttpGuard.for_bind(args.host, token, int(args.max_body_mb * (1 << 20))),
        max_response_bytes=int(args.max_response_mb * (1 << 20)),
        upstream_token=os.environ.get(UPSTREAM_TOKEN_ENV, "").strip() or None,
        mcp_token=mcp_token,
    )
    train: list[Any] = []
    if args.train or args.bundled:
        from aospec.replay import bundled_traces_path, load_traces

        train = load_traces([*args.train, *([str(bundled_traces_path())] if args.bundled else [])])
    app.drafters = () if args.no_speculate else default_drafters(train)
    if mcp and train and args.predict_calls > 0:
        app.action_drafter = action_drafter(train)
    _probe(app)
    sock = _bind(args.host, args.port, "proxy")
    host = f"[{args.host}]" if ":" in args.host else args.host
    if generated:
        print(
            f"aospec proxy: token {token} (the harness's API key: it sends 'Authorization: Bearer {token}'; "
            "--token-file FILE or AOSPEC_TOKEN sets one)",
            flush=True,
        )
    print(f"aospec proxy at http://{host}:{sock.getsockname()[1]}/v1 -> {app.upstream}; Ctrl-C stops", flush=True)
    # uvicorn stops gracefully on SIGINT and SIGTERM (SIGHUP too: aospec.signals turns it into
    # SIGINT), waiting at most a second for requests in flight
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1)
    quiet_shutdown()
    try:
        anyio.run(partial(uvicorn.Server(config).serve, sockets=[sock]))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    print("aospec proxy: stopped", file=sys.stderr, flush=True)
    return 0
