"""The prewarm pool: tool environments kept warm per tool type (issue 13, section 1).

An :class:`EnvironmentPool` holds environments with a real cold start (a sandbox store on a
base, an MCP-style server process) per tool type, each under one policy:

- ``reserved``: ``reserved`` environments are kept warm at all times (refilled after each
  acquire); never evicted below that number.
- ``on-demand``: started when acquired, stopped when released (every call pays the cold
  start; the baseline).
- ``speculative``: started by :meth:`EnvironmentPool.warm` (router events, Markov
  prefetch) and kept idle until acquired, idle-evicted, or evicted for budget. A
  ``floor`` of environments per type may be kept warm as under ``reserved`` (refilled
  after each acquire, spared by idle eviction); warm-ups come on top of it.

A budget (estimated memory bytes and a count over live environments) is enforced before
every start: idle speculative-warm environments are evicted first (least recently used),
then other idle ones above their reserved minimum; a warm-up that still does not fit is
skipped, an acquire waits for a release. Each tool's cold-start cost ``L_j`` is the EWMA
of its measured start times (:meth:`EnvironmentPool.cold_start_cost`).

Starts run in the pool's own task group, at most ``start_concurrency`` at once (default:
the cores this process may run on), starts an acquire waits for ahead of warm-ups. An
acquire waiting for a start takes an environment of its type released in the meantime;
the start it gave up is dropped while still queued unless its type needs it to keep its
reserve, and one already begun is stopped as soon as it is up when its type has an idle
environment (and its reserve) besides it; otherwise it ends as an idle warm environment.

:class:`PooledSandbox` is a pool-backed ``aospec.protocols.Sandbox``: ``fork()`` hands out a
fork made ahead of time when its version still equals the parent's (a stale one is
discarded, never handed out) and the ready queue is refilled in the background.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.abc

from aospec.errors import ConfigError, SandboxError
from aospec.protocols import Sandbox
from aospec.types import Action

__all__ = [
    "EnvSpec",
    "Environment",
    "EnvironmentPool",
    "PoolStats",
    "PooledSandbox",
    "ProcessEnv",
    "SandboxEnv",
    "demo_tool_spec",
    "host_cores",
    "prefetch_adapter",
    "pooled_sandbox",
    "process_rss_bytes",
    "process_tree_pids",
    "process_tree_rss_bytes",
    "router_adapter",
    "sandbox_spec",
]

Policy = Literal["reserved", "on-demand", "speculative"]
POLICIES = ("reserved", "on-demand", "speculative")


def host_cores() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there
    is none): the default number of environment starts the pool runs at once."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class EnvSpec:
    """One tool type. Either ``start``/``stop`` (an async factory and its teardown) or
    ``open`` (an async context manager factory; the pool holds it open in a task of its
    own). ``memory_bytes`` is the estimate the budget counts; ``rss`` (optional) measures
    a live environment's resident memory for reports. ``reserved`` is the number kept warm
    under ``reserved``, ``floor`` the number kept warm under ``speculative`` (0: none),
    ``max_warm`` the most idle or starting environments no acquire waits for that a
    warm-up may bring about."""

    name: str
    start: Callable[[], Awaitable[Any]] | None = None
    stop: Callable[[Any], Awaitable[None]] | None = None
    open: Callable[[], AbstractAsyncContextManager[Any]] | None = None
    memory_bytes: int = 0
    policy: Policy = "on-demand"
    reserved: int = 1
    max_warm: int = 1
    rss: Callable[[Any], int] | None = None
    floor: int = 0

    def __post_init__(self) -> None:
        if (self.start is None) == (self.open is None):
            raise ConfigError(f"EnvSpec {self.name!r}: give exactly one of start= or open=")
        if self.policy not in POLICIES:
            raise ConfigError(f"EnvSpec {self.name!r}: policy must be one of {POLICIES}")
        if self.floor and self.policy != "speculative":
            raise ConfigError(f"EnvSpec {self.name!r}: floor= is for the speculative policy (reserved= otherwise)")

    @property
    def kept_warm(self) -> int:
        """How many environments of this type the pool keeps warm at all times."""
        return self.reserved if self.policy == "reserved" else self.floor if self.policy == "speculative" else 0


@dataclass(eq=False)
class Environment:
    """A live environment. ``value`` is what the spec's factory returned. ``claimed``: an
    acquire waits for this start (or, started, is about to take it); ``used``: it has been
    acquired. ``given_up``: an acquire waited for this start and took another environment
    instead (a handoff); ``begun``: the start holds a slot (no longer queued)."""

    spec: EnvSpec
    value: Any = None
    state: Literal["starting", "idle", "busy", "stopped"] = "starting"
    speculative: bool = False
    used: bool = False
    claimed: bool = False
    given_up: bool = False
    begun: bool = False
    last_used: float = field(default_factory=time.monotonic)
    start_s: float = 0.0
    _stop_event: anyio.Event | None = None
    _done_event: anyio.Event | None = None
    _scope: anyio.CancelScope | None = None
    _error: BaseException | None = None

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class PoolStats:
    """Each acquire is one of ``hits`` (an idle environment), ``warm_waits`` (a warm-up it
    waited for), ``cold_starts`` (a start of its own) or ``handoffs`` (an environment
    released while it waited for a start; that start is counted in ``unclaimed_starts``,
    and of those in ``starts_dropped`` when dropped before it began, in
    ``unclaimed_stopped`` when stopped as soon as it was up; the rest end idle).
    ``starts_in_flight`` is now, ``peak_starts_in_flight`` at most (never above
    the pool's ``start_concurrency``); ``start_queue_s`` sums the time starts waited for a
    slot (not part of ``provisioning_s`` nor of ``L_j``)."""

    hits: int = 0
    warm_waits: int = 0
    cold_starts: int = 0
    handoffs: int = 0
    unclaimed_starts: int = 0
    starts_dropped: int = 0
    unclaimed_stopped: int = 0
    warm_ups: int = 0
    warm_skipped: int = 0
    wasted_warm_ups: int = 0
    evictions: int = 0
    idle_evictions: int = 0
    budget_evictions: int = 0
    start_failures: int = 0
    provisioning_s: float = 0.0
    peak_memory_bytes: int = 0
    peak_live: int = 0
    starts_in_flight: int = 0
    peak_starts_in_flight: int = 0
    start_queue_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


class EnvironmentPool:
    """Use as ``async with EnvironmentPool(specs, ...) as pool``; closing stops every
    environment (also when the body raised). ``start_concurrency`` bounds the starts in
    flight (every policy, acquires' and warm-ups' alike; default :func:`host_cores`)."""

    def __init__(
        self,
        specs: Iterable[EnvSpec],
        *,
        memory_budget_bytes: int | None = None,
        max_envs: int | None = None,
        idle_timeout_s: float | None = None,
        ewma_alpha: float = 0.3,
        start_concurrency: int | None = None,
    ) -> None:
        if start_concurrency is not None and start_concurrency < 1:
            raise ConfigError(f"start_concurrency must be at least 1, not {start_concurrency}")
        self.specs = {s.name: s for s in specs}
        self.start_concurrency = start_concurrency if start_concurrency is not None else host_cores()
        self._start_queue: list[Environment] = []
        self.memory_budget_bytes = memory_budget_bytes
        self.max_envs = max_envs
        self.idle_timeout_s = idle_timeout_s
        self.ewma_alpha = ewma_alpha
        self.stats = PoolStats()
        self._envs: list[Environment] = []
        self._cost: dict[str, float] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed = anyio.Event()
        self._closed = False
        self._send, self._receive = anyio.create_memory_object_stream[str](1024)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> EnvironmentPool:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._warm_loop)
        if self.idle_timeout_s is not None:
            self._tg.start_soon(self._idle_loop)
        for spec in self.specs.values():
            self._refill(spec)
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        await self.aclose()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)  # the body's own exception propagates as it is
        return None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._notify()  # queued starts give up
        with anyio.CancelScope(shield=True):
            self._send.close()
            # wait for starts in flight, then stop everything
            with anyio.move_on_after(30):
                while any(e.state == "starting" for e in self._envs):
                    await self._wait_changed()
            for env in list(self._envs):
                await self._stop(env)

    # ------------------------------------------------------------------ queries

    def cold_start_cost(self, tool: str) -> float | None:
        """``L_j``: the EWMA of the measured start times of ``tool`` (seconds), or None."""
        return self._cost.get(tool)

    def environments(self, tool: str | None = None) -> list[Environment]:
        return [e for e in self._envs if tool is None or e.name == tool]

    def count(self, tool: str | None = None, state: str | None = None) -> int:
        return sum(1 for e in self.environments(tool) if state is None or e.state == state)

    def memory_bytes(self) -> int:
        return sum(e.spec.memory_bytes for e in self._envs)

    def rss_bytes(self) -> int:
        """The measured resident memory of the live environments (specs with ``rss``)."""
        total = 0
        for e in self._envs:
            if e.spec.rss is not None and e.state in ("idle", "busy"):
                with suppress(Exception):
                    total += e.spec.rss(e.value)
        return total

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Await a condition on the pool's state (tests; no timed assertions)."""
        with anyio.fail_after(timeout_s):
            while not predicate():
                await self._wait_changed(0.05)

    # ------------------------------------------------------------------ warm / acquire / release

    def warm_nowait(self, tool: str) -> None:
        """Ask for ``tool`` to be warmed (from a synchronous callback); ignored when closed
        or unknown."""
        if self._closed or tool not in self.specs:
            return
        with suppress(anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(tool)

    async def warm(self, tool: str) -> bool:
        """Start ``tool`` speculatively when its policy is ``speculative``, nothing of it is
        idle or starting beyond ``max_warm``, and the budget allows (after evicting idle
        speculative-warm environments). Returns whether a warm-up started; it runs in the
        background."""
        spec = self.specs.get(tool)
        if spec is None or self._closed or spec.policy != "speculative":
            return False
        # starts an acquire waits for are that acquire's, not warm: they do not count
        waiting = sum(1 for e in self._envs if e.name == tool and self._unclaimed_ready(e))
        if waiting >= spec.max_warm:
            return False
        if not self._make_room(spec, speculative_only=True):
            self.stats.warm_skipped += 1
            return False
        env = Environment(spec, speculative=True)
        self._add(env)
        self.stats.warm_ups += 1
        assert self._tg is not None
        self._tg.start_soon(self._start_bg, env)
        return True

    async def acquire(self, tool: str) -> Environment:
        """A warm environment of ``tool`` (a hit), one that is warming (waited for), or a
        cold start; while waiting for a start, one released in the meantime (a handoff)."""
        spec = self.specs.get(tool)
        if spec is None:
            raise ConfigError(f"unknown tool type {tool!r}")
        if self._closed:
            raise SandboxError("the pool is closed")
        claim: Environment | None = None
        own = False  # the claimed start is this acquire's cold start
        try:
            while True:
                if claim is not None and claim.state == "idle":
                    self.stats.cold_starts += own
                    self.stats.warm_waits += not own
                    env, claim = claim, None
                    return self._take(env)
                idle = [e for e in self._envs if e.name == tool and e.state == "idle" and not e.claimed]
                if idle:
                    env = max(idle, key=lambda e: e.last_used)
                    if claim is None:
                        self.stats.hits += 1
                    else:
                        # Why: a start takes seconds, a busy environment is often released
                        # within milliseconds. The start given up is no one's now: it goes
                        # on only where its type needs it (see _unclaim).
                        self.stats.handoffs += 1
                        env.state = "busy"  # taken: not spare for the start given up
                        self._unclaim(claim, own, cancel=False)
                        claim = None
                    return self._take(env)
                if claim is not None and claim.state == "stopped":
                    if own and claim._error is not None:
                        error, claim = claim._error, None
                        raise error
                    claim = None  # a warm-up failed or was evicted: look again
                if claim is None:
                    starting = [e for e in self._envs if e.name == tool and e.state == "starting" and not e.claimed]
                    if starting:
                        claim, own = starting[0], False
                        claim.claimed, claim.given_up = True, False
                        self._notify()  # a claimed start goes ahead of warm-ups in the queue
                        continue
                    if self._make_room(spec, speculative_only=False):
                        claim, own = Environment(spec, claimed=True), True
                        self._add(claim)
                        assert self._tg is not None
                        self._tg.start_soon(self._start_bg, claim)
                        continue
                await self._wait_changed()  # a start, a release, or room in the budget
        finally:
            if claim is not None:  # cancelled (or failed) while waiting
                with anyio.CancelScope(shield=True):
                    await self._abandon(claim, own)

    def _unclaim(self, env: Environment, own: bool, *, cancel: bool) -> None:
        """Give up the claim on ``env``. A cold start of one's own becomes a warm-up (so it
        is evicted first and counted wasted if never used), or, when ``cancel`` (or under
        ``on-demand``, which keeps nothing warm), is cancelled or stopped. Given up for a
        handoff (not ``cancel``), a start still queued is dropped unless its type needs it
        for its reserve; one begun is checked again when it is up (:meth:`_start`)."""
        env.claimed = False
        self.stats.unclaimed_starts += not cancel
        if not cancel:
            env.given_up = True
            if self._drop_if_unneeded(env):
                self._notify()
                return
        if own and (cancel or env.spec.policy == "on-demand"):
            if env.state == "starting" and env._scope is not None:
                env._scope.cancel()
            elif env.state == "starting":  # its task has not run yet: it finds itself dropped
                env.state = "stopped"
                if env in self._envs:
                    self._envs.remove(env)
            elif env.state == "idle":
                env.state = "stopped"
                if env in self._envs:
                    self._envs.remove(env)
                assert self._tg is not None
                self._tg.start_soon(self._stop, env)
        elif own:
            env.speculative = True
        self._notify()

    async def _abandon(self, env: Environment, own: bool) -> None:
        """An acquire that waited for ``env`` was cancelled: its own cold start is cancelled
        (and waited for: nothing of it is left when the acquire returns), a warm-up it
        claimed goes on unclaimed."""
        if env.state == "stopped":
            return
        self._unclaim(env, own, cancel=True)
        if own:
            while env.state == "starting":
                await self._wait_changed()

    async def release(self, env: Environment, *, reuse: bool = True) -> None:
        """Give ``env`` back: on-demand environments (and any with ``reuse=False``, e.g. a
        sandbox whose state changed) are stopped, others kept idle."""
        if env.state != "busy":
            return
        env.last_used = time.monotonic()
        if env.spec.policy == "on-demand" or self._closed or not reuse:
            await self._stop(env)
        else:
            env.state = "idle"
            self._notify()

    @asynccontextmanager
    async def lease(self, tool: str) -> AsyncIterator[Environment]:
        env = await self.acquire(tool)
        try:
            yield env
        finally:
            with anyio.CancelScope(shield=True):
                await self.release(env)

    # ------------------------------------------------------------------ internals

    def _take(self, env: Environment) -> Environment:
        env.state = "busy"
        env.used = True
        env.claimed = False
        env.last_used = time.monotonic()
        self._refill(env.spec)
        self._notify()
        return env

    def _add(self, env: Environment) -> None:
        self._envs.append(env)
        live = len(self._envs)
        self.stats.peak_live = max(self.stats.peak_live, live)
        self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes, self.memory_bytes())

    def _refill(self, spec: EnvSpec) -> None:
        if self._closed or self._tg is None:
            return
        # ready: idle (a released environment counts again), or starting and not yet claimed
        ready = sum(1 for e in self._envs if e.name == spec.name and self._unclaimed_ready(e))
        for _ in range(spec.kept_warm - ready):
            if not self._make_room(spec, speculative_only=True):
                break
            env = Environment(spec)
            self._add(env)
            self._tg.start_soon(self._start_bg, env)

    @staticmethod
    def _unclaimed_ready(env: Environment) -> bool:
        """Idle, or starting with no acquire waiting for it."""
        return (env.state == "idle" or env.state == "starting") and not env.claimed

    def _fits(self, spec: EnvSpec) -> bool:
        if self.max_envs is not None and len(self._envs) + 1 > self.max_envs:
            return False
        return not (
            self.memory_budget_bytes is not None and self.memory_bytes() + spec.memory_bytes > self.memory_budget_bytes
        )

    def _make_room(self, spec: EnvSpec, *, speculative_only: bool) -> bool:
        """Evict idle environments (speculative-warm ones first, LRU) until ``spec`` fits."""
        while not self._fits(spec):
            idle = [e for e in self._envs if e.state == "idle" and e.speculative and not e.used and not e.claimed]
            if not idle and not speculative_only:
                idle = [e for e in self._envs if e.state == "idle" and not e.claimed and self._above_reserve(e)]
            if not idle:
                return False
            victim = min(idle, key=lambda e: e.last_used)
            self.stats.evictions += 1
            self.stats.budget_evictions += 1
            victim.state = "stopped"  # counted as gone now; stopped in the background
            assert self._tg is not None
            self._tg.start_soon(self._stop, victim)
            self._envs.remove(victim)
            if victim.speculative and not victim.used:
                self.stats.wasted_warm_ups += 1
                victim.used = True  # counted once
        return True

    def _drop_if_unneeded(self, env: Environment) -> bool:
        """Drop ``env``, a start given up for a handoff and still queued, when its type has
        its reserve (``kept_warm``; 0 under plain ``speculative``) idle or starting
        unclaimed besides it. True when dropped."""
        # Why: no acquire waits for it any more and it has cost nothing yet; dropped, it
        # never holds memory, a start slot or a place in the budget. Kept while the reserve
        # needs it: it keeps its place in the queue, where a new refill would go last.
        if not (env.given_up and not env.claimed and env.state == "starting" and not env.begun):
            return False
        others = sum(1 for e in self._envs if e is not env and e.name == env.name and self._unclaimed_ready(e))
        if others < env.spec.kept_warm:
            return False
        env.state = "stopped"
        if env in self._envs:
            self._envs.remove(env)
        self.stats.starts_dropped += 1
        return True

    def _spare_when_up(self, env: Environment) -> bool:
        """Whether ``env``, a start given up for a handoff that has just come up, is spare:
        its type already has ``max(kept_warm, 1)`` idle besides it."""
        # Why: its start is paid for, but an idle server of its type already serves the next
        # call (and a burst's second call is handed the first one released); kept, it would
        # hold its memory until the idle timeout. With nothing of its type idle it stays.
        if not env.given_up or env.claimed:
            return False
        idle = sum(1 for e in self._envs if e is not env and e.name == env.name and e.state == "idle" and not e.claimed)
        return idle >= max(env.spec.kept_warm, 1)

    def _above_reserve(self, env: Environment) -> bool:
        if not env.spec.kept_warm:
            return True
        ready = sum(1 for e in self._envs if e.name == env.name and e.state == "idle")
        return ready > env.spec.kept_warm

    async def _start_bg(self, env: Environment) -> None:
        with anyio.CancelScope() as scope, suppress(Exception):
            env._scope = scope
            await self._start(env)

    async def _wait_start_slot(self, env: Environment) -> bool:
        """Queue ``env``'s start until fewer than ``start_concurrency`` run and it is the
        first queued (claimed starts first, then in order). False when the pool closed or
        ``env`` was dropped meanwhile (also here: a start given up for a handoff that its
        type no longer needs)."""
        # Why: a cold start here is CPU (an interpreter and its imports); more of them at
        # once than cores only makes each slower, and a start an acquire waits for is the
        # one whose delay a caller sees.
        self._start_queue.append(env)
        t0 = time.perf_counter()
        try:
            while True:
                if self._closed or env.state != "starting" or self._drop_if_unneeded(env):
                    return False
                first = next((e for e in self._start_queue if e.claimed), self._start_queue[0])
                if first is env and self.stats.starts_in_flight < self.start_concurrency:
                    break
                await self._wait_changed()
        finally:
            self._start_queue.remove(env)
            self.stats.start_queue_s += time.perf_counter() - t0
        env.begun = True
        self.stats.starts_in_flight += 1
        self.stats.peak_starts_in_flight = max(self.stats.peak_starts_in_flight, self.stats.starts_in_flight)
        return True

    async def _start(self, env: Environment) -> None:
        spec = env.spec
        try:
            if not await self._wait_start_slot(env):
                raise SandboxError(f"the start of {spec.name!r} was dropped (pool closed, or no longer needed)")
        except BaseException as exc:  # closed or cancelled while queued: never started
            env._error = exc
            env.state = "stopped"
            if env in self._envs:
                self._envs.remove(env)
            self._notify()
            raise
        t0 = time.perf_counter()
        try:
            if spec.open is not None:
                await self._open_held(env)
            else:
                assert spec.start is not None
                env.value = await spec.start()
        except BaseException as exc:
            self.stats.starts_in_flight -= 1
            self.stats.start_failures += 1
            env._error = exc
            env.state = "stopped"
            if env._stop_event is not None:  # a holder that opens later closes at once
                env._stop_event.set()
            if env in self._envs:
                self._envs.remove(env)
            self._notify()
            raise
        self.stats.starts_in_flight -= 1
        self._notify()  # a queued start may take the freed slot now, not after this env's stop
        dt = time.perf_counter() - t0
        env.start_s = dt
        self.stats.provisioning_s += dt
        old = self._cost.get(spec.name)
        self._cost[spec.name] = dt if old is None else (1 - self.ewma_alpha) * old + self.ewma_alpha * dt
        env.last_used = time.monotonic()
        if env.state == "starting":
            env.state = "idle"
        if self._closed or env not in self._envs:
            await self._stop(env)
        elif env.state == "idle" and self._spare_when_up(env):
            self.stats.unclaimed_stopped += 1
            await self._stop(env)
        self._notify()

    async def _open_held(self, env: Environment) -> None:
        """Hold ``spec.open()`` open in a task of the pool's own (context managers with
        cancel scopes must be exited by the task that entered them)."""
        assert self._tg is not None and env.spec.open is not None
        env._stop_event = anyio.Event()
        env._done_event = anyio.Event()
        ready = anyio.Event()
        failure: list[BaseException] = []

        async def holder() -> None:
            assert env._stop_event is not None and env._done_event is not None and env.spec.open is not None
            try:
                async with env.spec.open() as value:
                    env.value = value
                    ready.set()
                    await env._stop_event.wait()
            except BaseException as exc:
                failure.append(exc)
                if not ready.is_set():
                    ready.set()
                if not isinstance(exc, Exception):
                    raise
            finally:
                env._done_event.set()

        self._tg.start_soon(holder)
        await ready.wait()
        if failure:
            raise failure[0]

    async def _stop(self, env: Environment) -> None:
        if env in self._envs:
            self._envs.remove(env)
        if env.speculative and not env.used:
            self.stats.wasted_warm_ups += 1
            env.used = True
        env.state = "stopped"
        with anyio.CancelScope(shield=True):
            if env._stop_event is not None:
                env._stop_event.set()
                assert env._done_event is not None
                await env._done_event.wait()
            elif env.spec.stop is not None and env.value is not None:
                await env.spec.stop(env.value)
            env.value = None
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _wait_changed(self, timeout_s: float = 1.0) -> None:
        with anyio.move_on_after(timeout_s):
            await self._changed.wait()

    async def _warm_loop(self) -> None:
        async with self._receive:
            async for tool in self._receive:
                await self.warm(tool)

    async def _idle_loop(self) -> None:
        assert self.idle_timeout_s is not None
        period = max(self.idle_timeout_s / 2, 0.005)
        while not self._closed:
            await anyio.sleep(period)
            now = time.monotonic()
            for env in list(self._envs):
                if (
                    env.state == "idle"
                    and not env.claimed
                    and now - env.last_used >= self.idle_timeout_s
                    and self._above_reserve(env)
                ):
                    self.stats.evictions += 1
                    self.stats.idle_evictions += 1
                    await self._stop(env)


# ---------------------------------------------------------------------- adapters


def router_adapter(pool: EnvironmentPool, tool_of: Callable[[str], str | None] | None = None) -> Callable[[Any], None]:
    """A ``RouterSession.subscribe`` callback: each ``RouteEvent`` warms its tool (mapped
    through ``tool_of`` to a pool tool type when given; None skips)."""

    def callback(event: Any) -> None:
        tool = event.tool if tool_of is None else tool_of(event.tool)
        if tool is not None:
            pool.warm_nowait(tool)

    return callback


def prefetch_adapter(
    pool: EnvironmentPool, tool_of: Callable[[str], str | None] | None = None
) -> Callable[[Any], None]:
    """An ``on_prefetch`` for ``aospec.specbox.markov.prefetch_task``: warms each prefetched tool
    (its ``[(tool, probability), ...]`` or plain tool names)."""

    def on_prefetch(tools: Sequence[Any]) -> None:
        for item in tools:
            name = item[0] if isinstance(item, tuple) else item
            tool = name if tool_of is None else tool_of(name)
            if tool is not None:
                pool.warm_nowait(tool)

    return on_prefetch


# ---------------------------------------------------------------------- concrete environments


def process_rss_bytes(pid: int) -> int:
    """Resident memory of a process from /proc (0 when gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def process_children(pid: int) -> list[int] | None:
    """The pids of ``pid``'s children, from /proc (``task/*/children``); None when ``pid``
    is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def process_tree_pids(pid: int) -> list[int]:
    """``pid`` and its live descendants, from /proc (``task/*/children``); [] when gone."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        children = process_children(p)
        if children is None:
            continue
        out.append(p)
        todo.extend(children)
    return out


def process_tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (each counted whole: pages they
    share are counted once per process)."""
    return sum(process_rss_bytes(p) for p in process_tree_pids(pid))


@dataclass
class ProcessEnv:
    """A stdio tool-server process (one JSON object per line)."""

    process: anyio.abc.Process
    _buf: bytes = b""

    @property
    def pid(self) -> int:
        return self.process.pid

    async def readline(self) -> bytes:
        assert self.process.stdout is not None
        while b"\n" not in self._buf:
            chunk = await self.process.stdout.receive()
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    async def call(self, tool: str, args: dict[str, Any], id: int = 0) -> Any:
        assert self.process.stdin is not None
        await self.process.stdin.send((json.dumps({"id": id, "tool": tool, "args": args}) + "\n").encode())
        return json.loads(await self.readline())


async def _start_process(argv: Sequence[str]) -> ProcessEnv:
    proc = await anyio.open_process(list(argv), stderr=None)
    env = ProcessEnv(proc)
    try:
        line = await env.readline()
        if not json.loads(line).get("ready"):
            raise SandboxError(f"tool process did not report ready: {line!r}")
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _stop_process(env)
        raise
    return env


async def _stop_process(env: ProcessEnv) -> None:
    proc = env.process
    with anyio.CancelScope(shield=True):
        if proc.stdin is not None:
            with suppress(Exception):
                await proc.stdin.aclose()
        with anyio.move_on_after(2):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await proc.aclose()


def demo_tool_spec(
    name: str,
    *,
    startup_s: float = 0.2,
    ballast_mb: int = 0,
    policy: Policy = "on-demand",
    memory_bytes: int | None = None,
    **kw: Any,
) -> EnvSpec:
    """A tool type served by :mod:`aospec.specbox._demo_tool` (a stand-in for an MCP server whose
    cold start is importing heavy modules: a sleep plus ``ballast_mb`` of resident memory)."""
    argv = [sys.executable, "-m", "aospec.specbox._demo_tool", "--startup-s", str(startup_s), "--ballast-mb", str(ballast_mb)]
    est = memory_bytes if memory_bytes is not None else (ballast_mb + 15) << 20

    async def start() -> ProcessEnv:
        return await _start_process(argv)

    return EnvSpec(
        name,
        start=start,
        stop=_stop_process,
        memory_bytes=est,
        policy=policy,
        rss=lambda env: process_rss_bytes(env.pid),
        **kw,
    )


@dataclass
class SandboxEnv:
    """A sandbox store opened on a base, with its first fork made (the cold start)."""

    sandbox: Any
    fork: Any


def sandbox_spec(
    name: str, config: Any = None, *, policy: Policy = "on-demand", memory_bytes: int = 64 << 20, **kw: Any
) -> EnvSpec:
    """A tool type whose environment is a runtime sandbox (``runtime.open_sandbox(config)``,
    overlay or docker) plus its first fork; the measured cold start is both."""

    @asynccontextmanager
    async def open_env() -> AsyncIterator[SandboxEnv]:
        from aospec.runtime import open_sandbox

        async with open_sandbox(config) as sb:
            fork = await sb.fork()
            try:
                yield SandboxEnv(sb, fork)
            finally:
                with anyio.CancelScope(shield=True):
                    with suppress(SandboxError):
                        await fork.discard()

    return EnvSpec(name, open=open_env, policy=policy, memory_bytes=memory_bytes, **kw)


# ---------------------------------------------------------------------- the pool-backed Sandbox


@asynccontextmanager
async def pooled_sandbox(pool: EnvironmentPool, tool: str, depth: int = 2) -> AsyncIterator[PooledSandbox]:
    """The engine's committed sandbox from ``pool``: a warm :func:`sandbox_spec` environment of
    ``tool`` (no cold start when one was warm) as a :class:`PooledSandbox` whose forks are
    made ahead of time. On exit the environment goes back to the pool only when its state
    is unchanged; otherwise it is stopped (the next user must not see this one's files)."""
    env = await pool.acquire(tool)
    reuse = False
    try:
        if not isinstance(env.value, SandboxEnv):
            raise ConfigError(f"tool type {tool!r} is not a sandbox environment (sandbox_spec)")
        version = env.value.sandbox.version
        async with PooledSandbox.open(env.value.sandbox, depth) as sb:
            yield sb
        reuse = env.value.sandbox.version == version  # a changed state is never handed on
    finally:
        with anyio.CancelScope(shield=True):
            await pool.release(env, reuse=reuse)


@dataclass
class PooledStats:
    handed_out: int = 0
    misses: int = 0
    stale_discarded: int = 0
    made: int = 0


class PooledSandbox:
    """A Sandbox whose ``fork()`` comes from a small queue of forks made ahead of time.

    Open with ``async with PooledSandbox.open(inner, depth=2) as sb``. A queued fork is
    handed out only when its version (a fork never executed has its origin's version)
    equals the parent's current version; any other is discarded (the JASV precondition).
    ``execute`` on this sandbox never overlaps a background fork (the protocol's rule).
    Forks handed out are the inner sandbox's own forks: ``commit`` takes them as they are.
    """

    def __init__(self, inner: Sandbox, depth: int = 2) -> None:
        self.inner = inner
        self.depth = depth
        self.stats = PooledStats()
        self._queue: list[Sandbox] = []
        self._lock = anyio.Lock()  # background forks vs execute
        self._wake = anyio.Event()
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(cls, inner: Sandbox, depth: int = 2) -> AsyncIterator[PooledSandbox]:
        sb = cls(inner, depth)
        sb._kick()  # the first fill
        # what the body raises is captured inside the refill task group and raised bare after
        # it, so the caller sees the run's own error (not wrapped in an ExceptionGroup)
        body_error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(sb._refill_loop)
            try:
                yield sb
            except BaseException as exc:
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
                body_error = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await sb._drain()
                tg.cancel_scope.cancel()
        if body_error is not None:
            raise body_error

    @property
    def version(self) -> str:
        return self.inner.version

    def ready(self) -> int:
        return len(self._queue)

    async def execute(self, action: Action) -> str:
        async with self._lock:
            result = await self.inner.execute(action)
        self._kick()
        return result

    async def fork(self) -> Any:
        while self._queue:
            fork = self._queue.pop(0)
            if fork.version == self.inner.version:
                self.stats.handed_out += 1
                self._kick()
                return fork
            self.stats.stale_discarded += 1
            await fork.discard()
        self.stats.misses += 1
        self._kick()
        return await self.inner.fork()

    async def commit(self, fork: Any) -> None:
        await self.inner.commit(fork)
        self._kick()

    async def discard(self) -> None:
        await self._drain()
        await self.inner.discard()

    async def _drain(self) -> None:
        self._closed = True
        self._kick()
        async with self._lock:
            queue, self._queue = self._queue, []
        for fork in queue:
            with suppress(SandboxError):
                await fork.discard()

    def _kick(self) -> None:
        self._wake.set()

    async def _refill_loop(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake = anyio.Event()
            for fork in list(self._queue):  # drop stale forks, then top up
                if fork.version != self.inner.version and fork in self._queue:
                    self._queue.remove(fork)
                    self.stats.stale_discarded += 1
                    await fork.discard()
            while not self._closed and len(self._queue) < self.depth:
                async with self._lock:
                    if self._closed:
                        break
                    try:
                        fork = await self.inner.fork()
                    except SandboxError:
                        self._closed = True
                        break
                self.stats.made += 1
                if self._closed:
                    await fork.discard()
                    break
                self._queue.append(fork)
