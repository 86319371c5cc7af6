"""What every aospec HTTP server checks before a request reaches it: a bearer token, the
Host and Origin headers, and the size of the body (``aospec mcp --http``, ``aospec proxy``,
``aospec serve-trace``; docs/integrations.md, "Authentication and limits").

:func:`guarded` wraps any ASGI app in an :class:`HttpGuard`:

1. **Host** (DNS rebinding): on a loopback bind the ``Host`` header must name a loopback
   address (``127.0.0.1``, ``localhost``, ``::1``) or the bound one (``127.0.0.2``, say);
   otherwise 421. Off loopback any Host passes (the token is then mandatory).
2. **Origin** (cross-site requests from a browser): absent, or its host one that Host may
   name (off loopback: the request's own Host); otherwise 403.
3. **Token**: ``Authorization: Bearer TOKEN`` (the openai SDK's ``api_key``, an MCP client's
   headers) or ``X-Aospec-Token: TOKEN`` (for a client whose ``Authorization`` belongs to
   the upstream); otherwise 401. Compared in constant time.
4. **Body**: a declared ``Content-Length`` over the limit is refused at once, a streamed
   body as soon as it passes it (counted while it is read, never held beyond the limit);
   413 naming the limit and the flag that raises it. The app then receives the whole body
   as one message.

Errors are JSON in the OpenAI shape (``{"error": {"message", "type", "code"}}``), one line
each. :func:`resolve_token` is the command-line side: the token from ``--token-file`` or
``AOSPEC_TOKEN``, a generated one on loopback, and the refusal of a non-loopback bind
without a given token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aospec.errors import ConfigError

__all__ = [
    "LOOPBACK_NAMES",
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "UPSTREAM_TOKEN_ENV",
    "BodyTooLarge",
    "GuardMiddleware",
    "HttpGuard",
    "error_response",
    "guarded",
    "is_loopback",
    "port_number",
    "quiet_shutdown",
    "read_body",
    "read_token_file",
    "resolve_token",
    "serve_asgi",
    "token_of",
]

#: The names a loopback server always answers to.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: The environment variable a server's token may come from.
TOKEN_ENV = "AOSPEC_TOKEN"
#: The token aospec sends to what it forwards to: ``aospec proxy``'s upstream model server
#: (``Authorization: Bearer``), ``aospec mcp --upstream URL``'s HTTP MCP servers.
UPSTREAM_TOKEN_ENV = "AOSPEC_UPSTREAM_TOKEN"
#: The header a client may send the token in instead of ``Authorization``.
TOKEN_HEADER = "x-aospec-token"

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind, or a Host name) is a loopback one."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def port_number(text: str) -> int:
    """argparse ``type=`` for a TCP port: 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0: any free one), got {port}")
    return port


def read_token_file(path: str) -> str:
    """The token a ``--token-file`` holds (one printable word); ConfigError naming the file."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ConfigError(f"--token-file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"--token-file {path}: not a regular file")
    if st.st_size > 4096:
        raise ConfigError(f"--token-file {path}: over 4096 bytes; a token file holds one token")
    token = p.read_text(errors="replace").strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"--token-file {path}: the file must hold one token (printable, no blanks)")
    return token


def resolve_token(
    prog: str, host: str, token_file: str | None, *, required: bool = True
) -> tuple[str | None, bool]:
    """``(token, generated)`` for a server ``prog`` binding ``host``: the token of
    ``token_file``, else of ``$AOSPEC_TOKEN``, else (``required`` and a loopback bind) a
    new random one. A non-loopback bind without a given token is a ConfigError; with
    ``required`` false, a loopback bind without one has none."""
    if token_file is not None:
        return read_token_file(token_file), False
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env, False
    if not is_loopback(host):
        raise ConfigError(
            f"{prog}: --host {host} is reachable from other machines: give it a token "
            f"(--token-file FILE or {TOKEN_ENV}), or bind 127.0.0.1"
        )
    if not required:
        return None, False
    return secrets.token_urlsafe(32), True


def token_of(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """``(token, header)``: the token a request carries and the header it came in
    (``authorization`` or :data:`TOKEN_HEADER`; the latter wins), or ``(None, None)``."""
    found: tuple[str | None, str | None] = (None, None)
    for k, v in headers:
        name = k.decode("latin-1").lower()
        if name == TOKEN_HEADER:
            return v.decode("latin-1").strip(), TOKEN_HEADER
        if name == "authorization" and found[0] is None:
            scheme, _, value = v.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                found = (value.strip(), "authorization")
    return found


def _host_of(value: str) -> str:
    """The host part of a Host header (``name``, ``name:port``, ``[v6]:port``), lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True, slots=True)
