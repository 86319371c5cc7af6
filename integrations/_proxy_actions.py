"""Action speculation for ``aospec proxy --mcp URL`` (issue 12 section 2; docs/integrations.md).

While a chat completion streams back to the harness, :class:`ActionWatcher` reads the same
bytes and, as soon as an action the harness will execute through aospec's MCP server is
complete in the stream, asks that server to start it in a fork (``POST /aospec/prefetch``
on the MCP server's address, see integrations/mcp_server.py). The harness's own
``tools/call`` is then answered from the fork only when the server's JASV accepts it (the
same call, and the fork's origin version is the committed version); otherwise it runs as
usual. The proxy never changes a byte of what the harness receives.

Actions (``actions_of``):

- a tool call whose name is one of the MCP server's sandbox tools (``bash``,
  ``read_file``, ``write_file``, ``edit_file``): that call with its JSON arguments;
- a tool call named a declared command tool (``--command-tool NAME``) whose arguments are
  exactly ``{"command": str}``: ``bash`` with that command;
- a ```` ```bash ```` block in the reply's text (mini-swe-agent style; the first closed
  one, stripped as mini-swe-agent does): ``bash`` with its content.

A tool call is complete when a later tool call, a ``finish_reason`` or the end of the
stream arrives; a text block when its closing fence arrives.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

__all__ = ["MCP_TOOLS", "ActionWatcher", "prefetch_url"]

#: The sandbox tools of ``aospec mcp`` (calls with these names go to it as they are).
MCP_TOOLS = frozenset({"bash", "read_file", "write_file", "edit_file"})
#: mini-swe-agent's action block (live/chat.py's ``_BLOCK``).
_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL)


def prefetch_url(mcp_url: str) -> str:
    """The prefetch endpoint of the ``aospec mcp --http`` server at ``mcp_url``."""
    parts = urlsplit(mcp_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--mcp must be the http(s) URL of an `aospec mcp --http` server, got {mcp_url!r}")
    return f"{parts.scheme}://{parts.netloc}/aospec/prefetch"


def map_call(name: str, raw_args: str, command_tools: Iterable[str]) -> tuple[str, dict[str, Any]] | None:
    """The MCP call a harness makes for tool call ``name(raw_args)``, None when none."""
    try:
        args = json.loads(raw_args) if raw_args.strip() else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    if name in command_tools:
        if set(args) == {"command"} and isinstance(args["command"], str):
            return "bash", {"command": args["command"]}
        return None
    if name in MCP_TOOLS:
        return name, args
    return None


class ActionWatcher:
    """Reads one reply's bytes as they arrive and calls ``emit(tool, arguments)`` for each
    action once it is complete (module doc)."""

    def __init__(self, stream: bool, command_tools: Sequence[str], emit: Any) -> None:
        self.stream = stream
        self.command_tools = tuple(command_tools)
        self._emit = emit
        self._emitted: set[str] = set()
        self._buf = b""
        self._text = ""
        self._block_sent = False
        self._calls: dict[int, list[str]] = {}  # index -> [name, arguments]
        self._sent: set[int] = set()
        self._whole: list[bytes] = []

    def emit(self, tool: str, arguments: dict[str, Any]) -> None:
        """Each distinct action once per reply (a reply may hold one both as a block and
        as a tool call)."""
        key = json.dumps([tool, arguments], sort_keys=True)
        if key not in self._emitted:
            self._emitted.add(key)
            self._emit(tool, arguments)

    def _call_done(self, index: int) -> None:
        if index in self._sent or index not in self._calls:
            return
        self._sent.add(index)
        name, raw = self._calls[index]
        call = map_call(name, raw, self.command_tools)
        if call is not None:
            self.emit(*call)

    def _all_done(self) -> None:
        for i in sorted(self._calls):
            self._call_done(i)

    def _text_grew(self) -> None:
        if self._block_sent:
            return
        m = _BLOCK.search(self._text)
        if m is not None:
            self._block_sent = True
            self.emit("bash", {"command": m.group(1).strip()})

    def feed(self, chunk: bytes) -> None:
        if not self.stream:
            self._whole.append(chunk)
            return
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self._all_done()
            return
        try:
            obj = json.loads(payload)
            choices = obj.get("choices") or ()
        except (ValueError, AttributeError, RecursionError):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                self._text += delta["content"]
                self._text_grew()
            for tc in delta.get("tool_calls") or ():
                try:
                    i = int(tc.get("index", 0))
                except (TypeError, ValueError, AttributeError):
                    continue
                for earlier in [j for j in self._calls if j < i]:
                    self._call_done(earlier)
                slot = self._calls.setdefault(i, ["", ""])
                fn = tc.get("function") or {}
                slot[0] += fn.get("name") or ""
                slot[1] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self._all_done()

    def close(self) -> None:
        """The reply ended whole."""
        if self.stream:
            self._all_done()
            return
        try:
            obj = json.loads(b"".join(self._whole))
            msg = obj["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            return
        if isinstance(msg.get("content"), str):
            self._text = msg["content"]
            self._text_grew()
        for i, tc in enumerate(msg.get("tool_calls") or ()):
            fn = (tc or {}).get("function") or {}
            if isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str):
                self._calls[i] = [fn["name"], fn["arguments"]]
        self._all_done()


async def watch(up: Any, stream: bool, command_tools: Sequence[str], emit: Any) -> None:
    """Run an :class:`ActionWatcher` over upstream request ``up`` (integrations/proxy.py's
    ``_Upstream``) until it ends; only a 200 reply is read."""
    await up.started()
    if up.status != 200:
        return
    w = ActionWatcher(stream, command_tools, emit)
    async for chunk in up.body():
        w.feed(chunk)
    if up.error is None:
        w.close()


class Prefetcher:
    """Posts actions to the MCP server's prefetch endpoint (fire and forget), with the
    server's ``token`` as a bearer token."""

    def __init__(self, mcp_url: str, stats: Any, token: str | None = None) -> None:
        self.url = prefetch_url(mcp_url)
        self.stats = stats
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._tasks: set[asyncio.Task[None]] = set()

    def emit(self, client: Any, tool: str, arguments: dict[str, Any]) -> None:
        task = asyncio.ensure_future(self._post(client, tool, arguments))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, client: Any, tool: str, arguments: dict[str, Any]) -> None:
        self.stats.actions_prefetched += 1
        try:
            r = await client.post(self.url, json={"name": tool, "arguments": arguments}, headers=self.headers)
            if r.status_code != 200 or not r.json().get("launched"):
                self.stats.prefetch_refused += 1
        except Exception:  # a lost prefetch is only a missed chance
            self.stats.prefetch_errors += 1

    async def aclose(self) -> None:
        for t in list(self._tasks):
            t.cancel()
