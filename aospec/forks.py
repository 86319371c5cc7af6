"""The forks of one run: the JASV registry and the fork lifecycle.

Joint Action-State Verification reuses a fork for the action the actor emitted iff the
fork's action key equals the emitted action's key AND the fork's origin version equals the
committed version. Entries are indexed by ``(origin_version, action_key)`` so that check is
one dict lookup. Forks whose origin is no longer the committed version can never be reused
(versions never return to an earlier value) and are pruned after every commit; forks of
steps that left the filesystem unchanged keep their origin and stay valid across steps.

:class:`Forks` is everything one run does to the committed sandbox: it decides every
speculative launch (:meth:`Forks.launch`, the one place), runs each target in a fork of
its own (one speculative ``fork()`` call at a time, behind the verified path's), sets
forks' priority, verifies the emitted action against the registry (:meth:`Forks.verify`:
JASV), executes the step when no fork has it (:meth:`Forks.execute`), commits the step's
fork (:meth:`Forks.commit`, the one place), and releases and discards every other fork.

Every launch is priced by the run's speculation controller (:class:`aospec.admission.Admission`)
first, and every fork's outcome (reused, or thrown away with its tool time and CPU) is
reported to it. While the command the agent waits on runs in a metered sandbox, it is
sampled (:meth:`Forks._yield_loop`): when it is CPU-bound and the host has no room,
speculative forks whose sandboxes can pause are paused (the lowest-value first), and
resumed when it blocks or ends; a paused fork JASV accepts is resumed at once. Under memory
pressure the lowest-value fork is dropped.
With read-set validation (:mod:`aospec.readsets`; on when the sandbox has the
:class:`aospec.protocols.ReadSetSandbox` capability and ``EngineConfig.read_sets``), a fork
whose origin is older than the committed version survives pruning while its reads and writes
stay disjoint from what was committed since, and JASV falls back to it when no fork ran the
action from the committed version: it is then rebased onto the committed state.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import anyio
import anyio.lowlevel

from aospec.admission import (
    MEMORY_CHECK_SAMPLES,
    SAMPLE_INTERVAL_S,
    TARGET,
    Admission,
    Decision,
    DraftRound,
    forks_to_run,
)
from aospec.engine_config import EngineConfig
from aospec.errors import StateUnknownError
from aospec.ledger import Ledger, label, short
from aospec.protocols import (
    CachingSandbox,
    Clock,
    MeteredSandbox,
    PausableSandbox,
    PrioritizedSandbox,
    ReadSetSandbox,
    Sandbox,
    SandboxCapabilities,
    SleepingClock,
)
from aospec.readsets import ReadSet, ReadSetValidator, WriteSet
from aospec.types import Action

if TYPE_CHECKING:
    from anyio import TaskHandle
    from anyio.abc import TaskGroup

__all__ = ["ForkEntry", "ForkRegistry", "ForkState", "Forks"]

#: How a part of the engine reports a failed speculative operation: ``failed(what, exc,
#: warn=False)``, counted and logged by :meth:`aospec.ledger.Ledger.speculation_failed`.
Failed = Callable[..., None]
_NO_CAPABILITIES = SandboxCapabilities()


class ForkState(enum.Enum):
    """The life of one execution ``f`` (a speculative target, or the committed step's own).

    ``RUNNING`` -> ``IDLE`` -> ``COMMITTED`` when JASV takes it (or it ran the step itself);
    ``RUNNING`` -> ``FAILED`` when it ends without an observation; ``RUNNING`` or ``IDLE`` ->
    ``RELEASED`` -> ``DISCARDED`` when the engine gives up on it (pruned, evicted, run over).
    Who owns the fork: its task while ``RUNNING`` (or ``RELEASED`` from ``RUNNING``), the
    engine while ``IDLE`` (or ``RELEASED`` from ``IDLE``); nobody once it is gone.
    """

    RUNNING = "running"  # its task is forking the committed sandbox or executing the action in the fork
    IDLE = "idle"  # executed, with an observation; waits for JASV
    COMMITTED = "committed"  # its result is the committed step's
    FAILED = "failed"  # ended without an observation (failed, stopped, or forked from a moved state)
    RELEASED = "released"  # given up: it can never pass JASV; its fork is being discarded
    DISCARDED = "discarded"  # its fork was thrown away


class ForkEntry:
    """One execution ``f``: ``action`` running in ``sandbox``, forked at ``origin``.

    ``state`` is its life (:class:`ForkState`); ``task`` the task that runs it (a
    speculative target), cancelled to stop it. ``speculative`` is False for the execution
    of the committed step itself. ``exec_start_ns``/``exec_end_ns`` bound its tool time.
    ``capabilities`` are its sandbox's (found once per class of fork). ``decision`` is the
    controller's verdict that launched it (its ``lease`` a slot of the host's budget, held
    while it runs); ``paused`` whether it is paused now; ``cpu_ns`` the CPU it used (a
    metered sandbox's, read when it finished).
    ``capabilities`` are its sandbox's (found once per class of fork). With read-set
    validation, ``traced`` says its reads are being recorded, ``reads``/``writes`` are what
    its command read and wrote once known, and ``rebase`` that read-set validation (not
    JASV's version check) accepted it.
    """

    __slots__ = (
        "_waiter",
        "action",
        "capabilities",
        "charged",
        "cpu_mark",
        "cpu_ns",
        "cpu_rate",
        "decision",
        "exec_end_ns",
        "exec_start_ns",
        "launched_ns",
        "missed",
        "observation",
        "offset",
        "origin",
        "paused",
        "paused_at_ns",
        "probability",
        "reads",
        "rebase",
        "reused",
        "routed",
        "sandbox",
        "speculative",
        "state",
        "target_step",
        "task",
        "traced",
        "writes",
    )

    def __init__(self, action: Action, *, offset: int, probability: float, launched_ns: int, speculative: bool) -> None:
        self.action = action
        self.offset = offset
        self.probability = probability
        self.launched_ns = launched_ns
        self.speculative = speculative
        #: launched for a routed draft (a router's program, drafted mid-decode)
        self.routed = False
        self.state = ForkState.RUNNING
        self.origin: str | None = None
        self.sandbox: Sandbox | None = None
        self.capabilities = _NO_CAPABILITIES
        self.observation: str | None = None
        self.exec_start_ns: int | None = None
        self.exec_end_ns: int | None = None
        self._waiter: anyio.Event | None = None
        self.task: TaskHandle[None] | None = None
        self.decision: Decision | None = None
        self.reused = False
        #: the step it was launched for (steps committed at launch + its offset), and whether
        #: that step's action turned out to be another
        self.target_step = 0
        self.missed = False
        #: (tool ns, CPU ns) of it already charged into the controller's guard as waste
        self.charged: tuple[int, int] = (0, 0)
        self.paused = False
        self.paused_at_ns = 0
        self.cpu_ns: int | None = None
        #: (cpu_ns, t_ns) of the last sample while it runs, and the cores it used since the one before
        self.cpu_mark: tuple[int, int] | None = None
        self.cpu_rate: float | None = None
        self.traced = False
        self.reads: ReadSet | None = None
        self.writes: WriteSet | None = None
        self.rebase = False

    @property
    def running(self) -> bool:
        return self.state is ForkState.RUNNING

    @property
    def value_s(self) -> float:
        """Expected benefit minus cost when it was launched (s; 0 without a decision)."""
        return self.decision.value_s if self.decision is not None else 0.0

    def finish(self, state: ForkState) -> None:
        """End the execution in ``state`` (IDLE, FAILED or DISCARDED), give back its budget
        slot and wake waiters."""
        self.state = state
        if self.decision is not None and self.decision.lease is not None:
            self.decision.lease.release()
        if self._waiter is not None:
            self._waiter.set()

    async def wait_finished(self) -> None:
        """Wait until the execution is over (the entry is no longer RUNNING)."""
        if self.state is ForkState.RUNNING:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def tool_ns(self, now_ns: int) -> int:
        """Tool time this fork has spent executing so far (all of it once done)."""
        if self.exec_start_ns is None:
            return 0
        end = self.exec_end_ns if self.exec_end_ns is not None else now_ns
        return end - self.exec_start_ns


class ForkRegistry:
    """Live forks by ``(origin_version, action_key)``, in launch order: every entry is
    RUNNING or IDLE (an entry leaves the registry before any other state)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], ForkEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ForkEntry]:
        return iter(list(self._entries.values()))

    def has(self, version: str, action_key: str) -> bool:
        return (version, action_key) in self._entries

    def get(self, version: str, action_key: str) -> ForkEntry | None:
        """The live entry for ``action_key`` forked from ``version``, left registered."""
        return self._entries.get((version, action_key))

    def add(self, entry: ForkEntry) -> bool:
        """Register a forked entry (its ``origin`` set); False if an equal one is live."""
        assert entry.origin is not None
        key = (entry.origin, entry.action.key)
        if key in self._entries:
            return False
        self._entries[key] = entry
        return True

    def take(self, action: Action, version: str) -> ForkEntry | None:
        """JASV: remove and return the fork that runs or ran ``action`` from ``version``,
        if any."""
        return self._entries.pop((version, action.key), None)

    def remove(self, entry: ForkEntry) -> None:
        if entry.origin is not None and self._entries.get((entry.origin, entry.action.key)) is entry:
            del self._entries[(entry.origin, entry.action.key)]

    def stale(self, version: str, keep: Callable[[ForkEntry], bool] | None = None) -> list[ForkEntry]:
        """Remove and return every entry whose origin is not ``version`` (but those ``keep``
        says to keep)."""
        out = [e for k, e in self._entries.items() if k[0] != version and (keep is None or not keep(e))]
        for e in out:
            del self._entries[(e.origin, e.action.key)]  # type: ignore[index]
        return out

    def oldest(self, n: int) -> list[ForkEntry]:
        """Remove and return the ``n`` oldest entries."""
        out = list(self._entries.values())[:n]
        for e in out:
            self.remove(e)
        return out