class HttpGuard:
    """The checks of :func:`guarded` (module doc). ``token``: required on every request
    (None: none); ``hosts``: the names Host may carry (None: any); ``max_body``: bytes;
    ``limit_flag``: the command-line flag that raises it, named in a 413."""

    token: str | None
    hosts: frozenset[str] | None
    max_body: int
    limit_flag: str = "--max-body-mb"

    @classmethod
    def for_bind(cls, host: str, token: str | None, max_body: int, limit_flag: str = "--max-body-mb") -> HttpGuard:
        """The guard of a server bound to ``host``: loopback names (and ``host``) on a
        loopback bind, any Host elsewhere."""
        hosts = LOOPBACK_NAMES | {host.strip("[]").lower()} if is_loopback(host) else None
        return cls(token, hosts, max_body, limit_flag)

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
        """``(status, message, code)`` when a request with ``headers`` must be refused
        before its body is read, else None."""
        host = origin = None
        for k, v in headers:
            name = k.lower()
            if name == b"host":
                host = v.decode("latin-1")
            elif name == b"origin":
                origin = v.decode("latin-1")
        host_name = _host_of(host) if host else ""
        if self.hosts is not None and host_name not in self.hosts:
            return 421, f"Host {host!r} is not this server's (a loopback server answers to {', '.join(sorted(self.hosts))})", "bad_host"  # fmt: skip
        if origin is not None:
            origin_host = (urlsplit(origin).hostname or "") if origin != "null" else ""
            allowed = self.hosts if self.hosts is not None else {host_name}
            if origin_host not in allowed:
                return 403, f"cross-origin requests are refused (Origin {origin!r})", "bad_origin"
        if self.token is not None:
            given, _ = token_of(headers)
            if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
                return (
                    401,
                    "this server needs its token: send 'Authorization: Bearer TOKEN' (an SDK's api_key) "
                    f"or '{TOKEN_HEADER}: TOKEN'",
                    "unauthorized",
                )
        return None


async def error_response(
    send: Send, status: int, message: str, code: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An OpenAI-shaped JSON error."""
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    data = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """:func:`guarded` as a Starlette ``Middleware`` class (the app keeps its ``state``)."""

    def __init__(self, app: Any, guard: HttpGuard) -> None:
        self._guarded = guarded(app, guard)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self._guarded(scope, receive, send)


def guarded(app: Any, guard: HttpGuard, *, refused: Callable[[int], None] | None = None) -> Any:
    """``app`` behind ``guard`` (module doc); ``refused(status)``, when given, is called for
    every request the guard refuses (a server's metrics count them)."""

    async def wrapped(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no aospec server speaks websocket
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        refusal = guard.refusal(scope["headers"])
        if refusal is not None:
            extra = [(b"www-authenticate", b"Bearer")] if refusal[0] == 401 else []
            if refused is not None:
                refused(refusal[0])
            await error_response(send, *refusal, extra)
            return
        too_big = (
            413,
            f"the request body is over this server's {guard.max_body}-byte limit ({guard.limit_flag} raises it)",
            "body_too_large",
        )
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > guard.max_body:
            if refused is not None:
                refused(413)
            await error_response(send, *too_big)
            return
        try:
            body = await read_body(receive, guard.max_body)
        except BodyTooLarge:
            if refused is not None:
                refused(413)
            await error_response(send, *too_big)
            return
        if body is None:
            return  # the client went away
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)

    return wrapped


class _ShutdownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled or "timeout graceful shutdown exceeded" in record.getMessage())


def quiet_shutdown() -> None:
    """Keep uvicorn from logging the requests a shutdown cancels (a signal stops a server
    with a reply still streaming: that is no error) as tracebacks on stderr."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _ShutdownNoise) for f in log.filters):
        log.addFilter(_ShutdownNoise())


class BodyTooLarge(Exception):
    """A request body passed the limit :func:`read_body` was given."""


async def read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The whole request body, or None when the client disconnected before sending it;
    BodyTooLarge as soon as it passes ``limit`` bytes (what was read is dropped)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


async def serve_asgi(
    app: Any,
    host: str,
    port: int,
    *,
    listening: Callable[[int], None] | None = None,
    around: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
) -> None:
    """Serve the ASGI ``app`` with uvicorn on ``host:port`` (0: any free port) in this
    event loop until cancelled; ``listening(port)`` is called once bound (ConfigError when
    the address cannot be bound). ``around()`` is entered around the serving (an app's
    lifespan, whose tasks then run here). Cancelling it takes no new connection or request,
    closes every connection and cancels the requests in flight."""
    import socket

    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # signals cancel the whole server (aospec.signals)
            yield

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    userver = _Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    if listening is not None:
        listening(sock.getsockname()[1])
    try:
        async with around() if around is not None else contextlib.nullcontext():
            try:
                await userver.serve(sockets=[sock])
            finally:
                # cancelled: take no new connection or request before ``around`` exits (an
                # MCP session manager's exit cancels the calls in flight, ending their responses)
                for listener in userver.servers:
                    listener.close()
                for connection in list(userver.server_state.connections):
                    connection.shutdown()
    finally:
        quiet_shutdown()  # the requests whose calls were cancelled on the way out are no errors
        for task in list(userver.server_state.tasks):
            task.cancel()
        sock.close()
