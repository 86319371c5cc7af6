"""A small stateful MCP server to try ``aospec mcp --upstream`` against (stdio).

``python -m aospec.integrations.mcp_demo_server [--name NAME]``: an in-memory key-value store
with ``get(key)`` (read-only, closed-world), ``list_keys()`` (read-only, closed-world),
``put(key, value)`` (writes) and ``calls()`` (how many times each tool ran in this
process: read-only but open-world, since it counts the proxy's speculative calls too).
A missing key is a tool error.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import anyio
import mcp_types as types

__all__ = ["build", "main"]

_RO = types.ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)


def build(name: str = "demo-kv") -> Any:
    from mcp.server.lowlevel import Server

    store: dict[str, str] = {}
    calls: Counter[str] = Counter()
    obj = {"type": "object", "additionalProperties": False}
    tools = [
        types.Tool(
            name="get",
            description="the value of a key",
            annotations=_RO,
            input_schema={**obj, "properties": {"key": {"type": "string"}}, "required": ["key"]},
        ),
        types.Tool(
            name="list_keys", description="all keys, sorted", annotations=_RO, input_schema={**obj, "properties": {}}
        ),
        types.Tool(
            name="put",
            description="set a key to a value",
            annotations=types.ToolAnnotations(
                read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False
            ),
            input_schema={
                **obj,
                "properties": {"key": {"type": "string"}, "value": {"type": "string"}},
                "required": ["key", "value"],
            },
        ),
        types.Tool(
            name="calls",
            description="how often each tool ran in this server process",
            annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=True),
            input_schema={**obj, "properties": {}},
        ),
    ]

    def text(s: str, error: bool = False) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(text=s)], is_error=error)

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = params.arguments or {}
        calls[params.name] += 1
        if params.name == "get":
            key = args.get("key")
            return text(store[key]) if key in store else text(f"no key {key!r}", error=True)
        if params.name == "list_keys":
            return text("\n".join(sorted(store)))
        if params.name == "put":
            key, value = args.get("key"), args.get("value")
            if not isinstance(key, str) or not isinstance(value, str):
                return text("put: key and value must be strings", error=True)
            store[key] = value
            return text(f"ok {key}")
        if params.name == "calls":
            return text(json.dumps(dict(sorted(calls.items()))))
        return text(f"unknown tool {params.name!r}", error=True)

    return Server(name, on_list_tools=on_list_tools, on_call_tool=on_call_tool)


def main(argv: list[str] | None = None) -> None:
    from mcp.server.stdio import stdio_server

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="demo-kv", help="the server's name (serverInfo.name)")
    args = p.parse_args(argv)
    server = build(args.name)

    async def run() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(run)


if __name__ == "__main__":
    main()
