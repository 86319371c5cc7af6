"""The seams of aospec, as structural protocols (never inherited).

Each seam is small. Cancellation is not part of any seam: the engine cancels work by
cancelling the anyio cancel scope around the awaited call, so every implementation must
be cancel-safe (release what it holds when ``anyio.get_cancelled_exc_class()`` is raised).

Some seams have optional capabilities (:class:`StreamingActor`, :class:`RoutedActionDrafter`,
:class:`StreamingObservationDrafter`, :class:`PrioritizedSandbox`, :class:`PausableSandbox`,
:class:`MeteredSandbox`, :class:`CachingSandbox`, :class:`ReadSetSandbox`, :class:`GroupedKernel`). The engine finds them once, by ``isinstance``, when a run starts
(:class:`Capabilities`; a fork's when one of its class is first forked:
:class:`SandboxCapabilities`), never by probing attributes as it goes. A sandbox that wraps
another one says which of them it has by one rule: :class:`aospec.wrappers.SandboxWrapper`.

In-package implementations for tests live in :mod:`aospec.testing`. Traces have no seam of
their own: the importers are plain functions from a path to ``Trace`` objects
(``replay.load_traces``), and everything that consumes traces takes a sequence of them.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self, runtime_checkable

from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action, History, Trace

__all__ = [
    "ActionDraft",
    "ActionDrafter",
    "Actor",
    "CachingSandbox",
    "Capabilities",
    "Clock",
    "SleepingClock",
    "GroupedKernel",
    "HostMonitor",
    "HostSnapshot",
    "Kernel",
    "MeteredSandbox",
    "ObservationCanonicalizer",
    "ObservationDraft",
    "ObservationDrafter",
    "PausableSandbox",
    "PrioritizedSandbox",
    "ReadSetSandbox",
    "RouteEvent",
    "RoutedActionDrafter",
    "Sandbox",
    "SandboxCapabilities",
    "StreamRouter",
    "StreamingActor",
    "StreamingObservationDrafter",
    "Trainable",
]


@runtime_checkable
class Clock(Protocol):
    """The engine's notion of time, in integer nanoseconds (monotonic in live runs, virtual
    in replay). Every duration the engine records is a difference of two ``now_ns()``."""

    def now_ns(self) -> int: ...


@runtime_checkable
class SleepingClock(Clock, Protocol):
    """A clock the engine also waits on: ``sleep_ns(ns)`` returns once ``ns`` of its time
    passed (replay's virtual clock, whose unit is not the event loop's second). The engine
    paces its own sampling on it; a plain :class:`Clock` is paced by the event loop."""

    async def sleep_ns(self, ns: int) -> None: ...


@runtime_checkable
class Actor(Protocol):
    """The model that decodes the next action.

    ``decode`` starts decoding from ``history`` (which may end in a drafted, provisional
    observation) and returns the finished action. Cancelling the caller's scope cancels
    the decode.
    """

    async def decode(self, history: History) -> Action: ...


@runtime_checkable
class StreamingActor(Protocol):
    """An optional Actor capability: decode while reporting the reply's stream.

    ``on_delta`` is called synchronously, from the decoding task itself (never from another
    thread), with each streamed piece as it arrives: a ``str`` of reply text, or for tool
    calls an OpenAI chat-completions chunk dict (``{"choices": [{"delta": {...}}]}``). The
    engine's callback is cheap and never raises. The returned action is what ``decode``
    would return for the same history. With a :class:`StreamRouter` given to the engine,
    the engine decodes through this method (docs/engine.md, Routing)."""

    async def decode_streaming(self, history: History, on_delta: Callable[[object], None]) -> Action: ...


class RouteEvent(Protocol):
    """What a :class:`StreamRouter` session's ``feed`` returns for each tool it names: the
    ``tool``, the router's ``confidence`` in it, the ``position`` (deltas fed so far) and
    the name of the ``router`` that fired."""

    @property
    def tool(self) -> str: ...

    @property
    def confidence(self) -> float: ...

    @property
    def position(self) -> int: ...

    @property
    def router(self) -> str: ...


@runtime_checkable
class StreamRouter(Protocol):
    """Names the tool the actor is about to call from its stream (e.g. ``aospec.specbox.routers``'
    routers and assemblies).

    ``session(history)`` returns a fresh per-decode object with ``feed(delta) ->
    Sequence[RouteEvent]`` (called synchronously for each delta, so it must be cheap); each
    event has ``.tool: str``, ``.confidence: float``, ``.position: int`` (deltas fed so far)
    and ``.router: str`` (:class:`RouteEvent`). ``history`` is the history the decode starts
    from (the verified one, or a provisional branch's), so a router may condition on the
    earlier steps (e.g. specbox's prior gate on the previous tool); a router whose
    ``session`` takes no argument is opened with ``session()``."""

    def session(self, history: History) -> Any: ...


@runtime_checkable
class RoutedActionDrafter(Protocol):
    """An optional ActionDrafter capability: target actions once a router has named the
    ``tool`` of the action being decoded after ``history`` (offset 0 only; probabilities are
    ``P(action | tool)``), at most ``width`` of them."""

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]: ...


@runtime_checkable
class Sandbox(Protocol):
    """An environment that executes actions and can be forked copy-on-write.

    ``version`` identifies the filesystem state exactly (equal states of equal lineage
    have equal versions). ``fork`` returns an isolated child whose origin version is this
    sandbox's current version; ``commit(child)`` makes the child's state this sandbox's
    state (the child, a fork or a fork of a fork, is consumed); ``discard`` throws this
    sandbox (a fork) away and releases everything (idempotent). After ``commit`` or
    ``discard`` the consumed sandbox raises SandboxError on use.

    Concurrency (what callers may overlap, from different tasks):

    - ``fork``, ``commit`` and ``discard`` of one sandbox may overlap each other; the
      implementation serialises them (the runtime backends hold a per-sandbox lock, the
      in-memory and replay ones make each change without awaiting in between).
    - ``execute`` must not overlap any other call on the *same* sandbox: the caller
      serialises it. Calls on different sandboxes (a parent, its forks, siblings) may all
      overlap, except that a fork is committed only once its ``execute`` has returned.
    - ``version`` is exact whenever no ``execute`` on this sandbox is in flight; read while
      ``commit`` is in flight it is the version before or after it.

    The engine relies on exactly this: with forks on, the committed sandbox only ever
    forks and commits (from several tasks at once) and never executes; without forks, one
    task executes on it and nothing forks it. It holds no lock of its own.
    """

    @property
    def version(self) -> str: ...

    async def execute(self, action: Action) -> str: ...

    async def fork(self) -> Self: ...

    async def commit(self, fork: Self) -> None: ...

    async def discard(self) -> None: ...


@runtime_checkable
class PrioritizedSandbox(Protocol):
    """An optional Sandbox capability: run its commands at background priority.

    ``set_priority(foreground=False)`` makes this sandbox's commands yield CPU (and IO)
    to foreground work; ``foreground=True`` (the default state) undoes it. Either applies
    at once, to a command already running too. The engine puts every speculative fork in
    the background and raises a fork to the foreground once the step waits on it (the
    step's own fork runs in the foreground from the start). Backends without it are used
    as they are."""

    async def set_priority(self, *, foreground: bool) -> None: ...


@runtime_checkable
class PausableSandbox(Protocol):
    """An optional Sandbox capability: stop this sandbox's running command from taking any CPU.

    ``pause()`` freezes every process of the command running in this sandbox (the cgroup
    freezer on overlay, ``docker pause`` on Docker) and returns once they are frozen;
    ``resume()`` thaws them. Both are idempotent and return at once when no command runs;
    a command started while the sandbox is paused starts frozen. The time a command spends
    paused does not count against its timeout (a paused guess must never time out where
    serial execution would not: its result would differ). ``paused`` says which state the
    sandbox is in. The engine pauses speculative forks while the command the agent waits
    on is CPU-bound, and resumes a paused fork before the step waits on it."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    @property
    def paused(self) -> bool: ...


@runtime_checkable
class MeteredSandbox(Protocol):
    """An optional Sandbox capability: the CPU its commands use.

    ``cpu_ns`` is the CPU time (user + system, ns) every command this sandbox has run has
    used so far, the running one included (readable while it runs, e.g. from the command's
    cgroup); a fork starts from 0. The engine samples it to learn what a guess costs and
    whether the command the agent waits on is CPU-bound."""

    @property
    def cpu_ns(self) -> int: ...


@dataclass(frozen=True, slots=True)
class HostSnapshot:
    """What the host has to spare right now, as a :class:`HostMonitor` reads it.

    - ``cores``: CPUs this process may use (affinity and cgroup quota applied);
    - ``busy_cores``: cores' worth of CPU in use by everything on the host (or in this
      process's cgroup), averaged over the monitor's window;
    - ``cpu_pressure``: the share of wall time some runnable task waited for a CPU
      (``/proc/pressure/cpu`` "some", 0..1), None where PSI is missing;
    - ``memory_pressure``: the same for memory stalls (``/proc/pressure/memory`` "some"),
      None where PSI is missing;
    - ``memory_available_bytes``: memory available to new work (MemAvailable, or the cgroup
      limit's headroom).
    """

    cores: float
    busy_cores: float
    cpu_pressure: float | None = None
    memory_pressure: float | None = None
    memory_available_bytes: int | None = None

    @property
    def free_cores(self) -> float:
        return max(0.0, self.cores - self.busy_cores)


@runtime_checkable
class HostMonitor(Protocol):
    """Reads the host's load for the speculation controller: live, from /proc (PSI, CPU
    and memory counters); in replay, from the simulated host (cores, background load and the
    commands running in virtual time)."""

    def snapshot(self) -> HostSnapshot: ...


@runtime_checkable
class CachingSandbox(Protocol):
    """An optional Sandbox capability (``aospec.specbox.cache.CachedSandbox`` and wrappers that
    forward it): ``last_cache_hit_ns`` is None when this sandbox's last ``execute`` ran the
    action, else the tool time the cache saved (the stored entry's original run time, ns);
    ``cache_counts()`` returns the cache's counters (hits, misses, bypasses, stale_avoided,
    stale_differed, violations, stores, evictions). The engine counts the hits of committed
    steps (``EngineStatistics.cache_hits``, ``cache_saved_ns``)."""

    @property
    def last_cache_hit_ns(self) -> int | None: ...

    def cache_counts(self) -> dict[str, int]: ...


@runtime_checkable
class ReadSetSandbox(Protocol):
    """An optional Sandbox capability: read-set validation (docs/engine.md, "Read sets").

    On a fork, ``trace_reads()`` before its ``execute`` asks it to record what that command
    reads; afterwards ``read_set()`` returns it (None when anything it did was not tracked:
    the fork is then reused only by plain JASV) and ``write_set()`` what the command changed
    (every fork, traced or not). On the committed sandbox, ``rebase(fork)`` commits a fork
    whose origin is an older version: the fork's own changes on top of the current state
    (the engine calls it only for a fork whose reads and writes no step committed since its
    origin touched, :class:`aospec.readsets.ReadSetValidator`); it returns the step's write
    set. The engine traces speculative forks only, never the committed step's own fork."""

    async def trace_reads(self) -> None: ...

    async def read_set(self) -> ReadSet | None: ...

    async def write_set(self) -> WriteSet | None: ...

    async def rebase(self, fork: Self) -> WriteSet: ...


@dataclass(frozen=True, slots=True)
class ObservationDraft:
    """A candidate observation for an action in flight.

    ``probability`` is the drafter's estimate that the real observation is byte-identical
    to ``text``. ``template`` names the mined pattern the text instantiates, when known
    (the EVD pattern kernel groups observations by it). ``tokens`` is how many tokens the
    drafter generated for it (0 for non-generative drafters); replay charges drafting
    time in virtual time from it.
    """

    text: str
    probability: float
    template: str | None = None
    tokens: int = 0


@runtime_checkable
class ObservationDrafter(Protocol):
    """Proposes up to ``n`` candidate observations of ``action`` after ``history``."""

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]: ...


@runtime_checkable
class StreamingObservationDrafter(Protocol):
    """An observation drafter whose candidates become ready at different times (several
    drafters of different speed behind one object, e.g. replay's charged drafters).

    The engine prefers ``draft_stream`` to ``draft`` when a drafter has it, and starts the
    continuations of each batch as it arrives, within what is left of the branch budget:
    cheap candidates never wait for slow ones. Batches together hold at most ``n`` drafts
    per source drafter.
    """

    def draft_stream(self, history: History, action: Action, n: int) -> AsyncIterator[Sequence[ObservationDraft]]: ...


@dataclass(frozen=True, slots=True)
class ActionDraft:
    """A candidate target action: ``offset`` 0 is the next action the actor will emit
    after the history, 1 the one after it, and so on. ``tokens`` as for ObservationDraft."""

    action: Action
    offset: int
    probability: float
    tokens: int = 0


@runtime_checkable
class ActionDrafter(Protocol):
    """Proposes up to ``width`` target actions, ``depth`` steps ahead at most."""

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]: ...


@runtime_checkable
class Kernel(Protocol):
    """Similarity between a candidate observation and historical observations, for EVD.

    ``similarities(c, obs)[j]`` is ``K(c, obs[j])`` in [0, 1]; EVD estimates a candidate's
    tool time as ``sum_j K(c, o_j) T_j / sum_j K(c, o_j)``.
    """

    def similarities(self, candidate: str, observations: Sequence[str]) -> Sequence[float]: ...


@runtime_checkable
class GroupedKernel(Protocol):
    """An optional Kernel capability: ``K(a, b)`` is 1 when ``key(a) == key(b)`` and 0
    otherwise (e.g. :class:`aospec.evd.PatternKernel`; ``command`` is the action's command,
    when known), so EVD sums tool times per key instead of comparing a candidate with every
    historical observation."""

    def key(self, text: str, command: str | None = None) -> str: ...


@runtime_checkable
class ObservationCanonicalizer(Protocol):
    """Maps an observation to a canonical form with inconsequential fields (process ids,
    temp names, times) replaced; used only when the engine accepts drafts canonically
    (``EngineConfig(accept="canonical")``), never to change what the actor sees."""

    def canonical(self, text: str) -> str: ...


@runtime_checkable
class Trainable(Protocol):
    """A drafter that learns from training traces before use (never from eval traces)."""

    def fit(self, traces: Sequence[Trace]) -> None: ...


def _is(obj: object, protocol: type) -> bool:
    """``isinstance(obj, protocol)``, False when the check itself raises (on Python 3.11
    the check reads a property member, which may fail)."""
    try:
        return isinstance(obj, protocol)
    except Exception:
        return False


@dataclass(frozen=True, slots=True)
class SandboxCapabilities:
    """The optional capabilities of one sandbox, found once: ``prioritized``
    (:class:`PrioritizedSandbox`), ``pausable`` (:class:`PausableSandbox`), ``metered``
    (:class:`MeteredSandbox`), ``caching`` (:class:`CachingSandbox`), ``read_sets``
    (:class:`ReadSetSandbox`) and ``forks_during_execute`` (a fork taken while a command
    runs is at the state before it). A sandbox whose check raises has none of them."""

    prioritized: bool = False
    caching: bool = False
    pausable: bool = False
    metered: bool = False
    read_sets: bool = False
    forks_during_execute: bool = False

    @classmethod
    def of(cls, sandbox: object) -> SandboxCapabilities:
        return cls(
            prioritized=_is(sandbox, PrioritizedSandbox),
            caching=_is(sandbox, CachingSandbox),
            pausable=_is(sandbox, PausableSandbox),
            metered=_is(sandbox, MeteredSandbox),
            read_sets=_is(sandbox, ReadSetSandbox),
            forks_during_execute=_forks_during_execute(sandbox),
        )


def _forks_during_execute(sandbox: object) -> bool:
    """Whether ``sandbox`` declares (``forks_during_execute = True``) that a fork taken
    while a command runs on it is at the state before that command, and that its version
    moves only once the command is done (``aospec.runtime.OverlaySandbox``): then the
    engine runs a committed step on it directly, with no fork and no commit."""
    try:
        return getattr(sandbox, "forks_during_execute", False) is True
    except Exception:
        return False


@dataclass(frozen=True, slots=True)
class Capabilities:
    """The optional capabilities of one engine run's seams, found once when the run starts
    (:meth:`of`); the engine reads this record and never probes a seam again.

    - ``streaming_actor``: the actor is a :class:`StreamingActor` (a router is used only then);
    - ``router_takes_history``: the router's ``session`` takes the decode's history (else it
      is opened with ``session()``);
    - ``streaming_drafters``: per observation drafter, whether it is a
      :class:`StreamingObservationDrafter` (then its ``draft_stream`` is used);
    - ``routed_drafters``: the action drafters that are :class:`RoutedActionDrafter` s;
    - ``sandbox``: the committed sandbox's. A fork's are found once per class of fork (when
      the first is forked): a fork need not have its parent's (a pool hands out its inner
      sandbox's forks).
    """

    streaming_actor: bool = False
    router_takes_history: bool = False
    streaming_drafters: tuple[bool, ...] = ()
    routed_drafters: tuple[RoutedActionDrafter, ...] = ()
    sandbox: SandboxCapabilities = SandboxCapabilities()

    @classmethod
    def of(
        cls,
        *,
        actor: Actor,
        sandbox: Sandbox,
        observation_drafters: Sequence[ObservationDrafter] = (),
        action_drafters: Sequence[ActionDrafter] = (),
        router: StreamRouter | None = None,
    ) -> Capabilities:
        return cls(
            streaming_actor=_is(actor, StreamingActor),
            router_takes_history=router is not None and _takes_an_argument(router.session),
            streaming_drafters=tuple(_is(d, StreamingObservationDrafter) for d in observation_drafters),
            routed_drafters=tuple(d for d in action_drafters if _is(d, RoutedActionDrafter)),
            sandbox=SandboxCapabilities.of(sandbox),
        )


def _takes_an_argument(method: Callable[..., Any]) -> bool:
    """Whether ``method`` can be called with one positional argument (a router's
    ``session(history)``, or an older ``session()`` that takes none)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
