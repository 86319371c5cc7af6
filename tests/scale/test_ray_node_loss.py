"""A real node loss: the worker node of a two-node loopback cluster is removed while a
sandbox session lives on it. Its session fails with NodeLostError naming the node; the
session on the head node goes on; what the dead node's host left is cleaned by the gc
path (a host started on that node again, here the same collection run directly)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from aospec.runtime._fs import mounts_under  # noqa: E402
from aospec.runtime.gc import collect_garbage  # noqa: E402
from aospec.runtime.ray_backend import NodeLostError, RayOptions, RaySandboxCluster  # noqa: E402

from aospec.types import Action  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.root]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster(two_node_cluster, scale_dirs: dict[str, Path]) -> Iterator[RaySandboxCluster]:
    from aospec.runtime import build_base
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    if problems:
        pytest.skip(f"overlay sandbox cannot run here: {'; '.join(problems)}")
    build_base("busybox")
    c = RaySandboxCluster(
        RayOptions(state_root=str(scale_dirs["state"]), cache_dir=str(scale_dirs["cache"]), placement_timeout_s=5)
    )
    try:
        yield c
    finally:
        c.shutdown()
        for root in scale_dirs["state"].glob("ray-*"):
            collect_garbage(root, docker=False)  # what the removed node's host left
        leaked = mounts_under(str(scale_dirs["state"]))
        assert not leaked, f"mounts leaked: {leaked}"


async def test_a_removed_node_fails_its_session_and_spares_the_other(two_node_cluster, cluster) -> None:
    head_id = two_node_cluster.head_node.node_id
    worker = next(n for n in two_node_cluster.worker_nodes)
    async with cluster.open() as a, cluster.open() as b:
        on_worker, on_head = (a, b) if a.node_id == worker.node_id else (b, a)
        assert on_head.node_id == head_id and on_worker.node_id == worker.node_id
        await on_head.execute(Action.bash("echo kept > /tmp/k"))
        kept = on_head.version
        fork = await on_worker.fork()
        two_node_cluster.remove_node(worker)
        with pytest.raises(NodeLostError, match=f"node {worker.node_id[:12]}"):
            await fork.execute(Action.bash("true"))
        with pytest.raises(NodeLostError):
            await on_worker.execute(Action.bash("true"))
        assert on_head.version == kept
        assert "kept" in await on_head.execute(Action.bash("cat /tmp/k"))
        # new sessions go to the node that is left
        async with cluster.open() as c:
            assert c.node_id == head_id
    assert [x["node_id"] for x in cluster.loads()] == [head_id]
    assert all(x["sessions"] == 0 and x["live_sandboxes"] == 0 for x in cluster.loads())
