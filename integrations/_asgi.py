"""Small ASGI helpers shared by the proxy and the MCP server's HTTP routes."""

from __future__ import annotations

from typing import Any


async def read_body(receive: Any) -> bytes | None:
    """The whole request body, or None when the client disconnected before sending it."""
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)