class Forks:
    """The committed sandbox and its forks in one run (``F``; see the module docstring).

    ``use_forks``: speculation is on, so guesses fork the committed sandbox; each step runs
    on the committed sandbox itself where the sandbox keeps forking guesses at the state
    before a running command (``forks_during_execute``, ``EngineConfig.steps_in_place``),
    else in a fork of it that is then committed (the committed sandbox only forks and
    commits). Without forks each step runs on the committed sandbox itself, as serial
    execution does. ``capabilities`` are the committed sandbox's;
    ``failed(what, exc, warn=False)`` counts a speculative failure; ``admission`` is the
    run's speculation controller.
    """

    def __init__(
        self,
        sandbox: Sandbox,
        capabilities: SandboxCapabilities,
        *,
        use_forks: bool,
        config: EngineConfig,
        clock: Clock,
        ledger: Ledger,
        task_group: TaskGroup,
        failed: Failed,
        admission: Admission,
    ) -> None:
        self._sandbox = sandbox
        self._caps = capabilities
        self._use_forks = use_forks
        self._in_place = config.steps_in_place and capabilities.forks_during_execute
        """With forks: each committed step runs on the committed sandbox itself (:meth:`execute`)."""
        self._config = config
        self._clock = clock
        self._ledger = ledger
        self._task_group = task_group
        self._failed = failed
        # A fork's capabilities, found once per class of fork (forks of one class have the
        # same; a fork need not have its parent's: a pool hands out its inner sandbox's).
        self._fork_capabilities: dict[type, SandboxCapabilities] = {type(sandbox): capabilities}
        self.registry = ForkRegistry()
        """``F``: live speculative forks by (origin version, action key), each RUNNING or IDLE."""
        self._idle: set[ForkEntry] = set()
        """Forks that executed and that no task owns (IDLE, or RELEASED from IDLE): the run
        commits or discards each; empty once the run is closed."""
        self._awaited: set[ForkEntry] = set()
        """Speculative forks JASV accepted while they still ran: the step waits on them, so
        they run at foreground priority (the others in the background)."""
        self.inflight: tuple[str, str] | None = None
        """``(v, a.key)`` while the committed step executes ``a`` from ``v``."""
        # Speculative forks of the committed sandbox go one at a time, and none starts while
        # the verified path forks or commits it: the backend serialises these calls, and a
        # step's own fork or commit queued behind a burst of guesses' forks was most of a
        # step's overhead in live runs.
        self._gate = anyio.Lock()
        self._forking: ForkEntry | None = None
        """The guess whose fork of the committed sandbox is in flight (it holds ``_gate``)."""
        self._critical = 0
        self._critical_done = anyio.Event()
        self._admission = admission
        # Pausing guesses for the command the agent waits on needs the controller on and
        # that command's CPU: found per step (a class of fork whose pause failed is not
        # paused again).
        self._pausing = admission.on
        self._unpausable: set[type] = set()
        # Why one lock: a pause still in flight when JASV takes the fork must be over before
        # the fork is resumed, or the step would wait on a frozen command.
        self._pause_lock = anyio.Lock()
        # set (and dropped) when a guess is registered: the yield loop waits on it while
        # there is none instead of waking every sample for nothing
        self._guess_event: anyio.Event | None = None
        self._readsets: ReadSetValidator | None = None
        """The committed steps' write sets, when read-set validation is on."""
        self.record_access = False
        """Read the committed step's read and write sets into :attr:`step_access` (for
        recordings; a read set only where the sandbox traced the step's own command)."""
        self.step_access: tuple[ReadSet | None, WriteSet | None] | None = None
        """``(reads, writes)`` of the step committed last, with :attr:`record_access`."""
        if use_forks and config.read_sets and capabilities.read_sets:
            try:
                self._readsets = ReadSetValidator(sandbox.version)
                if self._in_place:
                    # the steps run on the root itself: it keeps their write sets
                    record = getattr(sandbox, "record_writes", None)
                    if callable(record):
                        record()
            except Exception as exc:
                failed("reading the committed version", exc)

    # ------------------------------------------------------------------ speculative forks

    def launch(
        self,
        action: Action,
        offset: int,
        probability: float,
        *,
        kind: str = TARGET,
        source: str = "",
        routed: bool = False,
        drafted_in: DraftRound | None = None,
    ) -> bool:
        """Start ``f``: ``action`` in a fork of the committed sandbox, registered at once
        under the version it forks from (False when an equal one is live or running, or the
        controller refuses it). The one place where a speculative launch is decided.
        ``kind`` (``aospec.admission``: a boundary's TARGET, a PROVISIONAL continuation's
        action, a ROUTED target) and ``source`` (the drafter) are what it is priced by;
        ``routed``: drafted once a router named the tool being decoded (counted apart);
        ``drafted_in``: the drafting round that proposed it (which records its price)."""
        try:
            version = self._sandbox.version
        except Exception as exc:
            # Speculation only: the verified path reads the version too, and fails there.
            self._failed("reading the committed version", exc)
            return False
        key = action.key
        if self.registry.has(version, key) or self.inflight == (version, key) or self._revalidated(action, version):
            # An equal fork is live (or one from an older state that read-set validation
            # would accept), or the committed step is executing this very action from this
            # very state already.
            return False
        admission = self._admission
        if self._pausing:
            self._drop_for_memory()
        decision = admission.fork(
            action, kind=kind, source=source, distance=offset, score=probability, drafted_in=drafted_in
        )
        step = self._ledger.step
        admission.priced_fork(decision, version, key, step)
        if not decision.launch:
            return False
        excess = len(self.registry) + 1 - self._config.max_live_forks
        if excess > 0:
            # Why: live forks hold sandboxes; past the cap the oldest (drafted for the
            # earliest boundary, so the least likely still to be emitted) make room.
            self.release(self.registry.oldest(excess))
        now = self._clock.now_ns()
        fork = ForkEntry(action, offset=offset, probability=probability, launched_ns=now, speculative=True)
        # Registered at once under the version it will fork from, so JASV finds it (and waits
        # for it) even if the actor emits this action before the fork task has run.
        fork.origin = version
        fork.routed = routed
        fork.decision = decision
        fork.target_step = step + offset
        # Traced only where a read set can be what makes it usable: a target past the step
        # decoded next (offset > 0), or one launched while a committed step is in flight
        # (its origin is the state before that step). A target for the action being decoded
        # from a committed state nothing is executing on is checked at its own origin when it
        # is emitted next, where JASV needs no read set; traced, a hit would make the agent
        # wait for the tracer (2-4x on process-heavy commands: docs/engine.md, "Read sets").
        # And only while the host has a core to spare: the tracer multiplies the command's
        # CPU (1.4-3.9x on bench_live's tests, build and venv; docs/engine.md, "Read sets").
        fork.traced = (
            self._readsets is not None and (offset > 0 or self.inflight is not None) and self._admission.may_trace()
        )
        self.registry.add(fork)
        if self._guess_event is not None:
            self._guess_event.set()
            self._guess_event = None
        self._ledger.fork_launched(now, key, routed=routed)
        fork.task = self._task_group.start_soon(self._run, fork)
        return True

    async def _run(self, fork: ForkEntry) -> None:
        """Fork the committed sandbox and run a speculative target in it. Any failure here
        (forking, executing, reading the fork's version) only loses this fork's result:
        JASV then runs the action as serial execution would."""
        sandbox: Sandbox | None = None
        try:
            # Why: a fork released before its task ever ran must not fork at all.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                sandbox = await self._fork_speculatively(fork)
                if sandbox is None:
                    # released, or the committed state moved on first: it could never pass JASV
                    self._ledger.fork_discarded(self._clock.now_ns(), fork.action.key, 0)
                    return
                fork.sandbox = sandbox
                fork.capabilities = self._capabilities_of(sandbox)
                if fork.state is ForkState.RELEASED or sandbox.version != fork.origin:
                    # Released before it started, or the committed state moved on between launch
                    # and fork: this fork could never pass JASV under the version it is registered for.
                    return
                if fork not in self._awaited:
                    # Why: a guess must never take CPU or IO from the command the agent waits on.
                    await self._prioritize(fork, foreground=False)
                    if fork in self._awaited:  # JASV accepted it meanwhile
                        await self._prioritize(fork, foreground=True)
                # Why not awaited: JASV has accepted it at its origin, so its reads are not needed.
                fork.traced = fork.traced and fork not in self._awaited and await self._trace_reads(fork)
                if fork.traced:
                    self._ledger.fork_traced()
                fork.exec_start_ns = self._clock.now_ns()
                fork.observation = await sandbox.execute(fork.action)
            except Exception as exc:
                self._failed(f"fork {short(fork.action.key)}", exc)
                return
            fork.exec_end_ns = self._clock.now_ns()
            fork.cpu_ns = self._cpu_of(sandbox, fork.capabilities)
            self._admission.executed(fork.action, fork.exec_end_ns - fork.exec_start_ns, fork.cpu_ns)
            if fork.state is ForkState.RELEASED:
                return  # released while finishing: discarded below
            if fork.traced and fork not in self._awaited:
                # Off the committed path: JASV takes a fork of the committed version
                # without looking at its reads, so a fork the step waits on skips this.
                await self._record_access(fork)
                if fork.state is ForkState.RELEASED:
                    return
            # From here the idle fork belongs to the run: JASV commits it, or pruning (or the
            # end of the run) discards it.
            fork.state = ForkState.IDLE
            self._idle.add(fork)
        finally:
            if fork.state is ForkState.IDLE:
                fork.finish(ForkState.IDLE)
            else:
                fork.finish(ForkState.DISCARDED if fork.state is ForkState.RELEASED else ForkState.FAILED)
                self.registry.remove(fork)
                if sandbox is not None:
                    # Why shielded: the fork must be released even when this task is being
                    # cancelled, or its layers/processes would leak (a paused one is resumed
                    # first, so that its processes can be killed).
                    with anyio.CancelScope(shield=True):
                        if fork.paused:
                            await self._resume(fork)
                        cpu = fork.cpu_ns if fork.cpu_ns is not None else self._cpu_of(sandbox, fork.capabilities)
                        await self._discard_sandbox(sandbox, fork.action)
                    now = self._clock.now_ns()
                    self._wasted(fork, now, cpu)

    def _wasted(self, fork: ForkEntry, now: int, cpu_ns: int | None) -> None:
        """``fork`` was thrown away: into the ledger and, for a guess nobody used, what it
        ran since it was last charged into the controller's guard."""
        tool_ns = fork.tool_ns(now)
        self._ledger.fork_discarded(now, fork.action.key, tool_ns, speculative=fork.speculative, cpu_ns=cpu_ns)
        if fork.speculative and not fork.reused:
            self._charge(fork, tool_ns, cpu_ns)

    def _charge(self, fork: ForkEntry, tool_ns: int, cpu_ns: int | None) -> None:
        """Charge the guard with what ``fork`` (a guess nobody used) ran since it was last
        charged: ``tool_ns`` and ``cpu_ns`` are its totals so far."""
        dt = tool_ns - fork.charged[0]
        dc = None if cpu_ns is None else max(0, cpu_ns - fork.charged[1])
        if dt > 0 or dc:
            fork.charged = (tool_ns, cpu_ns if cpu_ns is not None else fork.charged[1])
            self._admission.wasted_fork(fork.action, max(0, dt), dc)

    def _missed(self, step: int, now: int) -> None:
        """Step ``step``'s action is known: a live guess for this step (or an earlier one)
        that is not it missed; what every missed guess still running ran since the last
        step is charged into the controller's guard (it may still be reused later: JASV
        keeps forks of unchanged states)."""
        for f in self.registry:
            if not f.missed and f.target_step <= step:
                f.missed = True
            if f.missed and f.running and f.sandbox is not None:
                self._charge(f, f.tool_ns(now), self._cpu_of(f.sandbox, f.capabilities))

    def _cpu_of(self, sandbox: Sandbox, caps: SandboxCapabilities) -> int | None:
        """The CPU ``sandbox``'s commands used so far (None: not metered, or unreadable)."""
        if not caps.metered:
            return None
        try:
            ns = cast(MeteredSandbox, sandbox).cpu_ns
            if isinstance(ns, bool) or not isinstance(ns, numbers.Real) or not ns >= 0:
                return None
            return int(ns)
        except Exception:
            return None

    def _capabilities_of(self, sandbox: Sandbox) -> SandboxCapabilities:
        caps = self._fork_capabilities.get(type(sandbox))
        if caps is None:
            caps = self._fork_capabilities[type(sandbox)] = SandboxCapabilities.of(sandbox)
        return caps

    @contextmanager
    def _verified_path(self) -> Iterator[None]:
        """The verified path forks or commits the committed sandbox: no speculative fork
        starts meanwhile."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if not self._critical:
                self._critical_done.set()
                self._critical_done = anyio.Event()

    async def _fork_speculatively(self, fork: ForkEntry) -> Sandbox | None:
        """Fork the committed sandbox for ``fork`` (None when it is no longer at the fork's
        origin): one speculative fork at a time, after the verified path's fork or commit."""
        async with self._gate:
            while self._critical:
                await self._critical_done.wait()
            if fork.state is ForkState.RELEASED or self._sandbox.version != fork.origin:
                return None
            self._forking = fork
            try:
                return await self._sandbox.fork()
            finally:
                self._forking = None

    async def _prioritize(self, fork: ForkEntry, *, foreground: bool) -> None:
        """Run ``fork``'s commands at foreground or background priority, where its sandbox
        can (:class:`aospec.protocols.PrioritizedSandbox`); a failure only costs speed."""
        if not fork.capabilities.prioritized:
            return
        try:
            await cast(PrioritizedSandbox, fork.sandbox).set_priority(foreground=foreground)
        except Exception as exc:
            self._failed("setting a fork's priority", exc)

    # ------------------------------------------------------------------ yielding to the critical path

    def _watch(self, sandbox: Sandbox, caps: SandboxCapabilities) -> TaskHandle[None] | None:
        """Sample the command the agent waits on (running in ``sandbox``) until the returned
        task is cancelled; None when there is nothing to sample (not metered, or the
        controller is off)."""
        if not (self._pausing and caps.metered):
            return None
        return self._task_group.start_soon(self._yield_loop, sandbox, caps)

    async def _yield_loop(self, sandbox: Sandbox, caps: SandboxCapabilities) -> None:
        """Every SAMPLE_INTERVAL_S: the cores the command the agent waits on used since the
        last sample decide which guesses run (:meth:`_yield_to`); memory pressure drops the
        lowest-value fork. Paused forks are resumed when it ends. While no guess runs that
        could yield, the command is not sampled (beside a CPU-bound command on a busy host
        the engine's own CPU is the command's) and memory is checked every
        MEMORY_CHECK_SAMPLES-th time (launches check it too); while there is no guess at
        all the loop sleeps until one is launched (eight sessions at 1 ms woke it 4,000
        times for nothing: docs/live-benchmark.md)."""
        clock = self._clock
        # on the engine's clock: in replay a second of the event loop is a nanosecond
        sleep_ns = clock.sleep_ns if isinstance(clock, SleepingClock) else None
        interval_ns = round(SAMPLE_INTERVAL_S * 1e9)
        # (cpu, t) of the last sample; None while no guess could be paused: nothing is read
        # then (beside a CPU-bound command this loop's own CPU is the committed step's).
        # Guesses running as the command starts are judged from its start, as always.
        mark = (self._cpu_of(sandbox, caps), clock.now_ns()) if self._any_pausable() else None
        idle = 0
        try:
            while True:
                if sleep_ns is not None:
                    await sleep_ns(interval_ns)
                else:
                    await anyio.sleep(SAMPLE_INTERVAL_S)
                if not self.registry:
                    mark = None  # no guess at all: nothing to yield, nothing to drop
                    if self._guess_event is None:
                        self._guess_event = anyio.Event()
                    await self._guess_event.wait()
                    continue
                if self._any_pausable():
                    cpu, now = self._cpu_of(sandbox, caps), clock.now_ns()
                    if mark is not None and cpu is not None and mark[0] is not None and now > mark[1]:
                        await self._yield_to((cpu - mark[0]) / (now - mark[1]))
                    mark, idle = (cpu, now), 0
                else:
                    mark, idle = None, idle + 1
                    if idle % MEMORY_CHECK_SAMPLES:
                        continue
                self._drop_for_memory()
        finally:
            # Why shielded: the command ended (or the run is over); a guess must not stay frozen.
            with anyio.CancelScope(shield=True):
                for fork in self.registry:
                    if fork.paused:
                        await self._resume(fork)

    def _any_pausable(self) -> bool:
        """Whether a speculative fork runs that :meth:`_yield_to` could pause (or has paused)."""
        return any(self._yields(f) for f in self.registry)

    def _yields(self, f: ForkEntry) -> bool:
        """Whether ``f`` is a running guess that yields to the command the agent waits on:
        pausable, of a class that could be paused in this run, and not awaited by JASV."""
        return (
            f.running
            and f.sandbox is not None
            and f.capabilities.pausable
            and f not in self._awaited
            and type(f.sandbox) not in self._unpausable
        )

    async def _yield_to(self, command_cores: float) -> None:
        """Pause the speculative forks the host has no room for while the command the agent
        waits on uses ``command_cores`` (:func:`aospec.admission.forks_to_run`; the
        lowest-value first), resume the others."""
        now = self._clock.now_ns()
        forks: list[ForkEntry] = []
        for f in self.registry:
            if not self._yields(f):
                continue
            assert f.sandbox is not None
            forks.append(f)
            cpu = self._cpu_of(f.sandbox, f.capabilities)
            if cpu is not None:
                if f.cpu_mark is not None and not f.paused and now > f.cpu_mark[1]:
                    f.cpu_rate = (cpu - f.cpu_mark[0]) / (now - f.cpu_mark[1])
                f.cpu_mark = (cpu, now)
        if not forks:
            return
        forks.sort(key=lambda f: -f.value_s)
        # a fork whose CPU is unknown is taken to use a whole core
        demands = [f.cpu_rate if f.cpu_rate is not None else 1.0 for f in forks]
        running = sum(d for f, d in zip(forks, demands, strict=True) if not f.paused)
        n = forks_to_run(command_cores, self._admission.snapshot(), demands, running)
        for f in forks[:n]:
            if f.paused:
                await self._resume(f)
        for f in forks[n:]:
            if not f.paused:
                await self._pause(f)

    async def _pause(self, fork: ForkEntry) -> None:
        async with self._pause_lock:
            if fork.paused or not fork.running or fork.reused or fork in self._awaited:
                return  # taken by JASV (or over) while the decision was made
            fork.paused = True
            fork.paused_at_ns = self._clock.now_ns()
            try:
                await cast(PausableSandbox, fork.sandbox).pause()
            except Exception as exc:
                # only costs speed: this class of fork is not paused again in this run
                fork.paused = False
                self._unpausable.add(type(fork.sandbox))
                self._failed("pausing a speculative fork", exc, warn=True)
                return
            self._ledger.fork_paused(fork.paused_at_ns, fork.action.key)

    async def _resume(self, fork: ForkEntry) -> None:
        """Resume a paused fork; one that cannot be resumed is stopped (its task ends it as
        FAILED, so a step waiting on it runs the action as serial execution would)."""
        async with self._pause_lock:
            if not fork.paused:
                return
            fork.paused = False
            try:
                await cast(PausableSandbox, fork.sandbox).resume()
            except Exception as exc:
                self._failed("resuming a paused fork", exc, warn=True)
                self._unpausable.add(type(fork.sandbox))
                if fork.task is not None and fork.running:
                    fork.task.cancel()
                return
            now = self._clock.now_ns()
            self._ledger.fork_resumed(now, fork.action.key, now - fork.paused_at_ns)

    def _drop_for_memory(self) -> None:
        """Under memory pressure, drop the lowest-value speculative fork."""
        if not self._admission.memory_low():
            return
        victims = list(self.registry)
        if not victims:
            return
        worst = min(victims, key=lambda f: f.value_s)
        self.registry.remove(worst)
        self._ledger.fork_dropped(self._clock.now_ns(), worst.action.key)
        self.release([worst])

    # ------------------------------------------------------------------ the verified path

    async def verify(self, action: Action, emitted_ns: int) -> ForkEntry | None:
        """*Verify the action with JASV*: the fork that runs or ran ``action`` from the
        committed version, if any (the one place where a fork is accepted). A fork is reused
        only for the same action AND the same origin version; one still running is raised
        to the foreground, since the step now waits on it (:meth:`wait`)."""
        version = self._sandbox.version
        step = self._ledger.step
        self._admission.resolve(step, version, action.key)
        fork = self.registry.take(action, version)
        if fork is not None and fork.running and fork.sandbox is None and self._forking not in (None, fork):
            # Why: it has not forked yet and waits behind another guess's fork, which may never
            # return: waiting gains nothing over running the step now, which does not queue
            # behind guesses, and could wait forever.
            self.release([fork])
            fork = None
        if self._readsets is not None and (fork is None or fork.running):
            # A finished fork that read-set validation accepts beats waiting for one still
            # running from the committed version (released: it can never be used after this step).
            older = self._revalidated(action, version)
            if older is not None:
                self.registry.remove(older)
                older.rebase = True
                if fork is not None:
                    self.release([fork])
                fork = older
        self._missed(step, emitted_ns)
        if fork is None:
            return None
        self._ledger.fork_reused(emitted_ns, action.key, routed=fork.routed, rebased=fork.rebase)
        fork.reused = True
        if fork.running:
            # Why: the step now waits on this fork; its command must not yield the CPU
            # to speculative ones (a paused one is resumed: it is the step's execution now).
            self._awaited.add(fork)
            if fork.paused:
                await self._resume(fork)
            await self._prioritize(fork, foreground=True)
        return fork

    async def wait(self, fork: ForkEntry) -> ForkEntry | None:
        """Wait until the fork JASV accepted has executed: itself, or None when it failed
        (the step then runs as serial execution would)."""
        watcher = self._watch(fork.sandbox, fork.capabilities) if fork.sandbox is not None else None
        try:
            await fork.wait_finished()
        finally:
            if watcher is not None:
                watcher.cancel()
        self._awaited.discard(fork)
        return None if fork.state is ForkState.FAILED else fork

    async def execute(self, action: Action, step: int) -> ForkEntry:
        """*Execute*: run the emitted action (step ``step`` of the verified history) now: on
        the committed sandbox itself, as serial execution does, without speculation or where
        the sandbox keeps forking guesses at the state before a running command
        (``forks_during_execute``: no fork and no commit on the critical path); else in a
        fresh fork, which :meth:`commit` commits (the committed sandbox stays idle)."""
        clock = self._clock
        fork = ForkEntry(action, offset=0, probability=1.0, launched_ns=clock.now_ns(), speculative=False)
        if not self._use_forks or self._in_place:
            await self._execute_in_place(fork, step)
            return fork
        with self._verified_path():
            sandbox = await self._sandbox.fork()
        caps = self._capabilities_of(sandbox)
        watcher = self._watch(sandbox, caps)
        try:
            fork.exec_start_ns = clock.now_ns()
            fork.observation = await sandbox.execute(action)
            fork.exec_end_ns = clock.now_ns()
        except BaseException as exc:
            # Why shielded: a failed or cancelled step must still release its fork; a discard
            # that fails too must not hide the step's own error.
            with anyio.CancelScope(shield=True):
                await self._discard_sandbox(sandbox, action, exc)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        fork.sandbox = sandbox
        fork.capabilities = caps
        fork.cpu_ns = self._cpu_of(sandbox, caps)
        self._admission.executed(action, fork.exec_end_ns - fork.exec_start_ns, fork.cpu_ns)
        fork.finish(ForkState.IDLE)
        return fork

    async def _execute_in_place(self, fork: ForkEntry, step: int) -> None:
        """Run ``fork``'s action on the committed sandbox itself (:meth:`execute`)."""
        action, clock = fork.action, self._clock
        origin = self._sandbox.version
        cpu0 = self._cpu_of(self._sandbox, self._caps)
        # Why: the guesses yield to the command the agent waits on (paused while it is CPU-bound).
        watcher = self._watch(self._sandbox, self._caps) if self._use_forks else None
        fork.exec_start_ns = clock.now_ns()
        try:
            fork.observation = await self._sandbox.execute(action)
        except Exception as exc:
            # On the committed sandbox itself, as serial execution runs it: what a failed
            # command left there stays.
            try:
                moved = self._sandbox.version != origin
            except Exception:
                moved = True
            if moved:
                raise StateUnknownError(
                    f"step {step} ({label(action)!r}) failed on the committed sandbox itself after changing it "
                    f"({type(exc).__name__}: {exc}): the committed sandbox holds changes the verified history "
                    "does not",
                    step=step,
                ) from exc
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        fork.exec_end_ns = clock.now_ns()
        cpu1 = self._cpu_of(self._sandbox, self._caps)
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None and cpu1 >= cpu0 else None
        fork.cpu_ns = cpu
        self._admission.executed(action, fork.exec_end_ns - fork.exec_start_ns, cpu)
        fork.finish(ForkState.IDLE)

    def cache_hit_ns(self, fork: ForkEntry) -> int | None:
        """The tool time the result cache of the sandbox that executed ``fork`` (its own, or
        the committed sandbox without forks) saved on that execution
        (:class:`aospec.protocols.CachingSandbox`), or None: no hit, no such capability, or a
        value that cannot be read (a cache hit only counts; it never decides anything)."""
        sandbox, caps = (self._sandbox, self._caps) if fork.sandbox is None else (fork.sandbox, fork.capabilities)
        if not caps.caching:
            return None
        try:
            ns = cast(CachingSandbox, sandbox).last_cache_hit_ns
            if ns is None or isinstance(ns, bool) or not isinstance(ns, numbers.Real) or not ns >= 0:
                return None
            return int(ns)
        except Exception:
            return None

    async def commit(self, fork: ForkEntry, origin: str, step: int) -> BaseException | None:
        """*Commit*: the fork's state becomes the committed sandbox's (the one place where a
        fork is committed; ``step``: its index in the verified history).

        When the backend raises, the fork is discarded and the committed sandbox's version
        decides what happened: still ``origin`` (the commit did not happen, or the step
        changed nothing): the error is raised and ``H`` stays as it is; the fork's version
        (it happened before the error): the error is returned, for the caller to raise once
        the step is in ``H``; anything else: the committed state is unknown
        (StateUnknownError)."""
        fork.state = ForkState.COMMITTED
        self.step_access = None
        if fork.sandbox is None:  # it ran on the committed sandbox itself
            if self.record_access:
                self.step_access = await self._access_of(self._sandbox, self._caps, None)
            if self._readsets is not None:
                await self._committed_in_place(fork, origin)
            return None
        sandbox = fork.sandbox
        self._idle.discard(fork)
        target: str | None = None
        writes: WriteSet | None = None
        try:
            if fork.rebase:
                # Why: nothing committed since the fork's origin is among what it read or
                # wrote (read-set validation), so its changes on top of the committed state
                # are what running it there would give.
                with self._verified_path():
                    writes = await cast(ReadSetSandbox, self._sandbox).rebase(sandbox)
                self.step_access = (fork.reads, writes) if self.record_access else None
            else:
                target = sandbox.version
                writes = await self._step_writes(fork)
                if self.record_access:
                    self.step_access = await self._access_of(sandbox, fork.capabilities, fork)
                    writes = writes or self.step_access[1]
                # Why: the fork ran the action from exactly the committed version (JASV, or a
                # fresh fork just taken), so its state is what serial execution would give.
                with self._verified_path():
                    await self._sandbox.commit(sandbox)
        except BaseException as exc:
            fork.state = ForkState.FAILED
            with anyio.CancelScope(shield=True):
                await self._discard_sandbox(sandbox, fork.action, exc)
            try:
                now_at = self._sandbox.version
            except Exception as version_exc:
                if not isinstance(exc, Exception):
                    raise exc from None
                raise StateUnknownError(
                    f"the commit of step {step} ({label(fork.action)!r}) failed ({type(exc).__name__}: {exc}) and the "
                    f"committed sandbox's version cannot be read ({type(version_exc).__name__}: {version_exc}): "
                    "its state is unknown",
                    step=step,
                ) from exc
            if now_at == origin:
                raise
            if target is not None and now_at == target:
                # (also when cancelled: the step is in the committed state, so it goes into H)
                self._ledger.fork_committed(self._clock.now_ns(), fork.action.key)
                self._committed_writes(origin, now_at, None)
                return exc
            if not isinstance(exc, Exception):
                raise
            raise StateUnknownError(
                f"the commit of step {step} ({label(fork.action)!r}) failed ({type(exc).__name__}: {exc}) and left the "
                f"committed sandbox at version {now_at}, neither its version before ({origin}) nor the fork's "
                f"({target}): its state is unknown",
                step=step,
            ) from exc
        self._ledger.fork_committed(self._clock.now_ns(), fork.action.key)
        # the step is committed; only read-set validation needs the version now
        after = self._version_after("a commit")
        if after is not None:
            self._committed_writes(origin, after, writes)
        return None

    async def _committed_in_place(self, fork: ForkEntry, origin: str) -> None:
        """Read-set validation learns what ``fork``'s step, run on the committed sandbox
        itself, changed (the root's write set, :meth:`_step_writes`)."""
        after = self._version_after("a step")
        if after is None:
            return
        if after == origin:
            # a step that kept the version changed nothing a version names: JASV takes forks
            # from it as they are
            writes: WriteSet | None = WriteSet()
        elif self.step_access is not None and self.step_access[1] is not None:
            writes = self.step_access[1]
        else:
            writes = await self._step_writes(fork)
        self._committed_writes(origin, after, writes)

    def _version_after(self, what: str) -> str | None:
        """The committed version after ``what`` was committed; None when it cannot be read:
        then no fork from before now can be revalidated, so read-set validation stops
        (plain JASV)."""
        try:
            return self._sandbox.version
        except Exception as exc:
            self._failed(f"reading the committed version after {what}", exc)
            self._readsets = None
            return None

    def prune(self) -> None:
        """*Prune invalid forks*: those whose origin is not the committed version (with
        read-set validation, but those that may still pass it)."""
        # Why: versions never return to an earlier value, so a fork from another origin can
        # never pass JASV again.
        version = self._sandbox.version
        self._admission.pruned(version)
        keep = None
        if self._readsets is not None:
            validator = self._readsets

            def keep(f: ForkEntry) -> bool:
                if not f.traced:
                    return False
                return f.running or validator.check(f.origin or "", f.reads, f.writes) is None

        self.release(self.registry.stale(version, keep))

    # ------------------------------------------------------------------ read-set validation

    async def _trace_reads(self, fork: ForkEntry) -> bool:
        """Ask a speculative fork's sandbox to record what its command reads; False when it
        cannot (the fork is then reused by JASV alone)."""
        if not fork.capabilities.read_sets:
            return False
        try:
            await cast(ReadSetSandbox, fork.sandbox).trace_reads()
        except Exception as exc:
            self._failed(f"tracing the reads of fork {short(fork.action.key)}", exc)
            return False
        return True

    async def _record_access(self, fork: ForkEntry) -> None:
        """Read a traced fork's read and write sets (None where unknown)."""
        sandbox = cast(ReadSetSandbox, fork.sandbox)
        try:
            fork.reads = await sandbox.read_set()
            fork.writes = await sandbox.write_set()
        except Exception as exc:
            self._failed(f"the read set of fork {short(fork.action.key)}", exc)
            fork.reads = fork.writes = None
        if fork.reads is None:
            fork.traced = False

    def _revalidated(self, action: Action, version: str) -> ForkEntry | None:
        """A finished fork of ``action`` from an older origin that read-set validation
        accepts at ``version`` (the newest such), or None."""
        validator = self._readsets
        if validator is None:
            return None
        key = action.key
        for fork in reversed(list(self.registry)):
            if (
                fork.action.key == key
                and fork.state is ForkState.IDLE
                and fork.reads is not None
                and fork.origin != version
                and validator.check(fork.origin or "", fork.reads, fork.writes) is None
            ):
                return fork
        return None

    async def _step_writes(self, fork: ForkEntry) -> WriteSet | None:
        """The write set of the step committed from ``fork`` (its sandbox's, or the committed
        sandbox's when it ran there) when a live fork from an older origin may need it, else
        None (nothing will ask)."""
        if self._readsets is None or not any(f.traced for f in self.registry):
            return None
        if fork.writes is not None:
            return fork.writes
        sandbox, caps = (self._sandbox, self._caps) if fork.sandbox is None else (fork.sandbox, fork.capabilities)
        if not caps.read_sets:
            return None
        try:
            return await cast(ReadSetSandbox, sandbox).write_set()
        except Exception as exc:
            self._failed(f"the write set of step {short(fork.action.key)}", exc)
            return None

    async def _access_of(
        self, sandbox: Sandbox, caps: SandboxCapabilities, fork: ForkEntry | None
    ) -> tuple[ReadSet | None, WriteSet | None]:
        """The read and write sets of the command ``sandbox`` just ran (for recordings)."""
        if not caps.read_sets:
            return None, None
        rs = cast(ReadSetSandbox, sandbox)
        try:
            reads = fork.reads if fork is not None and fork.reads is not None else await rs.read_set()
            writes = fork.writes if fork is not None and fork.writes is not None else await rs.write_set()
        except Exception as exc:
            self._failed("recording the step's read and write sets", exc)
            return None, None
        return reads, writes

    def _committed_writes(self, before: str, after: str, writes: WriteSet | None) -> None:
        validator = self._readsets
        if validator is None:
            return
        if writes is None and not any(f.traced for f in self.registry):
            validator.reset(after)  # no live fork can ask about anything before now
        else:
            validator.committed(before, after, writes)

    # ------------------------------------------------------------------ releasing forks

    def release(self, forks: Sequence[ForkEntry]) -> None:
        """Give up forks that can no longer be reused: a running one is stopped (its task
        discards it), an idle one is discarded."""
        idle = []
        for fork in forks:
            was_idle = fork.state is ForkState.IDLE
            fork.state = ForkState.RELEASED
            if was_idle:
                idle.append(fork)
            elif fork.task is not None:
                fork.task.cancel()
        if idle:
            self._task_group.start_soon(self._discard_idle, idle)

    async def _discard_idle(self, forks: Sequence[ForkEntry]) -> None:
        # Why shielded: discarding must complete even if the run is being cancelled.
        with anyio.CancelScope(shield=True):
            for fork in forks:
                if fork in self._idle:
                    self._idle.discard(fork)
                    await self._discard(fork)

    async def _discard(self, fork: ForkEntry) -> None:
        assert fork.sandbox is not None
        await self._discard_sandbox(fork.sandbox, fork.action)
        fork.state = ForkState.DISCARDED
        self._wasted(fork, self._clock.now_ns(), fork.cpu_ns)

    async def _discard_sandbox(self, sandbox: Sandbox, action: Action, cause: BaseException | None = None) -> None:
        """Discard a fork; a discard that raises is counted, never raised: the fork's state
        is never committed, so it costs resources (the backend's session close releases
        them), not results. With ``cause`` (the error being raised), it is noted there."""
        try:
            await sandbox.discard()
        except Exception as exc:
            self._failed(f"discard of the fork of {short(action.key)}", exc, warn=True)
            if cause is not None:
                note = f"aospec: discarding the fork of the failed step failed too: {type(exc).__name__}: {exc}"
                cause.add_note(note)

    async def close(self) -> None:
        """Discard the idle forks the run still holds (called when the run ends, after its
        task group is done)."""
        if self._idle:
            with anyio.CancelScope(shield=True):
                for fork in list(self._idle):
                    self._idle.discard(fork)
                    await self._discard(fork)
