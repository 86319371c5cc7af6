"""MCP tool servers as prewarm-pool environments (specbox/mcp_env.py): real stdio MCP
server processes (aospec.specbox._mcp_tool_server with no heavy import, so each starts fast)
started by the official SDK client, warmed, acquired and released; large results out of
band through aospec.specbox.transport, freed in the producer once the consumer closes them; and
nothing left behind (processes, /dev/shm entries, descriptors) after the pool closes.
No timed assertions (scripts/bench_specbox.py measures)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import mcp_types as types
import pytest
from aospec.specbox._mcp_tool_server import fill_text
from aospec.specbox.mcp_env import (
    ARTIFACT_KEY,
    ARTIFACT_MARKER,
    ENV_TAG,
    McpEnv,
    artifact_ref_of,
    mcp_server_spec,
    mcp_tool_server_spec,
)
from aospec.specbox.pool import EnvironmentPool, process_tree_pids
from aospec.specbox.transport import INLINE_THRESHOLD, SHM_DIR, SHM_PREFIX, ArtifactRef

from aospec.errors import ConfigError, SandboxError

pytestmark = pytest.mark.anyio

MB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _tagged_children() -> list[int]:
    """This process's children started by a pool (their environment carries the tag)."""
    me = os.getpid()
    out = []
    for tid in os.listdir(f"/proc/{me}/task"):
        try:
            children = Path(f"/proc/{me}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes()
            except OSError:
                continue
            if f"{ENV_TAG}=".encode() in environ:
                out.append(int(child))
    return out


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)} if SHM_DIR.is_dir() else set()


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _expected(size: int, seed: int) -> bytes:
    buf = bytearray(size)
    fill_text(memoryview(buf), seed)
    return bytes(buf)


async def _stats(env: McpEnv) -> dict[str, int]:
    with await env.call("artifact_stats") as out:
        return json.loads(out.text)  # type: ignore[no-any-return]


async def test_an_mcp_server_is_warmed_acquired_and_released_with_its_cold_start_measured() -> None:
    async with EnvironmentPool([mcp_tool_server_spec("lookup", policy="speculative")]) as pool:
        assert await pool.warm("lookup")
        await pool.wait_until(lambda: pool.count("lookup", "idle") == 1, 120)
        cost = pool.cold_start_cost("lookup")
        assert cost is not None and cost > 0  # spawn + initialize + list_tools, measured
        async with pool.lease("lookup") as env:  # a hit: the warm server
            server: McpEnv = env.value
            assert set(server.tools) >= {"echo", "lookup", "produce", "artifact_stats"}
            assert server.server_info.name == "lookup"
            with await server.call("echo", {"text": "hi"}) as out:
                assert out.text == "hi" and not out.is_error and out.artifact is None
            with await server.call("lookup", {"key": "k"}) as out:
                assert json.loads(out.text)["key"] == "k"
            with await server.call("nope") as out:
                assert out.is_error
            assert server.pid is not None and server.pid in _tagged_children()
            assert server.rss_bytes() > 0 and pool.rss_bytes() == server.rss_bytes()
        assert pool.stats.hits == 1 and pool.stats.cold_starts == 0 and pool.stats.wasted_warm_ups == 0
        async with pool.lease("lookup") as again:  # released idle: the same process again
            assert again.value.pid == server.pid
        pid = server.pid
    assert not os.path.exists(f"/proc/{pid}") and _tagged_children() == []


