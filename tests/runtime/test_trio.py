"""The runtime under trio (the engine's virtual-time clock runs on trio): the same
operations as on asyncio, including timeouts and cancellation."""

from __future__ import annotations

import pytest
from aospec.runtime import SandboxConfig, open_sandbox

from aospec.types import Action

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


async def test_execute_fork_commit_and_timeout_under_trio(backend: str) -> None:
    import trio

    async with open_sandbox(SandboxConfig(backend=backend, timeout_s=1, formatter="mini-swe-agent")) as sb:
        fork = await sb.fork()
        assert (
            await fork.execute(Action.bash("echo hi > /tmp/x; cat /tmp/x"))
            == "<returncode>0</returncode>\n<output>\nhi\n</output>"
        )
        await sb.commit(fork)
        assert (await sb.run("cat /tmp/x")).output == "hi\n"
        assert (await sb.run("sleep 10")).timed_out
        other = await sb.fork()
        with trio.move_on_after(1):
            await other.run("sleep 20", timeout=30)
        await other.discard()
        assert (await sb.run("ps -o args | grep -c '^sleep' || true")).output == "0\n"
