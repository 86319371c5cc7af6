"""The actor on an OpenAI-compatible chat completions endpoint (vLLM, SGLang, llama.cpp,
hosted APIs, ``aospec serve-trace``).

:class:`OpenAIChatActor` implements :class:`aospec.protocols.Actor`. Each ``decode`` is one
streamed ``POST {base_url}/chat/completions`` (``stream: true`` with
``stream_options.include_usage``), so provisional branches are concurrent requests, and
cancelling the caller's scope closes the HTTP stream at once (the server sees the
disconnect and stops generating). Replies are memoised by history (:class:`~aospec.live.chat.ReplyMemo`):
a history decoded once is answered from the memo, and earlier assistant turns are rendered
from the memoised reply texts.

``decode_streaming(history, on_delta)`` is ``decode`` reporting the stream as it arrives
(:class:`aospec.protocols.StreamingActor`): each SSE content delta as a ``str``, each
tool-call delta as a chat-completions chunk dict. A retried request's new attempt is fed
only beyond what the failed attempt already fed, and not at all once it differs from it
(:class:`~aospec.live.chat.StreamFeed`); a memoised reply, or a server answering with one JSON
body, is fed whole at once.

Errors: HTTP 5xx, 408 and 429, connection errors, timeouts and a stream cut before it
finished are retried ``retries`` times with exponential backoff, then raise one
:class:`~aospec.live.chat.ActorError` naming the URL, status and an excerpt of the body; other
4xx (a bad model name or key) raise at once with the server's message. Every attempt is
bounded by ``timeout_s`` as a whole, not only between bytes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import anyio
import httpx
from aospec.live.chat import ActorError, ChatFormat, DeterminismReport, MemoActor, Reply, StreamFeed, estimate_tokens

from aospec.errors import ConfigError
from aospec.types import History

__all__ = ["ActorError", "DeterminismReport", "OpenAIChatActor", "Reply"]  # the last three re-exported

_EXCERPT = 500
_RETRY_STATUS = frozenset({408, 429})


class _Retryable(Exception):
    def __init__(self, error: ActorError) -> None:
        self.error = error
        super().__init__(str(error))


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


def _server_message(raw: str) -> str:
    """The ``error.message`` of an OpenAI-shaped error body, else the body itself."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return _excerpt(raw)
    if isinstance(obj, Mapping):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return _excerpt(err["message"])
        if isinstance(err, str):
            return _excerpt(err)
    return _excerpt(raw)