async def test_a_large_result_travels_out_of_band_and_is_freed_when_the_consumer_closes_it() -> None:
    segments, fds = _segments(), _fds()
    async with (
        EnvironmentPool([mcp_tool_server_spec("produce", policy="on-demand")]) as pool,
        pool.lease("produce") as env,
    ):
        server: McpEnv = env.value
        size = 3 * MB + 7
        out = await server.call("produce", {"size": size, "seed": 5})
        ref = artifact_ref_of(out.result)
        assert ref is not None and not ref.is_inline and ref.size == size  # only the ref came in-band
        assert out.result.structured_content == {ARTIFACT_KEY: ref.to_json()}
        assert out.artifact is not None and out.view.readonly and out.size == size
        assert out.view == _expected(size, 5)  # the producer's memory, mapped read-only
        stats = await _stats(server)
        assert stats["live"] == 1 and stats["opened"] == 1  # taken: the consumer holds the only reference
        out.close()
        stats = await _stats(server)
        assert stats["live"] == 0 and stats["freed"] == 1  # closed in this process, freed in the producer

        with await server.call("produce", {"size": 100, "seed": 1}) as small:  # below the threshold: inline
            assert small.artifact is None and small.tobytes() == _expected(100, 1)
        with await server.call("produce", {"size": INLINE_THRESHOLD, "seed": 2}) as edge:
            assert edge.artifact is not None and edge.tobytes() == _expected(INLINE_THRESHOLD, 2)
        leftover = await server.call("produce", {"size": MB})  # never closed: the lease goes with the env
        assert (await _stats(server))["live"] == 1
        pid = server.pid
    assert leftover.artifact is not None and leftover.view[:3] == _expected(3, 0)  # a mapping stays valid
    leftover.close()
    assert not os.path.exists(f"/proc/{pid}") and _tagged_children() == []
    assert _segments() == segments and _fds() == fds


def test_a_ref_is_read_from_structured_content_or_the_marked_text() -> None:
    ref = ArtifactRef(MB, 0xABC, "@somewhere")
    as_text = types.CallToolResult(content=[types.TextContent(text=ARTIFACT_MARKER + json.dumps(ref.to_json()))])
    assert artifact_ref_of(as_text) == ref
    structured = types.CallToolResult(content=[], structured_content={ARTIFACT_KEY: ref.to_json()})
    assert artifact_ref_of(structured) == ref
    assert artifact_ref_of(types.CallToolResult(content=[types.TextContent(text="plain")])) is None


async def test_closing_the_pool_stops_every_server_also_after_an_exception() -> None:
    segments, fds = _segments(), _fds()
    specs = [
        mcp_tool_server_spec("kept", policy="reserved", reserved=2),
        mcp_tool_server_spec("spec", policy="speculative"),
    ]
    pids: list[int] = []
    with pytest.raises(ValueError, match="the body failed"):
        async with EnvironmentPool(specs) as pool:
            await pool.wait_until(lambda: pool.count("kept", "idle") == 2, 120)
            await pool.warm("spec")  # still starting when the body fails
            env = await pool.acquire("kept")
            held = await env.value.call("produce", {"size": MB})
            pids = [e.value.pid for e in pool.environments() if e.value is not None]
            trees = [p for pid in pids for p in process_tree_pids(pid)]
            raise ValueError("the body failed")
    assert len(pids) >= 2 and held.artifact is not None
    held.close()
    assert not any(os.path.exists(f"/proc/{p}") for p in trees)
    assert _tagged_children() == [] and _segments() == segments and _fds() == fds


async def test_a_server_that_exits_at_start_is_a_clear_start_failure() -> None:
    spec = mcp_server_spec("bad", [sys.executable, "-c", "import sys; sys.exit(3)"])
    async with EnvironmentPool([spec]) as pool:
        with pytest.raises(SandboxError, match=r"MCP server 'bad' .* did not start"):
            await pool.acquire("bad")
        assert pool.stats.start_failures == 1 and pool.count() == 0
    assert _tagged_children() == []


def test_without_the_sdk_a_spec_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mcp.client.stdio", None)  # what a missing SDK looks like to import
    with pytest.raises(ConfigError, match=r"pip install 'aospec\[integrations\]'"):
        mcp_tool_server_spec("t")
    with pytest.raises(ConfigError, match="command is empty"):
        monkeypatch.delitem(sys.modules, "mcp.client.stdio")
        mcp_server_spec("t", [])


async def test_a_cancelled_cold_start_leaves_no_server() -> None:
    async with EnvironmentPool([mcp_tool_server_spec("slow")]) as pool:
        with anyio.move_on_after(0.2):
            await pool.acquire("slow")
        assert pool.count() == 0 and pool.stats.start_failures == 1
    await anyio.sleep(0)
    assert _tagged_children() == []
