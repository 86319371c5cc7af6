"""Shared fixtures of the integration tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

AOSPEC = str(Path(sys.executable).with_name("aospec"))


def server_token(log: str) -> str | None:
    """The token an ``aospec mcp --http`` or ``aospec proxy`` printed at start (None: it
    printed none, having been given one)."""
    marker = ": token "
    return log.split(marker, 1)[1].split()[0] if marker in log else None


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def mcp_state_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private AOSPEC_STATE_ROOT for ``aospec mcp`` subprocesses (skips where the overlay
    backend cannot run); fails if any mount is left under it afterwards."""
    from aospec.runtime._fs import mounts_under
    from aospec.runtime.host import host_support

    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    state = tmp_path_factory.mktemp("mcp-state")
    yield state
    leaked = mounts_under(str(state))
    assert not leaked, f"mounts leaked by aospec mcp: {leaked}"


@contextlib.asynccontextmanager
async def mcp_http_server(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[subprocess.Popen[bytes], str, str | None]]:
    """Run ``aospec mcp --http 0 ARGS`` (stderr to ``log``) and yield ``(process, URL,
    token)`` once it listens (the token printed, else ``AOSPEC_TOKEN`` of ``env``). The
    process is ended (SIGTERM) and waited for; it must exit 0."""
    full_env = {**os.environ, **(env or {})}
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [AOSPEC, "mcp", "--http", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=full_env,
        )
    try:
        url = None
        for _ in range(3000):  # bounded wait for the "listening on URL" line
            text = log.read_text()
            if "listening on " in text:
                url = text.split("listening on ", 1)[1].split()[0]
                break
            if proc.poll() is not None:
                break
            await anyio.sleep(0.1)
        assert url, f"aospec mcp --http did not start: {log.read_text()}"
        token = server_token(log.read_text()) or full_env.get("AOSPEC_TOKEN")
        yield proc, url, token
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0, f"aospec mcp exited with {proc.returncode}: {log.read_text()}"


@contextlib.asynccontextmanager
async def mcp_session(url: str, token: str | None) -> AsyncIterator[Any]:
    """An initialised official-SDK ClientSession to the streamable HTTP server at ``url``,
    sending ``token`` as a bearer token."""
    import httpx2
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=300) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        with anyio.fail_after(300):  # a hang guard, not a performance assertion
            await session.initialize()
        yield session


@pytest.fixture
def mcp_connect(tmp_path: Path) -> Callable[..., contextlib.AbstractAsyncContextManager[Any]]:
    """``async with mcp_connect(ARGS, transport="stdio"|"http", env=...) as session``: run
    ``aospec mcp ARGS`` as a subprocess and yield an initialised official-SDK ClientSession
    to it, over stdio or streamable HTTP on loopback (``--http 0``; the server prints its
    URL and the token the client sends). The subprocess is always ended and waited for."""
    from mcp import ClientSession, StdioServerParameters, stdio_client

    @contextlib.asynccontextmanager
    async def connect(
        args: list[str], transport: str = "stdio", env: dict[str, str] | None = None
    ) -> AsyncIterator[ClientSession]:
        if transport == "stdio":
            params = StdioServerParameters(command=AOSPEC, args=["mcp", "--stdio", *args], env={**os.environ, **(env or {})})
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                with anyio.fail_after(300):  # a hang guard, not a performance assertion
                    await session.initialize()
                yield session
            return
        log = tmp_path / f"mcp-http-{os.urandom(4).hex()}.log"
        async with mcp_http_server(args, log, env) as (_, url, token), mcp_session(url, token) as session:
            yield session

    return connect
