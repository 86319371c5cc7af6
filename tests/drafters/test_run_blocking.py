"""aospec.drafters.backends.run_blocking: blocking model work for an async caller, on a
worker thread, never outliving the call, and its thread's CPU charged to the drafting round
of the engine's drafter call it runs for."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from aospec.drafters.backends import run_blocking

BACKENDS = ["asyncio", "trio"]


def _in_thread(fn, timeout_s: float = 20.0):
    """Run ``fn()`` on a thread; its result, or a failure when it does not end in time (a
    hang must fail the test, not the suite)."""
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s"
    return out[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_caller_cancelled_before_the_worker_starts_neither_waits_nor_runs_the_work(backend):
    ran = threading.Event()

    def work(stop):
        ran.set()
        return 1

    async def main():
        with anyio.CancelScope() as scope:
            scope.cancel()
            await run_blocking(work, offload="thread")
        return scope.cancelled_caught

    assert _in_thread(lambda: anyio.run(main, backend=backend)) is True
    time.sleep(0.1)
    assert not ran.is_set()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_caller_cancelled_while_the_work_runs_stops_it_and_waits_for_it(backend):
    started, finished = threading.Event(), threading.Event()

    def work(stop):
        started.set()
        while not stop.is_set():
            time.sleep(0.001)
        finished.set()
        return 1

    async def main():
        with anyio.move_on_after(0.2) as scope:
            await run_blocking(work, offload="thread")
        # nothing outlives the call: the work saw ``stop`` and ended before it returned
        return scope.cancelled_caught, finished.is_set()

    assert _in_thread(lambda: anyio.run(main, backend=backend)) == (True, True)
    assert started.is_set()
