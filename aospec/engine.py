"""Algorithm 1: lossless co-speculation of tool actions and observations.

One engine, two clocks: live runs drive :class:`Engine` with a real actor and real
sandboxes in real time; trace replay drives the same code in virtual time (replay/).

An :class:`Engine` is the configuration (actor, committed sandbox, drafters, knobs); each
run is a :class:`aospec.session.Session` that holds the run's state and implements the
steps. :meth:`Engine.run` loops over them; a harness that owns its loop opens
:meth:`Engine.session` and calls ``decode``/``execute`` itself. At every verified boundary
(history ``H``, committed sandbox at version ``v``):

1. *Finish the actor*: the actor decodes the next action from ``H`` -- unless a provisional
   continuation started earlier on a drafted observation that turned out byte-identical
   (``B'``); that continuation *is* the decode of this step and keeps running. Meanwhile
   action drafters propose target actions (step offsets ``< depth``); each is launched into
   a fork of the committed sandbox (at most ``fork_width``).
2. *Verify the action with JASV*: when the actor emits ``a``, a fork is reused iff its
   action key equals ``a.key`` and its origin version equals ``v``; otherwise *execute*
   ``a`` now (in a fresh fork when speculation is on, so forks can still be taken from the
   idle committed sandbox).
3. *Predict observations*: while ``a`` runs, observation drafters propose candidates,
   ranked by EVD ``p(c) * T(c)``; the best ``branch_budget`` each start a provisional
   continuation ``decode(H + (a, c))`` as soon as their drafter has them. Drafting that
   finishes after the observation lost the race and is cancelled. A continuation that
   finishes decoding may launch its action into a fork (``provisional_targets``) and,
   within ``obs_depth``, draft further observations.
4. On the real observation: *adopt the matching continuation* (byte-identical, or with
   ``accept="canonical"`` equal once canonicalised) and cancel the others, *commit* the
   fork, *prune invalid forks* (origin no longer the committed version).

Losslessness rests on two conditions, which the caller must meet: the actor is a function
of its history (greedy or seeded decoding), so a continuation on a byte-identical history
decodes what a fresh decode would; and an action's result is a function of the state it
starts from, so a fork from the committed version yields what serial execution would. The
committed trajectory and final state then equal serial execution's. Canonical acceptance
(opt-in) adds a third: the actor's next action must not depend on the canonicalised fields;
the committed history holds the real observation either way.

Every speculative task lives in the run's task group, each in its own cancel scope. Forks
are owned by exactly one task, which discards them on cancellation unless JASV consumed them.

Faults change speed, never results: whatever fails on a speculative path (a drafter, a
provisional decode, a speculative fork, a discard) is counted (``speculative_failures``)
and the step runs as serial execution would; a failure on the verified path ends the run
with that one error, the verified history and the committed sandbox still in step
(docs/engine.md, Faults).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from aospec.admission import AdmissionModel
from aospec.engine_config import EngineConfig
from aospec.errors import ConfigError, EngineError, single_leaf
from aospec.evd import EVDEstimator
from aospec.ledger import EngineStatistics, Ledger
from aospec.protocols import (
    ActionDrafter,
    Actor,
    Capabilities,
    Clock,
    HostMonitor,
    ObservationCanonicalizer,
    ObservationDrafter,
    Sandbox,
    StreamRouter,
)
from aospec.session import Session
from aospec.types import History, Turn

if TYPE_CHECKING:
    from aospec.host import SpeculationBudget

__all__ = ["Engine", "LoopClock"]


class LoopClock:
    """The running event loop's clock (monotonic in live runs)."""

    def now_ns(self) -> int:
        return round(anyio.current_time() * 1e9)

    async def sleep_ns(self, ns: int) -> None:
        await anyio.sleep(ns / 1e9)


