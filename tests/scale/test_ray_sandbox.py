"""The Ray sandbox backend (runtime/ray_backend.py) on a two-node Ray cluster on loopback.

The runtime conformance suite (tests/runtime/test_conformance.py) runs here unchanged on
the Ray backend: its test functions are imported and their fixtures (``opener``,
``any_sandbox``, ``sandbox``, ``backend``) are defined below to open Ray sandboxes. Then
what the Ray backend adds: placement on both nodes, forks on their parent's node,
back-pressure, node loss, and an engine run equal to the same run on the local backend."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("ray")

from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.ray_backend import (
    ClusterFullError,
    NodeLostError,
    RayOptions,
    RaySandbox,
    RaySandboxCluster,
    set_default_cluster,
)

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.errors import SandboxError
from aospec.protocols import ActionDraft, ObservationDraft, Sandbox
from aospec.testing import ScriptedActionDrafter, ScriptedActor, ScriptedObservationDrafter
from aospec.types import Action, History

pytestmark = [pytest.mark.anyio, pytest.mark.root]

RAY_BACKEND = "aospec.runtime.ray_backend:open_ray"


def _conformance_tests() -> dict[str, object]:
    path = Path(__file__).parents[1] / "runtime" / "test_conformance.py"
    spec = importlib.util.spec_from_file_location("_aospec_conformance_for_ray", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {name: fn for name, fn in vars(mod).items() if name.startswith("test_") and callable(fn)}


globals().update(_conformance_tests())


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster(two_node_cluster: object, scale_dirs: dict[str, Path]) -> Iterator[RaySandboxCluster]:
    from aospec.runtime.host import host_support

    problems = host_support()[0].problems()
    if problems:
        pytest.skip(f"overlay sandbox cannot run here: {'; '.join(problems)}")
    from aospec.runtime import build_base

    build_base("busybox")  # once, before two node hosts would race to build it
    c = RaySandboxCluster(
        RayOptions(state_root=str(scale_dirs["state"]), cache_dir=str(scale_dirs["cache"]), placement_timeout_s=5)
    )
    set_default_cluster(c)
    try:
        yield c
    finally:
        set_default_cluster(None)
        c.shutdown()
        leaked = mounts_under(str(scale_dirs["state"]))
        assert not leaked, f"mounts leaked by the Ray sandbox tests: {leaked}"


# the conformance suite's fixtures, on the Ray backend


@pytest.fixture
def backend(cluster: RaySandboxCluster) -> str:
    return RAY_BACKEND


@pytest.fixture
def opener(cluster: RaySandboxCluster):  # type: ignore[no-untyped-def]
    return lambda: cluster.open(SandboxConfig(timeout_s=20, formatter="mini-swe-agent"))


@pytest.fixture
async def any_sandbox(cluster: RaySandboxCluster) -> AsyncIterator[Sandbox]:
    async with cluster.open(SandboxConfig(timeout_s=20, formatter="mini-swe-agent")) as sb:
        yield sb


@pytest.fixture
async def sandbox(cluster: RaySandboxCluster) -> AsyncIterator[RaySandbox]:
    async with open_sandbox(SandboxConfig(backend=RAY_BACKEND, timeout_s=20)) as sb:
        yield sb


# ---------------------------------------------------------------------- what Ray adds


async def test_sessions_spread_over_both_nodes_and_forks_stay_on_their_parents_node(
    cluster: RaySandboxCluster,
) -> None:
    async with cluster.open() as a, cluster.open() as b:
        assert {a.node_id, b.node_id} == {n["node_id"] for n in cluster.nodes()}
        fork = await a.fork()
        grandchild = await fork.fork()
        assert fork.node_id == grandchild.node_id == a.node_id
        loads = {x["node_id"]: x for x in cluster.loads()}
        assert loads[a.node_id]["live_sandboxes"] == 3 and loads[b.node_id]["live_sandboxes"] == 1
    loads = cluster.loads()
    assert all(x["sessions"] == 0 and x["live_sandboxes"] == 0 for x in loads), loads


async def test_a_full_cluster_pushes_back_with_a_clear_error(scale_dirs: dict[str, Path], cluster) -> None:
    full = RaySandboxCluster(
        RayOptions(
            namespace="aospec-tests-full",
            state_root=str(scale_dirs["state"] / "full"),
            cache_dir=str(scale_dirs["cache"]),
            sessions_per_cpu=1,
            max_live_sandboxes=2,
            placement_timeout_s=0.5,
        )
    )
    try:
        async with full.open() as a, full.open() as b:
            assert a.node_id != b.node_id
            with pytest.raises(ClusterFullError, match=r"no Ray node had room .*1/1 sessions"):
                async with full.open():
                    pass
            fork = await a.fork()  # the node's second live sandbox: its last slot
            with pytest.raises(ClusterFullError, match="2/2 live sandboxes"):
                await a.fork()
            # a fork waiting for a slot gets the one a discard frees
            got: list[RaySandbox] = []

            async def fork_when_free() -> None:
                got.append(await a.fork())

            async with anyio.create_task_group() as tg:
                tg.start_soon(fork_when_free)
                await anyio.sleep(0.1)
                await fork.discard()
            assert got and got[0].node_id == a.node_id
        # a session that closes frees its slot for the next
        async with full.open() as c, full.open() as d:
            assert c.node_id != d.node_id
    finally:
        full.shutdown()
    # its hosts shut down: the nodes' state roots they made are gone with them
    assert list((scale_dirs["state"] / "full").glob("ray-*")) == []


POOL = [
    Action.bash(c)
    for c in (
        "ls /work",
        "cat /work/a",
        "echo one >> /work/a",
        "echo two > /work/b",
        "rm -f /work/b",
        "sleep 0.05; wc -l /work/a",
        "mkdir -p /work/d && echo x > /work/d/f",
        "cat /work/b 2>&1; echo done",
    )
]
SNAPSHOT = Action.bash("cd /work && find . | sort && cat a")


async def _engine_run(sb: Sandbox, seed: int, speculate: bool) -> tuple[History, str, str, int]:
    actor = ScriptedActor.hashing(POOL, seed=seed, delay_s=0.01)
    rng = random.Random(seed)
    await sb.execute(Action.bash("mkdir -p /work && echo zero > /work/a"))

    def observations(h: History, a: Action) -> list[ObservationDraft]:
        guess = f"<returncode>0</returncode>\n<output>\n{rng.choice(['', 'zero', 'one'])}\n</output>"
        return [ObservationDraft(guess, 0.5), ObservationDraft("<returncode>0</returncode>\n<output>\n</output>", 0.4)]

    def actions(h: History) -> list[ActionDraft]:
        return [ActionDraft(rng.choice(POOL), rng.randrange(2), rng.random()) for _ in range(4)]

    if speculate:
        engine = Engine(
            actor,
            sb,
            observation_drafters=[ScriptedObservationDrafter(observations)],
            action_drafters=[ScriptedActionDrafter(actions)],
            config=EngineConfig(branch_budget=2, fork_width=4, depth=2),
        )
    else:
        engine = Engine(actor, sb)
    history = await engine.run(History("live"), steps=10)
    version = sb.version
    snapshot = await sb.execute(SNAPSHOT)
    return history, version, snapshot, engine.statistics().forks_launched


@pytest.mark.parametrize("seed", [1, 2])
async def test_an_engine_run_on_ray_equals_the_same_run_on_the_local_backend(cluster, seed: int) -> None:
    async with open_sandbox(backend="overlay", timeout_s=10) as local:
        serial = await _engine_run(local, seed, speculate=False)
    async with cluster.open(timeout_s=10) as remote:
        on_ray = await _engine_run(remote, seed, speculate=True)
    assert on_ray[3] > 0, "the speculative run launched no forks"
    assert on_ray[0] == serial[0], "committed trajectories differ"
    assert on_ray[1] == serial[1], "final filesystem versions differ"
    assert on_ray[2] == serial[2], "final filesystem contents differ"
    assert all(x["live_sandboxes"] == 0 for x in cluster.loads())


async def test_a_lost_host_fails_its_session_clearly_and_spares_the_other_node(cluster, scale_dirs) -> None:
    import ray

    async with cluster.open() as a, cluster.open() as b:
        assert a.node_id != b.node_id
        await b.execute(Action.bash("echo kept > /tmp/k"))
        kept = b.version
        fork = await a.fork()
        ray.kill(cluster.host(a.node_id))  # the node's host dies with everything on it
        with pytest.raises(NodeLostError, match=f"node {a.node_id[:12]}") as lost:
            await fork.execute(Action.bash("true"))
        assert lost.value.node_id == a.node_id and isinstance(lost.value, SandboxError)
        with pytest.raises(NodeLostError):
            await a.fork()
        # the other node's session is untouched
        assert b.version == kept and "kept" in await b.execute(Action.bash("cat /tmp/k"))
        side = await b.fork()
        await b.commit(side)
    # closing the lost session is quiet; the next session may land on the lost node again,
    # whose new host cleans what the dead one left (the gc path)
    reports = cluster.gc()
    assert len(reports) == 2
    dead_root = next(r for r in cluster.loads() if r["node_id"] == a.node_id)["state_root"]
    assert mounts_under(dead_root) == []
    assert all(x["sessions"] == 0 and x["live_sandboxes"] == 0 for x in cluster.loads())


async def test_idle_sessions_are_collected(cluster) -> None:
    root = await cluster.open_session(SandboxConfig())
    await root.fork()
    reports = cluster.gc(idle_s=0.0)
    assert sum(len(r["closed_sessions"]) for r in reports) == 1
    with pytest.raises(SandboxError):
        await root.execute(Action.bash("true"))
    await root.aclose()
    assert all(x["sessions"] == 0 and x["live_sandboxes"] == 0 for x in cluster.loads())
