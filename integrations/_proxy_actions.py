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
  ``read_file``, ``write_file``, ``edit_file``): that call with its JSON arguments; with a
  tool prefix (``--mcp-tool-prefix PREFIX``: the harness names that server's tools
  ``PREFIX + tool``, as opencode names them ``SERVER_tool``, see :func:`opencode_tool_prefix`),
  only ``PREFIX + tool`` is, as ``tool``, and a bare ``bash`` is not (it is another tool's:
  opencode's own, or another server's);
- a tool call named a declared command tool (``--command-tool NAME``) whose arguments are
  exactly ``{"command": str}``: ``bash`` with that command;
- a ```` ```bash ```` block in the reply's text (mini-swe-agent style; the first closed
  one, stripped as mini-swe-agent does): ``bash`` with its content.

A tool call is complete when a later tool call, a ``finish_reason`` or the end of the
stream arrives; a text block when its closing fence arrives. In a Responses API reply
(:class:`ResponsesActionWatcher`) a tool call is a ``function_call`` output item, complete
at its ``response.output_item.done`` event; text comes in ``response.output_text.delta``
events.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

__all__ = ["MCP_TOOLS", "ActionWatcher", "ResponsesActionWatcher", "opencode_tool_prefix", "prefetch_url"]

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


def opencode_tool_prefix(server_key: str) -> str:
    """The prefix opencode (1.18.33) gives the tools of the MCP server its opencode.json
    names ``server_key`` (``"mcp": {server_key: {...}}``): the key with every character but
    ASCII letters, digits, ``_`` and ``-`` replaced by ``_``, then ``_`` (``aospec`` ->
    ``aospec_``: its tools are ``aospec_bash``, ``aospec_read_file``, ...)."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", server_key) + "_"


def map_call(
    name: str, raw_args: str, command_tools: Iterable[str], tool_prefix: str = "", *, any_tool: bool = False
) -> tuple[str, dict[str, Any]] | None:
    """The MCP call a harness makes for tool call ``name(raw_args)``, None when none; with
    ``tool_prefix``, the harness calls the MCP server's tools ``tool_prefix + tool`` and only
    those names are its sandbox tools (module doc); ``any_tool``: the server is ``aospec mcp
    --upstream``, whose tools are any upstream's, so every name (after the prefix) is one."""
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
    if not name.startswith(tool_prefix):
        return None
    tool = name[len(tool_prefix) :]
    if tool and (any_tool or tool in MCP_TOOLS):
        return tool, args
    return None


class ActionWatcher:
    """Reads one reply's bytes as they arrive and calls ``emit(tool, arguments)`` for each
    action once it is complete (module doc)."""

    def __init__(
        self, stream: bool, command_tools: Sequence[str], emit: Any, tool_prefix: str = "", *, any_tool: bool = False
    ) -> None:
        self.stream = stream
        self.command_tools = tuple(command_tools)
        self.tool_prefix = tool_prefix
        self.any_tool = any_tool
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
        call = map_call(name, raw, self.command_tools, self.tool_prefix, any_tool=self.any_tool)
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
        except (ValueError, RecursionError):
            return
        if isinstance(obj, dict):
            self._event(obj)

    def _event(self, obj: dict[str, Any]) -> None:
        """One chat-completions chunk."""
        choices = obj.get("choices") or ()
        if not isinstance(choices, list):
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
        except (ValueError, RecursionError):
            return
        self._plain(obj)
        self._all_done()

    def _plain(self, obj: Any) -> None:
        """A whole (non-streamed) chat completion."""
        try:
            msg = obj["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            return
        if isinstance(msg.get("content"), str):
            self._text = msg["content"]
            self._text_grew()
        for i, tc in enumerate(msg.get("tool_calls") or ()):
            fn = (tc or {}).get("function") or {}
            if isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str):
                self._calls[i] = [fn["name"], fn["arguments"]]


class ResponsesActionWatcher(ActionWatcher):
    """:class:`ActionWatcher` for a Responses API reply (module doc)."""

    def _item(self, index: int, item: Any) -> None:
        if not isinstance(item, dict):
            return
        if item.get("type") == "function_call":
            name, args = item.get("name"), item.get("arguments")
            if isinstance(name, str) and isinstance(args, str):
                self._calls.setdefault(index, [name, args])
                self._call_done(index)
        elif item.get("type") == "message" and not self.stream:
            for part in item.get("content") or ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    self._text += part["text"]
            self._text_grew()

    def _event(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            self._text += obj["delta"]
            self._text_grew()
        elif kind == "response.output_item.done" and isinstance(obj.get("output_index"), int):
            self._item(obj["output_index"], obj.get("item"))
        elif kind == "response.completed":
            self._all_done()

    def _plain(self, obj: Any) -> None:
        output = obj.get("output") if isinstance(obj, dict) else None
        for i, item in enumerate(output if isinstance(output, list) else ()):
            self._item(i, item)


async def watch(
    up: Any,
    stream: bool,
    command_tools: Sequence[str],
    emit: Any,
    *,
    responses: bool = False,
    tool_prefix: str = "",
    any_tool: bool = False,
) -> None:
    """Run an :class:`ActionWatcher` (a :class:`ResponsesActionWatcher` for a Responses API
    reply) over upstream request ``up`` (integrations/proxy.py's ``_Upstream``) until it
    ends; only a 200 reply is read."""
    await up.started()
    if up.status != 200:
        return
    w = (ResponsesActionWatcher if responses else ActionWatcher)(
        stream, command_tools, emit, tool_prefix, any_tool=any_tool
    )
    async for chunk in up.body():
        w.feed(chunk)
    if up.error is None:
        w.close()


class Prefetcher:
    """Posts actions to the MCP server's prefetch endpoint, each in the task group it is
    given (the proxy's lifespan group: nothing outlives the proxy), with the server's
    ``token`` as a bearer token."""

    def __init__(self, mcp_url: str, stats: Any, token: str | None = None) -> None:
        self.url = prefetch_url(mcp_url)
        self.stats = stats
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        #: tools the server said it never prefetches (``"refused": "tool"``: not one of its
        #: tools, or not trusted): drafted calls of them are not sent
        self.refused_tools: set[str] = set()

    def emit(self, tg: Any, client: Any, tool: str, arguments: dict[str, Any]) -> None:
        if tool not in self.refused_tools:
            tg.start_soon(self._post, client, tool, arguments)

    async def _post(self, client: Any, tool: str, arguments: dict[str, Any]) -> None:
        self.stats.actions_prefetched += 1
        try:
            r = await client.post(self.url, json={"name": tool, "arguments": arguments}, headers=self.headers)
            reply = r.json() if r.status_code == 200 else {}
            if not reply.get("launched"):
                self.stats.prefetch_refused += 1
                if reply.get("refused") == "tool" and len(self.refused_tools) < 1024:
                    self.refused_tools.add(tool)
        except Exception:  # a lost prefetch is only a missed chance
            self.stats.prefetch_errors += 1
