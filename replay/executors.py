"""Where a sweep's work runs: a small executor interface.

A sweep is a *job* -- a picklable callable from a work item (an index) to its result,
which may keep caches on itself (replay's drafter sets per fold) -- applied to every item.
An :class:`Executor` runs a job over items and yields ``(item, result)`` as each completes;
the job travels to each worker once, not once per item. An exception raised by the job
is retried once (``retries``); when it fails again the executor raises
:class:`SweepTaskError` naming the item (for a sweep: its trace, and the policy and TPOT
that failed when the replay knows them, else every policy and TPOT of the item), with the
last error as its cause; the remaining work is stopped.

- :class:`InlineExecutor`: in this process, in the given order.
- :class:`LocalProcessExecutor`: a pool of worker processes on this machine; each serves
  items one at a time, as it becomes free. A worker that dies (killed, out of memory)
  fails its item (:class:`WorkerDied`); a fresh worker takes the retry.

A distributed executor (e.g. Ray actors on many nodes) implements the same one method.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, TypeVar

from aospec.errors import AospecError, ConfigError

__all__ = [
    "Executor",
    "InlineExecutor",
    "LocalProcessExecutor",
    "SweepTaskError",
    "WorkerDied",
    "describe_failure",
    "describe_item",
    "local_executor",
]

R = TypeVar("R")


class WorkerDied(RuntimeError):
    """A worker process ended without returning its item's result (killed, out of memory)."""


class SweepTaskError(AospecError):
    """A sweep item failed on every try; names its trace, policies and TPOTs.

    ``policies`` and ``tpots_ms`` are the policy and TPOT whose replay failed when the
    replay knew them (one each), else every policy and TPOT of the item."""

    def __init__(
        self,
        message: str,
        *,
        item: int,
        trace_id: str | None,
        policies: list[str],
        tpots_ms: list[float],
        attempts: int = 0,
    ) -> None:
        super().__init__(message)
        self.item = item
        self.trace_id = trace_id
        self.policies = policies
        self.tpots_ms = tpots_ms
        self.attempts = attempts

    def __reduce__(self) -> Any:  # keyword-only fields: picklable all the same
        return (
            _rebuild_task_error,
            (str(self), self.item, self.trace_id, self.policies, self.tpots_ms, self.attempts),
        )


def _rebuild_task_error(
    message: str, item: int, trace_id: str | None, policies: list[str], tpots_ms: list[float], attempts: int
) -> SweepTaskError:
    return SweepTaskError(
        message, item=item, trace_id=trace_id, policies=policies, tpots_ms=tpots_ms, attempts=attempts
    )


def describe_item(job: Any, item: int) -> tuple[str | None, list[str], list[float]]:
    """The trace id, policy names and TPOTs of ``job(item)`` (a SweepJob), else (None, [], [])."""
    try:
        trace_id = str(job.eval_traces[item].id)
    except (AttributeError, IndexError, TypeError):
        return None, [], []
    policies = [str(getattr(p, "name", p)) for p in getattr(job, "policies", ())]
    tpots = [float(t) for t in getattr(job, "tpots_ms", ())]
    return trace_id, policies, tpots


def describe_failure(
    job: Any, item: int, attempts: int, cause: BaseException, where: str = ""
) -> SweepTaskError:
    """The SweepTaskError for ``item`` of ``job`` after ``attempts`` failed tries; the policy
    and TPOT come from ``cause.sweep_where`` (set by :func:`aospec.replay.sweep.replay_trace`) when
    the failure happened inside one replay."""
    trace_id, policies, tpots = describe_item(job, item)
    at = getattr(cause, "sweep_where", None)
    if trace_id is not None and isinstance(at, tuple) and len(at) == 3:
        policies, tpots = [str(at[1])], [float(at[2])]
    if trace_id is None:
        what = f"item {item}"
    else:
        what = (
            f"trace {trace_id!r}, {'policy' if len(policies) == 1 else 'policies'} {', '.join(policies)}, "
            f"{'TPOT' if len(tpots) == 1 else 'TPOTs'} {', '.join(f'{t:g}' for t in tpots)} ms"
        )
    return SweepTaskError(
        f"{what}: failed {attempts} time{'s' if attempts != 1 else ''}{where}: {type(cause).__name__}: {cause}",
        item=item,
        trace_id=trace_id,
        policies=policies,
        tpots_ms=tpots,
        attempts=attempts,
    )


def _check_retries(retries: int) -> int:
    if not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
    return retries


class Executor(Protocol):
    """Runs ``job(item)`` for every item; yields ``(item, result)`` as each completes."""

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]: ...


class InlineExecutor:
    """Every item in this process, in order; a failed item is tried again ``retries`` times."""

    def __init__(self, retries: int = 1) -> None:
        self.retries = _check_retries(retries)

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]:
        for item in items:
            attempts = 0
            while True:
                try:
                    result = job(item)
                except Exception as exc:
                    attempts += 1
                    if attempts > self.retries:
                        raise describe_failure(job, item, attempts, exc) from exc
                    continue
                break
            yield item, result


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
    """``workers`` processes on this machine; the job is handed to each when it starts. A
    failed item is tried again ``retries`` times (on a fresh worker when its worker died)."""

    def __init__(self, workers: int, retries: int = 1) -> None:
        if workers < 1:
            raise ConfigError(f"an executor needs at least one worker, got {workers}")
        self.workers = workers
        self.retries = _check_retries(retries)

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]:
        todo = deque(items)
        if not todo:
            return
        ctx = multiprocessing.get_context()
        procs: dict[Connection, multiprocessing.process.BaseProcess] = {}
        busy: dict[Connection, int] = {}
        by_sentinel: dict[Any, Connection] = {}
        failures: dict[int, int] = {}
        ok = False

        def start(item: int) -> None:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(job, child), name="aospec-sweep-worker")
            proc.start()
            child.close()
            procs[parent] = proc
            by_sentinel[proc.sentinel] = parent
            busy[parent] = item
            parent.send(item)

        try:
            for _ in range(min(self.workers, len(todo))):
                start(todo.popleft())
            while busy:
                waiting: list[Any] = [*busy, *(procs[c].sentinel for c in busy)]
                for ready in wait(waiting):
                    conn = by_sentinel.get(ready, ready)
                    if conn not in busy:
                        continue  # already served in this round
                    item = busy.pop(conn)
                    try:
                        _, succeeded, value = conn.recv()
                    except (EOFError, OSError):
                        proc = procs.pop(conn)
                        proc.join(timeout=5)
                        conn.close()
                        error: BaseException = WorkerDied(
                            f"sweep worker {proc.pid} died (exit code {proc.exitcode}) while working on item {item}"
                        )
                        failures[item] = failures.get(item, 0) + 1
                        if failures[item] > self.retries:
                            raise describe_failure(job, item, failures[item], error) from error
                        start(item)  # a fresh worker takes the retry
                        continue
                    if not succeeded:
                        if not isinstance(value, Exception):
                            raise value  # KeyboardInterrupt, SystemExit: not retried
                        failures[item] = failures.get(item, 0) + 1
                        if failures[item] > self.retries:
                            raise describe_failure(job, item, failures[item], value) from value
                        busy[conn] = item
                        conn.send(item)
                        continue
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


def local_executor(jobs: int, retries: int = 1) -> Executor:
    """The executor for ``jobs`` local workers: inline for one."""
    return InlineExecutor(retries) if jobs == 1 else LocalProcessExecutor(jobs, retries)