class Engine:
    """Runs an agent loop with co-speculation (Algorithm 1); see the module docstring.

    ``observation_drafters`` and ``action_drafters`` are consulted together (each
    drafter's candidates used as soon as it has them). ``evd`` supplies historical tool
    times for ranking (an empty estimator with the pattern kernel when omitted).
    ``canonicalizer`` is required with ``config.accept == "canonical"`` (e.g.
    ``aospec.drafters.canonicalize.Canonicalizer()``) and refused otherwise. One Engine runs one
    trajectory at a time; :meth:`statistics` describes the last (or current) run.

    ``router`` (a :class:`aospec.protocols.StreamRouter`, used when the actor is a
    :class:`aospec.protocols.StreamingActor`) names the tool being decoded from the reply's
    stream; each of its events is recorded, passed to every ``route_listeners`` callback and,
    with action speculation on, turned into offset-0 targets by the action drafters that
    have ``propose_routed`` (at most ``config.routed_width`` per event). Without a router
    nothing of this runs (docs/engine.md, Routing).

    The speculation controller (``config.admission``, docs/engine.md "The speculation
    controller") prices every guess with ``admission_model`` (what it has learned, kept
    across this Engine's runs: :attr:`admission_model`; a fresh
    :class:`aospec.admission.AdmissionModel` when omitted) at the price ``host`` (an
    :class:`aospec.protocols.HostMonitor`: ``aospec.host.ProcHostMonitor()`` live, replay's
    simulated host in replay; None: a quiet host) charges now; ``budget`` is the host's
    speculation budget (:class:`aospec.host.SpeculationBudget`, shared by every session of
    the host; None: none).
    """

    def __init__(
        self,
        actor: Actor,
        sandbox: Sandbox,
        *,
        observation_drafters: Sequence[ObservationDrafter] = (),
        action_drafters: Sequence[ActionDrafter] = (),
        evd: EVDEstimator | None = None,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        keep_events: bool = True,
        canonicalizer: ObservationCanonicalizer | None = None,
        router: StreamRouter | None = None,
        route_listeners: Sequence[Callable[[Any], None]] = (),
        admission_model: AdmissionModel | None = None,
        host: HostMonitor | None = None,
        budget: SpeculationBudget | None = None,
    ) -> None:
        self.actor = actor
        self.sandbox = sandbox
        self.observation_drafters = tuple(observation_drafters)
        self.action_drafters = tuple(action_drafters)
        self.config = config or EngineConfig()
        self.evd = evd if evd is not None else EVDEstimator()
        self.clock: Clock = clock or LoopClock()
        if self.config.accept == "canonical":
            if canonicalizer is None:
                raise ConfigError(
                    'engine: config.accept is "canonical" but no canonicalizer was given; pass one, e.g. '
                    "Engine(..., canonicalizer=aospec.drafters.canonicalize.Canonicalizer())"
                )
            if not isinstance(canonicalizer, ObservationCanonicalizer):
                raise ConfigError(f"engine: canonicalizer {canonicalizer!r} has no canonical(text) method")
        elif canonicalizer is not None:
            raise ConfigError('engine: a canonicalizer was given but config.accept is "exact"')
        self.canonicalizer = canonicalizer
        if router is not None and not isinstance(router, StreamRouter):
            raise ConfigError(f"engine: router {router!r} has no session() method")
        self.router = router
        self.route_listeners = tuple(route_listeners)
        for listener in self.route_listeners:
            if not callable(listener):
                raise ConfigError(f"engine: route listener {listener!r} is not callable")
        if host is not None and not isinstance(host, HostMonitor):
            raise ConfigError(f"engine: host {host!r} has no snapshot() method")
        self.host = host
        self.budget = budget
        self.admission_model = admission_model if admission_model is not None else AdmissionModel()
        self._keep_events = keep_events
        self._ledger = Ledger(keep_events=keep_events)
        self._running = False
        self._session: Session | None = None

    @property
    def ledger(self) -> Ledger:
        """The speculation events and totals of the last (or current) run."""
        return self._ledger

    def statistics(self) -> EngineStatistics:
        """Frozen totals of the last (or current) run."""
        return self._ledger.statistics()

    def live_forks(self) -> int:
        """Speculative forks alive in the current run now (0 between runs)."""
        return 0 if self._session is None else self._session.live_forks()

    @asynccontextmanager
    async def session(self, history: History) -> AsyncIterator[Session]:
        """Open a run from the verified ``history``: a :class:`Session` whose ``decode`` and
        ``execute`` the caller alternates. Leaving the block ends the run: whatever is still
        speculative is cancelled and every fork is released."""
        if self._running:
            raise EngineError("this Engine is already running; use one Engine per concurrent trajectory")
        self._running = True
        self._ledger = ledger = Ledger(keep_events=self._keep_events)
        # Found once for the run: the engine never probes a seam for a capability again.
        capabilities = Capabilities.of(
            actor=self.actor,
            sandbox=self.sandbox,
            observation_drafters=self.observation_drafters,
            action_drafters=self.action_drafters,
            router=self.router,
        )
        session: Session | None = None
        try:
            async with anyio.create_task_group() as tg:
                session = Session(
                    actor=self.actor,
                    sandbox=self.sandbox,
                    observation_drafters=self.observation_drafters,
                    action_drafters=self.action_drafters,
                    config=self.config,
                    clock=self.clock,
                    canonicalizer=self.canonicalizer,
                    router=self.router,
                    route_listeners=self.route_listeners,
                    task_group=tg,
                    ledger=ledger,
                    evd=self.evd.session(),
                    history=history,
                    capabilities=capabilities,
                    admission_model=self.admission_model,
                    host=self.host,
                    budget=self.budget,
                )
                self._session = session
                try:
                    yield session
                finally:
                    # Why: whatever is still in flight (forks, continuations, drafting) belongs to
                    # no committed step. Cancelling the run's scope ends it; fork tasks discard
                    # their sandboxes in shielded cleanup, so nothing leaks on success or error.
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            leaf = single_leaf(group)
            if leaf is None:
                raise
            # (its own cause kept: a FailedAfterCommitError's is the backend's error)
            raise leaf from leaf.__cause__
        finally:
            self._running = False
            self._session = None
            if session is not None:
                # Idle forks left when the run ended (or failed) are released here.
                await session.close()

    async def run(
        self,
        history: History,
        *,
        steps: int | None = None,
        stop: Callable[[Turn], bool] | None = None,
    ) -> History:
        """Run from ``history`` until ``steps`` steps are committed or ``stop(turn)`` is true
        for a committed turn; returns the verified history."""
        if self._running:
            raise EngineError("this Engine is already running; use one Engine per concurrent trajectory")
        if steps is None and stop is None:
            raise EngineError("Engine.run needs steps= or stop= to know when the trajectory ends")
        async with self.session(history) as session:
            done = 0
            while steps is None or done < steps:
                await session.execute(await session.decode())
                done += 1
                if stop is not None and stop(session.history.turns[-1]):
                    break
            return session.history
