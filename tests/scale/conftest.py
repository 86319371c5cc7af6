"""Fixtures for the scale-out tests: a small Ray cluster per test module (two nodes on
loopback, one CPU each), always shut down, and private base cache and state roots."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def scale_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A base cache and a state root of this module (in the driver's environment too)."""
    cache = tmp_path_factory.mktemp("aospec-cache")
    state = tmp_path_factory.mktemp("aospec-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(cache))
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield {"cache": cache, "state": state}
    mp.undo()


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[object]:
    """A two-node Ray cluster on this host (loopback), this process connected as driver."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="aospec-tests", log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[object]:
    """A one-node local Ray (``ray.init``), two CPUs."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="aospec-tests", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def raylets_of(pid: int) -> list[int]:
    """Processes descended from ``pid`` (what a leaked cluster would leave)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


SWEEP_POLICIES = "serial,aospec"
SWEEP_TPOTS = (20.0, 1.0)


def bundled_traces() -> list[object]:
    from aospec.replay import load_traces

    return list(load_traces(Path(__file__).resolve().parents[2] / "replay" / "data" / "tb1-sample"))


@pytest.fixture(scope="session")
def sweep_reference() -> list[dict[str, object]]:
    """The bundled sample swept in this process (the local executor): the records to match."""
    from aospec.replay.executors import InlineExecutor
    from aospec.replay.policies import parse_policies
    from aospec.replay.sweep import run_sweep

    results = run_sweep(
        bundled_traces(), parse_policies(SWEEP_POLICIES), tpots_ms=SWEEP_TPOTS, executor=InlineExecutor()
    )
    return [r.to_json() for r in results]


def _sweep_on(executor: object) -> list[dict[str, object]]:
    from aospec.replay.policies import parse_policies
    from aospec.replay.sweep import run_sweep

    results = run_sweep(bundled_traces(), parse_policies(SWEEP_POLICIES), tpots_ms=SWEEP_TPOTS, executor=executor)
    return [r.to_json() for r in results]


@pytest.fixture(scope="session")
def sweep_on():  # type: ignore[no-untyped-def]
    """Sweep the bundled sample (the reference's policies and TPOTs) with an executor."""
    return _sweep_on
