"""MCP tool servers as prewarm-pool environments, with large results out of band (issue 13).

:func:`mcp_server_spec` describes a tool type served by any stdio MCP server: the pool
starts it with the official SDK's client (``mcp.client.stdio.stdio_client`` and
``ClientSession``: spawn, ``initialize``, ``list_tools``, all of it the measured cold
start), holds the session open in a task of its own and hands out a :class:`McpEnv`, whose
``call(tool, args)`` is ``session.call_tool``. :func:`mcp_tool_server_spec` is the same
for the server shipped here (:mod:`aospec.specbox._mcp_tool_server`), whose cold start is
importing the modules it is told to.

Out-of-band results. A tool whose output is at least the inline threshold publishes it in
a :class:`aospec.specbox.transport.ArtifactServer` of its own process and returns the
:class:`~aospec.specbox.transport.ArtifactRef` JSON instead of the bytes, twice:
``structuredContent`` is ``{"aospec_artifact": REF}`` and the one text content is
``"aospec-artifact:" + json(REF)`` (for clients that read only text). :meth:`McpEnv.call`
recognises either, *takes* the artifact through an :class:`~aospec.specbox.transport.ArtifactClient`
(one per producer, kept for the environment's life) and returns a :class:`ToolResult`
whose ``view`` is the read-only, zero-copy mapping of the producer's memory. Taking moves
the token's reference to the consumer: closing the result (or the environment) frees the
artifact in the producer. A smaller result stays inline (its text content, as usual).

The SDK is the optional extra ``integrations``; without it a spec raises a
:class:`~aospec.errors.ConfigError` naming ``pip install 'aospec[integrations]'``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio
from aospec.specbox.pool import EnvSpec, Policy, process_children, process_tree_rss_bytes
from aospec.specbox.transport import Artifact, ArtifactClient, ArtifactRef

from aospec.errors import ConfigError, SandboxError

__all__ = [
    "ARTIFACT_KEY",
    "ARTIFACT_MARKER",
    "McpEnv",
    "ToolResult",
    "artifact_ref_of",
    "artifact_result",
    "mcp_server_spec",
    "mcp_tool_server_spec",
]

#: The key of an out-of-band result's ref in ``structuredContent``.
ARTIFACT_KEY = "aospec_artifact"
#: The prefix of an out-of-band result's text content (followed by the ref's JSON).
ARTIFACT_MARKER = "aospec-artifact:"


def artifact_result(ref: ArtifactRef, meta: dict[str, Any] | None = None) -> Any:
    """An MCP ``CallToolResult`` carrying ``ref`` instead of the output, in the form
    :func:`artifact_ref_of` reads (marker text and structured content)."""
    from mcp import types

    obj = ref.to_json()
    return types.CallToolResult(
        content=[types.TextContent(text=ARTIFACT_MARKER + json.dumps(obj))],
        structured_content={ARTIFACT_KEY: obj},
        meta=meta,
    )


#: The environment variable that tags a pool's server process (to find its pid in /proc).
ENV_TAG = "AOSPEC_POOL_ENV"

_INSTALL_HINT = "MCP environments need the MCP SDK: pip install 'aospec[integrations]'"


def _require_sdk() -> None:
    try:
        import mcp.client.stdio  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"{_INSTALL_HINT} ({exc})") from exc


def artifact_ref_of(result: Any) -> ArtifactRef | None:
    """The out-of-band ref a ``CallToolResult`` carries (structured content, else the marked
    text), or None for an ordinary result."""
    structured = getattr(result, "structured_content", None)
    if isinstance(structured, dict) and ARTIFACT_KEY in structured:
        return ArtifactRef.from_json(structured[ARTIFACT_KEY])
    content = getattr(result, "content", None) or []
    if len(content) == 1 and getattr(content[0], "type", None) == "text":
        text = content[0].text
        if text.startswith(ARTIFACT_MARKER):
            return ArtifactRef.from_json(json.loads(text[len(ARTIFACT_MARKER) :]))
    return None


@dataclass(eq=False)
class ToolResult:
    """One tool call's result. ``result`` is the SDK's ``CallToolResult``; ``artifact`` the
    taken out-of-band artifact, if any. ``view`` is the output as read-only bytes (the
    artifact's zero-copy mapping, else the text content as UTF-8). Close it (or use
    ``with``) to free the artifact in the producer."""

    result: Any
    artifact: Artifact | None = None

    @property
    def is_error(self) -> bool:
        return bool(self.result.is_error)

    @property
    def text(self) -> str:
        """The text contents of an inline result, joined (an artifact's text is its marker)."""
        return "".join(c.text for c in self.result.content if getattr(c, "type", None) == "text")

    @property
    def view(self) -> memoryview:
        if self.artifact is not None:
            return self.artifact.view
        return memoryview(self.text.encode())

    @property
    def size(self) -> int:
        return self.artifact.size if self.artifact is not None else len(self.text.encode())

    def tobytes(self) -> bytes:
        return self.view.tobytes()

    def close(self) -> None:
        if self.artifact is not None:
            self.artifact.close()

    def __enter__(self) -> ToolResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class McpEnv:
    """A live MCP server held open by the pool: ``session`` (the SDK's ``ClientSession``),
    ``tools`` (the names it listed), ``pid`` (the server process, None when it could not be
    found in /proc), ``server_info``."""

    session: Any
    tools: tuple[str, ...]
    pid: int | None = None
    server_info: Any = None
    _clients: dict[str, ArtifactClient] = field(default_factory=dict)

    async def call(self, tool: str, args: Mapping[str, Any] | None = None) -> ToolResult:
        """``session.call_tool(tool, args)``; an out-of-band result is taken (module doc)."""
        result = await self.session.call_tool(tool, dict(args or {}))
        ref = artifact_ref_of(result)
        if ref is None:
            return ToolResult(result)
        if ref.inline is not None:
            return ToolResult(result, Artifact(memoryview(ref.inline), ref.size, None, None, None))
        client = await self._client(ref)
        # a blocking request on a Unix socket (sub-millisecond): off the event loop all the same
        artifact = await anyio.to_thread.run_sync(client.take, ref)
        return ToolResult(result, artifact)

    async def _client(self, ref: ArtifactRef) -> ArtifactClient:
        assert ref.address is not None
        client = self._clients.get(ref.address)
        if client is None:
            client = await anyio.to_thread.run_sync(ArtifactClient, ref.address)
            self._clients[ref.address] = client
        return client

    def rss_bytes(self) -> int:
        """Resident memory of the server process and its descendants (0 when unknown)."""
        return process_tree_rss_bytes(self.pid) if self.pid is not None else 0

    def _close(self) -> None:
        # Closing a client drops every lease it holds: artifacts nobody else holds are freed
        # in the producer; mappings already handed out stay valid.
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _tagged_child(tag: str) -> int | None:
    """The pid of this process's child whose environment carries ``ENV_TAG=tag``."""
    needle = f"{ENV_TAG}={tag}".encode()
    for child in process_children(os.getpid()) or ():
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            return child
    return None


def mcp_server_spec(
    name: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    policy: Policy = "on-demand",
    memory_bytes: int = 128 << 20,
    read_timeout_s: float | None = 120.0,
    errlog: TextIO | None = None,
    **kw: Any,
) -> EnvSpec:
    """A tool type served by the stdio MCP server ``command`` (argv). ``env`` is merged over
    the SDK's safe default environment; ``errlog`` receives the server's stderr (default
    ``sys.stderr``). The cold start the pool measures is spawn + ``initialize`` +
    ``list_tools``; the environment is a :class:`McpEnv`. ``memory_bytes`` is the estimate
    the pool's budget counts; the reports use the measured RSS of the server's process tree."""
    _require_sdk()
    if not command:
        raise ConfigError(f"mcp_server_spec {name!r}: command is empty")
    argv = [str(a) for a in command]

    @asynccontextmanager
    async def open_env() -> AsyncIterator[McpEnv]:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        tag = secrets.token_hex(8)
        params = StdioServerParameters(command=argv[0], args=argv[1:], env={**(env or {}), ENV_TAG: tag}, cwd=cwd)
        failure: Exception | None = None
        async with (
            stdio_client(params, errlog=errlog if errlog is not None else sys.stderr) as (read, write),
            ClientSession(read, write, read_timeout_seconds=read_timeout_s) as session,
        ):
            try:
                init = await session.initialize()
                listed = await session.list_tools()
            except Exception as exc:
                failure = exc  # raised below, outside the SDK's task groups (which would wrap it)
            else:
                mcp_env = McpEnv(session, tuple(t.name for t in listed.tools), _tagged_child(tag), init.server_info)
                try:
                    yield mcp_env
                finally:
                    mcp_env._close()
        if failure is not None:
            raise SandboxError(f"MCP server {name!r} ({' '.join(argv)}) did not start: {failure!r}") from failure

    return EnvSpec(name, open=open_env, policy=policy, memory_bytes=memory_bytes, rss=McpEnv.rss_bytes, **kw)


def mcp_tool_server_spec(
    name: str,
    *,
    imports: Sequence[str] = (),
    ballast_mb: int = 0,
    threshold: int | None = None,
    memory_bytes: int | None = None,
    **kw: Any,
) -> EnvSpec:
    """A tool type served by :mod:`aospec.specbox._mcp_tool_server` (a real MCP server): its cold
    start is the interpreter, the SDK, and importing ``imports`` (e.g. ``("numpy",
    "scipy.stats")``), plus ``ballast_mb`` of resident memory."""
    command = [sys.executable, "-m", "aospec.specbox._mcp_tool_server", "--name", name, "--ballast-mb", str(ballast_mb)]
    for module in imports:
        command += ["--import", module]
    if threshold is not None:
        command += ["--threshold", str(threshold)]
    est = memory_bytes if memory_bytes is not None else (70 + 60 * len(imports) + ballast_mb) << 20
    # the same interpreter finds aospec as this process does (installed or editable); a
    # PYTHONPATH of the caller's is passed on, since the SDK starts servers in a clean environment
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else None
    return mcp_server_spec(name, command, env=env, memory_bytes=est, **kw)
