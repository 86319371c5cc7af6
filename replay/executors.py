"""Where a sweep's work runs: a small executor interface.

A sweep is a *job* -- a picklable callable from a work item (an index) to its result,
which may keep caches on itself (replay's drafter sets per fold) -- applied to every item.
An :class:`Executor` runs a job over items and yields ``(item, result)`` as each completes;
the job travels to each worker once, not once per item. An exception raised by the job
is re-raised by the executor (the remaining work is stopped).

- :class:`InlineExecutor`: in this process, in the given order.
- :class:`LocalProcessExecutor`: a pool of worker processes on this machine; each serves
  items one at a time, as it becomes free.

A distributed executor (e.g. Ray actors on many nodes) implements the same one method.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, TypeVar

from aospec.errors import ConfigError

__all__ = ["Executor", "InlineExecutor", "LocalProcessExecutor", "WorkerDied", "local_executor"]

R = TypeVar("R")


class WorkerDied(RuntimeError):
    """A worker process ended without returning its item's result (killed, out of memory)."""


class Executor(Protocol):
    """Runs ``job(item)`` for every item; yields ``(item, result)`` as each completes."""

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]: ...


class InlineExecutor:
    """Every item in this process, in order."""

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]:
        for item in items:
            yield item, job(item)


def _serve(job: Callable[[int], Any], conn: Connection) -> None:
    """A worker: receive items until None, send back ``(item, ok, result or exception)``."""
    while (item := conn.recv()) is not None:
        try:
            reply = (item, True, job(item))
        except BaseException as exc:  # sent back to the parent, which re-raises it
            reply = (item, False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # the result or the exception could not be pickled
            conn.send((item, False, RuntimeError(f"the result of item {item} could not be sent back: {exc!r}")))
    conn.close()


class LocalProcessExecutor:
    """``workers`` processes on this machine; the job is handed to each when it starts."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ConfigError(f"an executor needs at least one worker, got {workers}")
        self.workers = workers

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]:
        todo = deque(items)
        if not todo:
            return
        ctx = multiprocessing.get_context()
        procs: dict[Connection, multiprocessing.process.BaseProcess] = {}
        busy: dict[Connection, int] = {}
        ok = False
        try:
            for _ in range(min(self.workers, len(todo))):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(job, child), name="aospec-sweep-worker")
                proc.start()
                child.close()
                procs[parent] = proc
                busy[parent] = todo.popleft()
                parent.send(busy[parent])
            by_sentinel = {proc.sentinel: conn for conn, proc in procs.items()}
            while busy:
                waiting: list[Any] = [*busy, *(procs[c].sentinel for c in busy)]
                for ready in wait(waiting):
                    conn = by_sentinel.get(ready, ready)
                    if conn not in busy:
                        continue  # already served in this round
                    try:
                        item, succeeded, value = conn.recv()
                    except (EOFError, OSError):
                        proc = procs[conn]
                        proc.join(timeout=5)
                        raise WorkerDied(
                            f"sweep worker {proc.pid} died (exit code {proc.exitcode}) while working on item {busy[conn]}"
                        ) from None
                    del busy[conn]
                    if not succeeded:
                        raise value
                    if todo:
                        busy[conn] = todo.popleft()
                        conn.send(busy[conn])
                    yield item, value
            ok = True
        finally:
            for conn, proc in procs.items():
                if ok:
                    with contextlib.suppress(OSError):  # a worker that already exited needs no stop
                        conn.send(None)
                conn.close()
                proc.join(timeout=10 if ok else 0)
                if proc.is_alive():
                    proc.terminate()
                    proc.join()


def local_executor(jobs: int) -> Executor:
    """The executor for ``jobs`` local workers: inline for one."""
    return InlineExecutor() if jobs == 1 else LocalProcessExecutor(jobs)
