"""Sweep executors: where the work of a sweep runs, and that results do not depend on it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import pytest
from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.executors import InlineExecutor, LocalProcessExecutor, SweepTaskError, local_executor
from aospec.replay.policies import parse_policies
from aospec.replay.sweep import run_sweep

from aospec.errors import ConfigError


class CountingJob:
    """Squares an item; remembers how many items this copy of the job has served."""

    def __init__(self) -> None:
        self.served = 0

    def __call__(self, item: int) -> tuple[int, int, int]:
        self.served += 1
        if item == 13:
            raise ValueError("unlucky item 13")
        if item == 66:
            os._exit(3)
        return item * item, os.getpid(), self.served


def test_inline_and_local_pool_run_every_item_once():
    items = list(range(8))
    inline = dict(InlineExecutor().map_unordered(CountingJob(), items))
    pooled = dict(LocalProcessExecutor(2).map_unordered(CountingJob(), items))
    assert {i: r[0] for i, r in inline.items()} == {i: r[0] for i, r in pooled.items()} == {i: i * i for i in items}
    # each worker got the job once and kept its state from one item to the next
    served = {}
    for _, pid, count in pooled.values():
        served[pid] = max(served.get(pid, 0), count)
    assert sum(served.values()) == len(items) and os.getpid() not in served


def test_an_error_in_the_job_is_retried_once_then_raised_by_the_executor():
    for executor in (InlineExecutor(), LocalProcessExecutor(2)):
        with pytest.raises(SweepTaskError, match="item 13: failed 2 times: ValueError: unlucky item 13") as info:
            list(executor.map_unordered(CountingJob(), [1, 13, 2, 3]))
        assert isinstance(info.value.__cause__, ValueError) and info.value.attempts == 2
    with pytest.raises(SweepTaskError, match="item 13: failed 1 time: ValueError"):
        list(InlineExecutor(retries=0).map_unordered(CountingJob(), [13]))


def test_a_worker_that_dies_is_replaced_then_reported_with_its_item():
    with pytest.raises(SweepTaskError, match=r"item 66: failed 2 times: WorkerDied: .*exit code 3\) while working on item 66"):
        list(LocalProcessExecutor(2).map_unordered(CountingJob(), [1, 66, 2]))


def test_local_executor_is_inline_for_one_job_and_rejects_none():
    assert isinstance(local_executor(1), InlineExecutor)
    assert isinstance(local_executor(3), LocalProcessExecutor)
    with pytest.raises(ConfigError, match="at least one worker"):
        LocalProcessExecutor(0)


class ReversedExecutor:
    """A third-party executor: the items in reverse order, in this process."""

    def map_unordered(self, job: Callable[[int], object], items: Sequence[int]) -> Iterator[tuple[int, object]]:
        for item in reversed(items):
            yield item, job(item)


def test_sweep_results_do_not_depend_on_the_executor():
    traces = load_traces([bundled_traces_path()])[:4]
    policies = parse_policies(["serial", "aospec"])
    inline = run_sweep(traces, policies, tpots_ms=[10.0], executor=InlineExecutor())
    other = run_sweep(traces, policies, tpots_ms=[10.0], executor=ReversedExecutor())
    pooled = run_sweep(traces, policies, tpots_ms=[10.0], jobs=2)
    assert inline == other == pooled