class OpenAIChatActor(MemoActor):
    """An actor on an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    ``base_url`` is the API root (``http://127.0.0.1:8000/v1``; a URL that already ends in
    ``/chat/completions`` is used as is). ``api_key`` defaults to ``$OPENAI_API_KEY`` (no
    Authorization header when neither is set). ``sampling`` is passed through into every
    request (``temperature``, ``seed``, ``max_tokens``, ``top_p``, ``stop``, ...; default
    ``{"temperature": 0}``). ``stream=False`` sends plain requests (no first-token time).
    ``backoff_s`` is the first retry's delay, doubled each retry. ``client`` is an
    ``httpx.AsyncClient`` to use (not closed by ``aclose``).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        chat_format: ChatFormat | None = None,
        sampling: Mapping[str, Any] | None = None,
        timeout_s: float = 600,
        retries: int = 2,
        client: httpx.AsyncClient | None = None,
        stream: bool = True,
        backoff_s: float = 0.5,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"actor base_url must be an http(s) URL, got {base_url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ConfigError("actor timeout_s must be > 0, retries and backoff_s >= 0")
        base = base_url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        super().__init__(chat_format)
        self.model = model
        self.sampling: dict[str, Any] = dict(sampling) if sampling is not None else {"temperature": 0}
        for reserved in ("model", "messages", "stream", "stream_options"):
            if reserved in self.sampling:
                raise ConfigError(f"actor sampling may not set {reserved!r}")
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.stream = stream
        self.backoff_s = backoff_s
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        )

    def request_body(self, history: History) -> dict[str, Any]:
        """The JSON body a decode of ``history`` sends."""
        return self._body(self.messages_for(history))

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    # -- requests --------------------------------------------------------------------------

    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        body.update(self.chat_format.tool_request_bodies())
        body.update(self.sampling)
        body["stream"] = self.stream
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _generate(self, messages: list[dict[str, Any]], feed: StreamFeed | None = None) -> Reply:
        body = self._body(messages)
        attempt = 0
        while True:
            self.stats.requests += 1
            if feed is not None:
                feed.attempt()
            try:
                return await self._attempt(body, feed)
            except _Retryable as exc:
                if attempt >= self.retries:
                    self.stats.failed_requests += 1
                    tries = f" (after {attempt + 1} attempts)" if attempt else ""
                    raise ActorError(
                        f"{exc.error}{tries}", url=exc.error.url, status=exc.error.status, body=exc.error.body
                    ) from None
                attempt += 1
                self.stats.retries += 1
                await anyio.sleep(self.backoff_s * 2 ** (attempt - 1))
            except ActorError:
                self.stats.failed_requests += 1
                raise
            except anyio.get_cancelled_exc_class():
                self.stats.cancelled_requests += 1
                raise

    async def _generate_streaming(self, messages: list[dict[str, Any]], feed: StreamFeed) -> Reply:
        return await self._generate(messages, feed)

    async def _attempt(self, body: dict[str, Any], feed: StreamFeed | None = None) -> Reply:
        start = time.monotonic_ns()
        with anyio.move_on_after(self.timeout_s):
            try:
                if self.stream:
                    return await self._streamed(body, start, feed)
                return await self._plain(body, start, feed)
            except httpx.TimeoutException as exc:
                raise _Retryable(
                    ActorError(f"{self.url}: timed out after {self.timeout_s:g} s ({type(exc).__name__})", url=self.url)
                ) from None
            except httpx.TransportError as exc:
                what = (
                    "the connection broke"
                    if isinstance(exc, (httpx.ReadError, httpx.RemoteProtocolError))
                    else "cannot connect"
                )
                raise _Retryable(
                    ActorError(f"{self.url}: {what}: {type(exc).__name__}: {exc or 'no detail'}", url=self.url)
                ) from None
        raise _Retryable(
            ActorError(f"{self.url}: timed out after {self.timeout_s:g} s (the reply did not finish)", url=self.url)
        )

    def _status_error(self, status: int, raw: str) -> Exception:
        err = ActorError(
            f"{self.url} answered HTTP {status}: {_server_message(raw)}",
            url=self.url,
            status=status,
            body=_excerpt(raw),
        )
        return _Retryable(err) if status >= 500 or status in _RETRY_STATUS else err

    async def _plain(self, body: dict[str, Any], start: int, feed: StreamFeed | None = None) -> Reply:
        resp = await self._client.post(self.url, json=body, headers=self._headers)
        if resp.status_code >= 400:
            raise self._status_error(resp.status_code, resp.text)
        return self._from_json(resp.text, start, feed)

    def _from_json(self, raw: str, start: int, feed: StreamFeed | None = None) -> Reply:
        try:
            obj = json.loads(raw)
            choice = obj["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ActorError(
                f"{self.url} answered with no choices[0].message: {_excerpt(raw)}",
                url=self.url,
                body=_excerpt(raw),
            ) from None
        text = message.get("content") or ""
        calls = tuple(message.get("tool_calls") or ())
        reply = self._reply(text, calls, choice.get("finish_reason"), obj.get("usage"), start, None)
        if feed is not None:
            feed.whole(reply)  # one body: the router reads it at once
        return reply

    async def _streamed(self, body: dict[str, Any], start: int, feed: StreamFeed | None = None) -> Reply:
        parts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish: str | None = None
        usage: Any = None
        first: int | None = None
        done = False
        async with self._client.stream("POST", self.url, json=body, headers=self._headers) as resp:
            if resp.status_code >= 400:
                raw = b""
                async for piece in resp.aiter_bytes():
                    raw += piece
                    if len(raw) > 8 * _EXCERPT:
                        break
                raise self._status_error(resp.status_code, raw.decode("utf-8", "replace"))
            if resp.headers.get("content-type", "").startswith("application/json"):
                # A server that ignores ``stream: true`` answers with one JSON body.
                return self._from_json((await resp.aread()).decode("utf-8", "replace"), start, feed)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # SSE comments, event names, blank separators
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise ActorError(f"{self.url} streamed a malformed chunk: {_excerpt(data)}", url=self.url) from None
                if not isinstance(chunk, Mapping):
                    continue
                if chunk.get("error") is not None:
                    raise _Retryable(
                        ActorError(
                            f"{self.url} reported an error mid-stream: {_server_message(data)}",
                            url=self.url,
                            body=_excerpt(data),
                        )
                    )
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    if content:
                        parts.append(content)
                        first = first if first is not None else time.monotonic_ns() - start
                        if feed is not None:
                            feed.content(content)
                    for tc in delta.get("tool_calls") or ():
                        first = first if first is not None else time.monotonic_ns() - start
                        if feed is not None and isinstance(tc, Mapping):
                            feed.tool_call(tc)
                        slot = calls.setdefault(
                            int(tc.get("index", 0)),
                            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                        )
                        if tc.get("id"):
                            slot["id"] = tc["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        if not done and finish is None:
            raise _Retryable(
                ActorError(
                    f"{self.url}: the stream ended before the reply finished (no finish_reason, no [DONE]) "
                    f"after {sum(map(len, parts))} characters",
                    url=self.url,
                )
            )
        return self._reply("".join(parts), tuple(calls[i] for i in sorted(calls)), finish, usage, start, first)

    def _reply(
        self,
        text: str,
        calls: tuple[Mapping[str, Any], ...],
        finish: str | None,
        usage: Any,
        start: int,
        first: int | None,
    ) -> Reply:
        tokens = usage.get("completion_tokens") if isinstance(usage, Mapping) else None
        estimated = not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0
        if estimated:
            tokens = estimate_tokens(text + "".join((c.get("function") or {}).get("arguments") or "" for c in calls))
        return Reply(
            text=text,
            action=self.chat_format.parse(text, calls),
            output_tokens=int(tokens),  # type: ignore[arg-type]
            tokens_estimated=estimated,
            latency_ns=time.monotonic_ns() - start,
            first_token_ns=first,
            tool_calls=calls,
            finish_reason=finish,
        )
