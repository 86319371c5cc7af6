"""The Ray sweep executor (replay/executors_ray.py) on a local Ray (``ray.init``, two CPUs):
results equal the local executor's record for record; failures are retried once, then
reported by trace, policy and TPOT."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from aospec.replay.executors_ray import RayExecutor, SweepTaskError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test jobs travel by value


def test_a_sweep_on_a_local_ray_equals_the_local_sweep(local_ray, sweep_reference, sweep_on) -> None:
    assert sweep_on(RayExecutor(workers=2)) == sweep_reference


class FlakyJob:
    """Fails item 1 the first time (any worker), then succeeds; item 2 always fails."""

    def __init__(self, marker: str, kill: bool = False) -> None:
        self.marker = marker
        self.kill = kill

    def __call__(self, item: int) -> int:
        if item == 2:
            raise ValueError("item 2 is broken")
        if item == 1 and not os.path.exists(self.marker):
            Path(self.marker).write_text("failed once")
            if self.kill:
                os._exit(3)  # the worker dies: a fresh actor takes the retry
            raise RuntimeError("transient")
        return item * 10


@pytest.mark.parametrize("kill", [False, True])
def test_a_failed_item_is_retried_once(local_ray, tmp_path: Path, kill: bool) -> None:
    job = FlakyJob(str(tmp_path / "marker"), kill=kill)
    got = dict(RayExecutor(workers=2).map_unordered(job, [0, 1, 3, 4]))
    assert got == {0: 0, 1: 10, 3: 30, 4: 40}
    assert (tmp_path / "marker").exists()


def test_an_item_that_fails_twice_is_reported(local_ray, tmp_path: Path) -> None:
    with pytest.raises(SweepTaskError, match="item 2: failed 2 times on Ray: ValueError: item 2 is broken"):
        dict(RayExecutor(workers=2).map_unordered(FlakyJob(str(tmp_path / "m")), [0, 2, 3]))


class BrokenSweepJob:
    """Looks like a SweepJob (traces, policies, TPOTs) and fails on trace 1."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.eval_traces = [SimpleNamespace(id="t0"), SimpleNamespace(id="t1")]
        self.policies = [SimpleNamespace(name="aospec"), SimpleNamespace(name="serial")]
        self.tpots_ms = [20.0, 1.0]

    def __call__(self, item: int) -> int:
        if item == 1:
            raise RuntimeError("boom")
        return item


def test_a_failure_names_the_trace_policies_and_tpots(local_ray) -> None:
    with pytest.raises(SweepTaskError) as info:
        list(RayExecutor(workers=1).map_unordered(BrokenSweepJob(), [0, 1]))
    err = info.value
    assert "trace 't1', policies aospec, serial, TPOTs 20, 1 ms" in str(err)
    assert (err.trace_id, err.policies, err.tpots_ms) == ("t1", ["aospec", "serial"], [20.0, 1.0])


def test_results_stream_as_items_finish(local_ray) -> None:
    it = RayExecutor(workers=2).map_unordered(lambda i: i + 1, list(range(6)))
    first = next(it)
    assert first[1] == first[0] + 1
    rest = dict(it)
    assert len(rest) == 5 and all(v == k + 1 for k, v in rest.items())
