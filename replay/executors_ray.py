"""A sweep executor on a Ray cluster (issue 14, section 1).

Implements the executor interface of :mod:`aospec.replay.executors` (``map_unordered(job, items)``
yields ``(item, result)`` as each item completes) with Ray actors::

    from aospec.replay.executors_ray import RayExecutor
    results = run_sweep(traces, policies, executor=RayExecutor(address="auto"))

- The job (a :class:`aospec.replay.sweep.SweepJob`: the traces, policies and TPOTs; from
  ``aospec sweep``, the evaluation traces as :class:`aospec.replay.sweep.TraceRef`, each read by
  the actor that replays it) is put in the object store once; each worker actor (``num_cpus=1``, one per CPU of the cluster unless
  ``workers`` is given) receives it once and keeps its caches (a fold's drafters are fit
  once per worker, as in a local worker process).
- Each worker serves one item at a time, so at most ``workers`` items are in flight and
  the driver holds only their references: memory on the driver stays bounded however
  many items there are. Results stream back as they finish (``ray.wait``).
- A failed item is retried once (on a fresh actor when its actor died: a lost node, an
  out-of-memory kill); a second failure raises :class:`aospec.replay.executors.SweepTaskError`,
  naming the trace, and the policy and TPOT that failed (every policy and TPOT of the item
  when the failure was outside a replay; for a job that is not a SweepJob: the item), as
  the local executors do.

``address``: ``None`` uses the Ray this process is connected to, else starts a local one
of its own (``ray.init(address="local")``, stopped by :meth:`RayExecutor.close`); ``"auto"`` or ``"ray://HOST:PORT"`` connect to a cluster. Ray is an
optional dependency (``pip install 'aospec[ray]'``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from aospec.replay.executors import SweepTaskError, describe_failure, describe_item

from aospec.errors import ConfigError, MissingDependencyError

__all__ = ["RayExecutor", "SweepTaskError", "describe_item", "require_ray"]

R = TypeVar("R")


def require_ray() -> None:
    """MissingDependencyError (naming ``pip install 'aospec[ray]'``) unless Ray imports."""
    _ray()


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError("the Ray sweep executor needs Ray: pip install 'aospec[ray]'") from exc
    return ray


class SweepWorker:
    """A Ray actor holding the job; ``run(item)`` is ``job(item)``."""

    def __init__(self, job: Callable[[int], Any]) -> None:
        self.job = job

    def run(self, item: int) -> Any:
        return self.job(item)


class RayExecutor:
    """Runs a sweep job's items on Ray actors; see the module docstring."""

    def __init__(
        self,
        address: str | None = None,
        *,
        workers: int | None = None,
        retries: int = 1,
        namespace: str | None = None,
    ) -> None:
        if workers is not None and workers < 1:
            raise ConfigError(f"an executor needs at least one worker, got {workers}")
        if retries < 0:
            raise ConfigError(f"retries must be >= 0, got {retries}")
        self.address = address
        self.workers = workers
        self.retries = retries
        self.namespace = namespace
        self.started_ray = False  # this executor called ray.init (and shuts it down in close())

    def connect(self) -> Any:
        ray = _ray()
        if not ray.is_initialized():
            local = {"include_dashboard": False} if self.address is None else {}
            # "local": a new Ray of this process's own, never another one found on the host
            address = self.address if self.address is not None else "local"
            ray.init(address=address, namespace=self.namespace, log_to_driver=False, **local)
            self.started_ray = self.address is None
        return ray

    def close(self) -> None:
        """Disconnect from Ray if this executor connected (a local Ray it started stops)."""
        ray = _ray()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False

    def _size(self, ray: Any, n_items: int) -> int:
        if self.workers is not None:
            return min(self.workers, n_items)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        return max(1, min(cpus, n_items))

    def map_unordered(self, job: Callable[[int], R], items: Sequence[int]) -> Iterator[tuple[int, R]]:
        todo = deque(items)
        if not todo:
            return
        ray = self.connect()
        worker_cls = ray.remote(num_cpus=1, max_restarts=0)(SweepWorker)
        job_ref = ray.put(job)
        actors = [worker_cls.remote(job_ref) for _ in range(self._size(ray, len(todo)))]
        failures: dict[int, int] = {}
        in_flight: dict[Any, tuple[int, Any]] = {}

        def submit(actor: Any, item: int) -> None:
            in_flight[actor.run.remote(item)] = (item, actor)

        try:
            for actor in actors:
                if todo:
                    submit(actor, todo.popleft())
            while in_flight:
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                ref = ready[0]
                item, actor = in_flight.pop(ref)
                try:
                    result = ray.get(ref)
                except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                    died = isinstance(exc, ray.exceptions.RayActorError)
                    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause else exc
                    failures[item] = failures.get(item, 0) + 1
                    if died:  # a fresh actor for the retry and for the items after it
                        with contextlib.suppress(Exception):
                            ray.kill(actor)
                        actors.remove(actor)
                        actor = worker_cls.remote(job_ref)
                        actors.append(actor)
                    if failures[item] > self.retries:
                        raise self._failed(job, item, failures[item], cause) from (
                            cause if isinstance(cause, BaseException) else None
                        )
                    submit(actor, item)
                    continue
                if todo:
                    submit(actor, todo.popleft())
                yield item, result
        finally:
            for ref in in_flight:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)

    @staticmethod
    def _failed(job: Any, item: int, attempts: int, cause: BaseException) -> SweepTaskError:
        return describe_failure(job, item, attempts, cause, " on Ray")
