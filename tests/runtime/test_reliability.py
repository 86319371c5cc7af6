"""Many fork/execute/discard cycles leave nothing behind: no mounts, processes, cgroups,
file descriptors, state directories or containers. (scripts/bench_runtime.py
--cycles 10000 runs the long version and reports the same counts.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aospec.runtime import SandboxConfig, default_state_root, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support
from aospec.runtime.processes import marked_processes

pytestmark = pytest.mark.anyio


def resources() -> dict[str, int]:
    """What a leak would grow: our mounts, child processes, cgroups, fds, state dirs."""
    _, cgroups = host_support()
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if _exists(fd)]
    return {
        "mounts": len(mounts_under(str(default_state_root()))),
        "children": len(children),
        "cgroups": sum(len(list(r.glob("aospec-*"))) for r in set(cgroups.roots.values())) if cgroups else 0,
        "fds": sum(not link.startswith("socket:") for link in links),
        "sockets": sum(link.startswith("socket:") for link in links),
        "state_dirs": len(list(default_state_root().iterdir())) if default_state_root().exists() else 0,
    }


def _exists(fd: str) -> bool:
    try:
        os.readlink(f"/proc/self/fd/{fd}")
        return True
    except OSError:
        return False


def _same(before: dict[str, int], after: dict[str, int]) -> None:
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert after["sockets"] <= before["sockets"] + 4, (before, after)  # HTTP connection pools
    # cgroups are counted host-wide: a store opened meanwhile may remove dead sessions'
    # cgroups (left by a killed process), never add one that outlives its sandbox
    assert after["cgroups"] <= before["cgroups"], (before, after)
    assert {k: v for k, v in after.items() if k not in ("fds", "sockets", "cgroups")} == {
        k: v for k, v in before.items() if k not in ("fds", "sockets", "cgroups")
    }


async def _cycles(sb, n: int) -> None:
    for i in range(n):
        fork = await sb.fork()
        await fork.run(f"echo {i} > /tmp/x; sleep 0 & true")
        await fork.discard()
        if i % 25 == 0:
            keep = await sb.fork()
            await keep.run(f"echo {i} > /tmp/kept")
            await sb.commit(keep)


@pytest.mark.slow
async def test_hundreds_of_overlay_cycles_leak_nothing(overlay: str) -> None:
    before = resources()
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        await _cycles(sb, 300)
        assert set(os.listdir(sb.store.path / "s")) <= {sb.sid}  # no fork left behind
        assert sb.store.layer_ids() == sorted(sb.store.head_layers)
        assert (await sb.run("cat /tmp/kept")).output == "275\n"
        store_id = sb.store.id
    _same(before, resources())
    assert not marked_processes(f"aospec-{store_id}-")


@pytest.mark.docker
@pytest.mark.slow
async def test_docker_cycles_leak_nothing(docker_backend: str) -> None:
    from aospec.runtime.daemon import docker_client

    client = docker_client()
    containers = len(client.containers.list(all=True))
    images = len(client.images.list(all=True))
    before = resources()  # after the listing, so this client's pooled connection is counted
    async with open_sandbox(SandboxConfig(backend=docker_backend)) as sb:
        await _cycles(sb, 12)
        assert len(client.containers.list(all=True)) == containers + 1
    for method in ("commit", "copy-upper"):
        async with open_sandbox(SandboxConfig(backend=docker_backend, docker_fork=method)) as sb:
            fork = await sb.fork()
            await fork.run("echo x > /tmp/x")
            await fork.discard()
    assert len(client.containers.list(all=True)) == containers
    assert len(client.images.list(all=True)) == images
    after = resources()
    client.close()
    _same(before, after)
