"""A real MCP tool server (stdio, the official SDK's low-level server) with a real cold start.

``python -m aospec.specbox._mcp_tool_server [--import MOD ...] [--ballast-mb N] [--threshold B]``:
before it answers ``initialize`` it imports each ``--import`` module (e.g. ``numpy``,
``scipy.stats``, ``sklearn.linear_model``: what a tool server that computes something
pays at every start), touches ``--ballast-mb`` of resident memory, and starts an
:class:`aospec.specbox.transport.ArtifactServer` for its large outputs. Tools:

- ``echo(text)``: the text back.
- ``lookup(key)``: ``{"key": KEY, "value": sha256(KEY)}`` as JSON text.
- ``produce(size, seed=0)``: ``size`` bytes of printable text (byte i is
  ``32 + (7 i + seed) % 95``). Below the threshold it is the result's text; from the
  threshold up it is published out of band and the result carries its
  :class:`~aospec.specbox.transport.ArtifactRef` (:mod:`aospec.specbox.mcp_env` documents the form).
- ``artifact_stats()``: the artifact server's counts as JSON (``live`` is 0 once every
  consumer has closed what it took).

End of input ends it (the MCP stdio shutdown); the artifact server is closed on the way
out, and tokens nobody took are swept after ``--sweep-s`` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
from typing import Any

from aospec.specbox.mcp_env import artifact_result
from aospec.specbox.transport import INLINE_THRESHOLD, ArtifactServer, sweep_forever

__all__ = ["build", "fill_text", "main"]

_PERIOD = 95


def fill_text(view: memoryview, seed: int = 0) -> None:
    """Fill ``view`` with byte i = ``32 + (7 i + seed) % 95`` (printable, period 95)."""
    block = bytes(32 + (7 * i + seed) % _PERIOD for i in range(_PERIOD)) * 4096
    n = view.nbytes
    for start in range(0, n, len(block)):
        end = min(n, start + len(block))
        view[start:end] = block[: end - start]


def build(artifacts: ArtifactServer, name: str = "aospec-tool") -> Any:
    import mcp_types as types
    from mcp.server.lowlevel import Server

    obj = {"type": "object", "additionalProperties": False}
    read_only = types.ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
    tools = [
        types.Tool(
            name="echo",
            description="the text back",
            annotations=read_only,
            input_schema={**obj, "properties": {"text": {"type": "string"}}, "required": ["text"]},
        ),
        types.Tool(
            name="lookup",
            description="a deterministic record for a key",
            annotations=read_only,
            input_schema={**obj, "properties": {"key": {"type": "string"}}, "required": ["key"]},
        ),
        types.Tool(
            name="produce",
            description="SIZE bytes of text; large outputs travel out of band (aospec.specbox.transport)",
            annotations=read_only,
            input_schema={
                **obj,
                "properties": {"size": {"type": "integer", "minimum": 0}, "seed": {"type": "integer"}},
                "required": ["size"],
            },
        ),
        types.Tool(name="artifact_stats", description="the artifact server's counts", input_schema=obj),
    ]

    def text(s: str, error: bool = False) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(text=s)], is_error=error)

    async def on_list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = params.arguments or {}
        if params.name == "echo":
            return text(str(args.get("text", "")))
        if params.name == "lookup":
            key = str(args.get("key", ""))
            return text(json.dumps({"key": key, "value": hashlib.sha256(key.encode()).hexdigest()}))
        if params.name == "produce":
            size, seed = args.get("size"), args.get("seed", 0)
            if not isinstance(size, int) or size < 0 or not isinstance(seed, int):
                return text("produce: size must be an integer >= 0 (seed an integer)", error=True)
            with artifacts.allocate(size) as writer:
                fill_text(writer.view, seed)
                if size < artifacts.threshold:
                    return text(writer.view.tobytes().decode("ascii"))
                ref = writer.publish()
            return artifact_result(ref)
        if params.name == "artifact_stats":
            return text(json.dumps(vars(artifacts.stats)))
        return text(f"unknown tool {params.name!r}", error=True)

    return Server(name, on_list_tools=on_list_tools, on_call_tool=on_call_tool)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aospec.specbox._mcp_tool_server", description=__doc__.splitlines()[0])
    p.add_argument("--import", dest="imports", action="append", default=[], help="a module to import at start")
    p.add_argument("--ballast-mb", type=int, default=0, help="resident memory to hold")
    p.add_argument("--threshold", type=int, default=INLINE_THRESHOLD, help="inline results below this size")
    p.add_argument("--sweep-s", type=float, default=300.0, help="free artifacts nobody took after this long")
    p.add_argument("--name", default="aospec-tool")
    args = p.parse_args(argv)
    held = [importlib.import_module(m) for mods in args.imports for m in mods.split(",") if m]
    ballast = bytearray(args.ballast_mb << 20)
    for i in range(0, len(ballast), 4096):  # touch the pages so that they are resident
        ballast[i] = 1

    import anyio
    from mcp.server.stdio import stdio_server

    async def run(artifacts: ArtifactServer) -> None:
        server = build(artifacts, args.name)

        async with stdio_server() as (read, write), anyio.create_task_group() as tg:
            tg.start_soon(sweep_forever, artifacts, args.sweep_s)
            await server.run(read, write, server.create_initialization_options())
            tg.cancel_scope.cancel()

    with ArtifactServer(threshold=args.threshold) as artifacts:
        anyio.run(run, artifacts)
    del held, ballast
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
