"""The Ray sweep executor on a two-node Ray cluster on loopback: the bundled sample's sweep
equals the local executor's, record for record, with work on both nodes."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from aospec.replay.executors_ray import RayExecutor  # noqa: E402


def test_a_sweep_on_a_two_node_cluster_equals_the_local_sweep(two_node_cluster, sweep_reference, sweep_on) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    executor = RayExecutor()  # one worker per CPU of the cluster: one on each node
    assert executor._size(ray, 10) == 2
    assert sweep_on(executor) == sweep_reference
