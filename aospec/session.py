"""One trajectory's engine state, and Algorithm 1 step by step.

A :class:`Session` holds the state of one run (the verified history, the forks of the
committed sandbox, the provisional continuations, the ledger) inside the task group that
owns every speculative task of the run. :meth:`aospec.engine.Engine.run` drives it; so can
a harness that owns its agent loop::

    async with engine.session(History(task)) as session:
        while not finished:
            action = await session.decode()          # the actor's next action
            observation = await session.execute(action)

Notation of the paper's Algorithm 1 (written in ASCII here: ``B'`` is B-prime, ``P`` the
script P of the paper; docs/engine.md has the table), and the names used here:

- ``H``: the verified history (:attr:`Session.history`); ``v``: the committed sandbox's
  version (``sandbox.version``).
- ``B``: the branch that decodes the next action of ``H`` (a :class:`Branch` at level 0).
- ``P``: a branch's provisional continuations, one per drafted observation of its action
  (:attr:`Branch.continuations`); each is a :class:`Branch` one level deeper.
- ``B'``: the continuation whose draft matched the real observation: it is adopted and
  becomes the next step's ``B`` (``_Run.successor``).
- ``f``: one execution of an action in a copy-on-write fork of the committed sandbox
  (:class:`aospec.forks.ForkEntry`); ``F``: the registry of live ones (``_Run.forks``).

"Root" is not used: in runtime/ it names the committed sandbox, which is ``sandbox`` here.
"""

from __future__ import annotations

import enum
import inspect
import itertools
import logging
import numbers
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from aospec.engine_config import EngineConfig
from aospec.errors import AospecError, DrafterError, EngineError
from aospec.evd import EVDSession, rank_drafts
from aospec.forks import ForkEntry, ForkRegistry, ForkState
from aospec.ledger import EngineStatistics, Ledger
from aospec.protocols import (
    ActionDraft,
    ActionDrafter,
    Actor,
    Clock,
    ObservationCanonicalizer,
    ObservationDraft,
    ObservationDrafter,
    Sandbox,
    StreamRouter,
)
from aospec.types import Action, History

if TYPE_CHECKING:
    from anyio import TaskHandle
    from anyio.abc import TaskGroup

__all__ = ["MAX_DRAFTS_PER_CALL", "Branch", "BranchState", "Session"]

_log = logging.getLogger("aospec.engine")

#: Drafts the engine reads from one drafter call (or one streamed batch); the rest are
#: dropped and the call counted as a speculative failure. Far above what any sane drafter
#: returns (a few per source drafter): it only stops a runaway drafter from stalling the loop.
MAX_DRAFTS_PER_CALL = 4096


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    """Length of the intersection of the intervals [a0, a1] and [b0, b1]."""
    return max(0, min(a1, b1) - max(a0, b0))


class BranchState(enum.Enum):
    """The life of a :class:`Branch`.

    ``DECODING`` -> ``DECODED`` (or ``FAILED``) -> ``DRAFTING`` -> ``DRAFTED``; the branch
    being verified moves to ``SEALED`` when the real observation arrives before its
    drafting is over; any branch whose history can no longer happen moves to ``CANCELLED``.
    """

    DECODING = "decoding"  # the actor decodes the next action from the branch's history
    DECODED = "decoded"  # the action is known; no observation drafted for it yet
    FAILED = "failed"  # the decode raised: no action
    DRAFTING = "drafting"  # observation drafters run; continuations start as their drafts arrive
    DRAFTED = "drafted"  # drafting is over: the continuations are final
    SEALED = "sealed"  # the real observation came first: drafting stopped, no continuation will start
    CANCELLED = "cancelled"  # its history never happened: decode, drafting and continuations stopped


class Branch:
    """A decode of the next action from ``history``.

    ``level`` 0 decodes from the verified history (``B``); level ``k > 0`` from a history
    that ends in ``k`` drafted observations (``draft`` is the last one, ``probability``
    the product of their probabilities). ``continuations`` (``P``) maps the text of each
    drafted observation of ``action`` to the branch started on it; it is empty until the
    branch drafts. The decode runs from ``started_ns`` to ``decoded_ns``.
    """

    __slots__ = (
        "_waiter",
        "action",
        "canonical_form",
        "continuations",
        "decode_task",
        "decoded_ns",
        "draft",
        "draft_task",
        "history",
        "level",
        "probability",
        "started_ns",
        "state",
    )

    def __init__(
        self, history: History, level: int, draft: ObservationDraft | None, probability: float, started_ns: int
    ) -> None:
        self.history = history
        self.level = level
        self.draft = draft
        self.probability = probability
        self.started_ns = started_ns
        self.decoded_ns = started_ns
        self.state = BranchState.DECODING
        self.action: Action | None = None
        self.canonical_form: str | None = None
        self.continuations: dict[str, Branch] = {}
        self.decode_task: TaskHandle[None] | None = None
        self.draft_task: TaskHandle[None] | None = None
        self._waiter: anyio.Event | None = None

    def end_decode(self) -> None:
        """The decode is over (with or without an action): move on and wake waiters."""
        if self.state is BranchState.DECODING:
            self.state = BranchState.DECODED if self.action is not None else BranchState.FAILED
        if self._waiter is not None:
            self._waiter.set()

    async def wait_decoded(self) -> None:
        """Wait until the decode is over."""
        if self.state is BranchState.DECODING:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()


@dataclass(eq=False, slots=True)
class _Run:
    """Everything one run holds; each field says the invariant the steps keep."""

    task_group: TaskGroup
    """Owns every speculative task of the run (decodes, drafting, target drafting, forks);
    cancelled when the run ends, so no task outlives it."""
    ledger: Ledger
    evd: EVDSession | None
    history: History
    """``H``: the verified history; it holds committed turns only."""
    boundary_ns: int
    """When ``H`` was verified (the last commit, or the start): a step's actor wait starts here."""
    forks: ForkRegistry = field(default_factory=ForkRegistry)
    """``F``: live speculative forks by (origin version, action key), each RUNNING or IDLE."""
    idle: set[ForkEntry] = field(default_factory=set)
    """Forks that executed and that no task owns (IDLE, or RELEASED from IDLE): the run
    commits or discards each; empty once the run is closed."""
    successor: Branch | None = None
    """``B'``: the continuation adopted at the last commit; it decodes from exactly ``H``."""
    pending: Branch | None = None
    """``B`` from the moment :meth:`Session.decode` returned its action until
    :meth:`Session.execute` committed it; None between steps."""
    emitted_ns: int = 0
    """When ``pending``'s action was emitted."""
    targets: TaskHandle[None] | None = None
    """The target-drafting task of the current boundary (cancelled at the next one)."""
    inflight: tuple[str, str] | None = None
    """``(v, a.key)`` while the committed step executes ``a`` from ``v``."""
    awaited: set[ForkEntry] = field(default_factory=set)
    """Speculative forks JASV accepted while they still ran: the step waits on them, so
    they run at foreground priority (the others in the background)."""


class Session:
    """One run of Algorithm 1: the state of one trajectory and its steps.

    Open one with :meth:`aospec.engine.Engine.session` (it owns the run's task group). Call
    :meth:`decode` and :meth:`execute` alternately; each ``execute`` commits one step.
    """

    def __init__(
        self,
        *,
        actor: Actor,
        sandbox: Sandbox,
        observation_drafters: Sequence[ObservationDrafter],
        action_drafters: Sequence[ActionDrafter],
        config: EngineConfig,
        clock: Clock,
        canonicalizer: ObservationCanonicalizer | None,
        task_group: TaskGroup,
        ledger: Ledger,
        evd: EVDSession | None,
        history: History,
        router: StreamRouter | None = None,
        route_listeners: Sequence[Callable[[Any], None]] = (),
    ) -> None:
        self._actor = actor
        self._sandbox = sandbox
        self._observation_drafters = tuple(observation_drafters)
        self._action_drafters = tuple(action_drafters)
        self._config = config
        self._clock = clock
        self._canon = canonicalizer
        self._obs_on = config.branch_budget > 0 and bool(self._observation_drafters)
        self._targets_on = config.fork_width > 0 and bool(self._action_drafters)
        self._provisional_targets_on = config.provisional_targets and self._obs_on
        self._use_forks = self._targets_on or self._provisional_targets_on
        # Routing needs a streaming actor: decodes then report their stream to a fresh router
        # session each. Without a router the actor is called exactly as before.
        self._router = router if router is not None and hasattr(actor, "decode_streaming") else None
        self._router_takes_history = self._router is not None and _takes_an_argument(self._router.session)
        self._route_listeners = tuple(route_listeners)
        self._routed_drafters = tuple(d for d in self._action_drafters if hasattr(d, "propose_routed"))
        # Routed targets are action drafting: off with fork_width 0 (then forks may be off
        # too, and nothing may fork the committed sandbox while the step runs on it).
        self._routed_on = (
            self._router is not None and self._targets_on and config.routed_width > 0 and bool(self._routed_drafters)
        )
        self._run = _Run(task_group, ledger, evd, history, clock.now_ns())
        self._warned: set[str] = set()
        # Speculative forks of the committed sandbox go one at a time, and none starts while
        # the verified path forks or commits it: the backend serialises these calls, and a
        # step's own fork or commit queued behind a burst of guesses' forks was most of a
        # step's overhead in live runs.
        self._fork_gate = anyio.Lock()
        self._critical = 0
        self._critical_done = anyio.Event()

    @property
    def history(self) -> History:
        """``H``: the verified history (committed steps only)."""
        return self._run.history

    def statistics(self) -> EngineStatistics:
        """Frozen totals of this run so far."""
        return self._run.ledger.statistics()

    # ------------------------------------------------------------------ the two calls of a step

    async def decode(self, history: History | None = None) -> Action:
        """The actor's next action after ``H`` (line: *finish the actor*).

        Speculative targets for this boundary are launched first. The action comes from
        the adopted continuation ``B'`` when there is one, else from a fresh decode.
        ``history`` (default ``H``) lets a harness that edited its history restart from
        it: the continuation adopted for the old one is cancelled; forks stay, since JASV
        checks versions, not histories.
        """
        run = self._run
        if run.pending is not None:
            raise EngineError("decode() was called twice: execute() the action it returned first")
        if history is not None and history is not run.history and history != run.history:
            self._restart(history)
        if self._targets_on:
            self._speculate_actions(run.history)
        branch = await self._finish_actor()
        run.emitted_ns = self._clock.now_ns()
        run.pending = branch
        assert branch.action is not None
        return branch.action

    async def execute(self, action: Action) -> str:
        """Verify, execute and commit the action :meth:`decode` returned; returns its
        observation. ``H`` then ends in this step.

        A failure on this path (reading the committed version, forking it for the step,
        the step's own execution, its commit) is raised as itself, with a note naming the
        step; ``H`` and the committed sandbox then still agree (docs/engine.md, Faults), and
        calling ``execute(action)`` again retries the step."""
        run = self._run
        branch = run.pending
        if branch is None or action != branch.action:
            raise EngineError("execute() runs the action decode() returned, once: call decode() first")
        try:
            return await self._execute_step(branch, action)
        except Exception as exc:
            self._note_failure(exc, action)
            raise
        finally:
            run.inflight = None

    async def _execute_step(self, branch: Branch, action: Action) -> str:
        run = self._run
        ledger = run.ledger
        emitted_ns = run.emitted_ns
        origin = self._sandbox.version
        run.inflight = (origin, action.key)

        fork = self._verify(action) if self._use_forks else None
        if fork is not None:
            ledger.fork_reused(emitted_ns, action.key, routed=fork.routed)
            if fork.running:
                # Why: the step now waits on this fork; its command must not yield the CPU
                # to speculative ones.
                run.awaited.add(fork)
                if fork.sandbox is not None:
                    await self._prioritize(fork.sandbox, foreground=True)
            if self._obs_on and fork.running and branch.state is BranchState.DECODED:
                self._predict_observations(branch)
            await fork.wait_finished()
            run.awaited.discard(fork)
            if fork.state is ForkState.FAILED:
                fork = None
        if fork is None:
            if self._obs_on and branch.state is BranchState.DECODED:
                self._predict_observations(branch)
            fork = await self._execute(action)
        observation = fork.observation
        assert observation is not None
        # Read before the commit consumes the fork: did the executing sandbox's result cache
        # serve this action (counted once the step is committed)?
        cache_hit_ns = _cache_hit_ns(fork.sandbox if fork.sandbox is not None else self._sandbox)

        self._seal(branch)
        late_error = await self._commit(fork, origin)

        before = run.history
        try:
            self._after_commit(branch, action, fork, observation, emitted_ns, cache_hit_ns)
        except BaseException as exc:
            if run.history is before:
                # Why: the step is committed; whatever failed after the commit (adopting a
                # continuation, the ledger), H must hold it, as the committed state does.
                run.successor = None
                run.history = before.extend(action, observation)
            if isinstance(exc, Exception) and not getattr(exc, "_aospec_noted", False):
                exc._aospec_noted = True  # type: ignore[attr-defined]
                exc.add_note(
                    f"aospec: step {len(before)} was committed, then this failed; the verified history holds it "
                    f"({len(run.history)} steps in all) and the committed sandbox is at their state"
                )
            raise
        finally:
            run.pending = None
        if late_error is not None:
            # The backend raised (or the run was cancelled), but the commit took effect: the
            # step is in H as it is in the committed state; the error is raised all the same.
            if not isinstance(late_error, Exception):
                raise late_error
            late_error._aospec_noted = True  # type: ignore[attr-defined]
            late_error.add_note(
                f"aospec: the backend raised while committing step {ledger.step - 1} ({_short(action.key)!r}), "
                f"but the commit took effect: the verified history holds that step ({len(run.history)} in all) "
                "and the committed sandbox is at their state"
            )
            raise late_error
        if self._use_forks:
            self._prune()
        return observation

    def _after_commit(
        self,
        branch: Branch,
        action: Action,
        fork: ForkEntry,
        observation: str,
        emitted_ns: int,
        cache_hit_ns: int | None = None,
    ) -> None:
        """The step is committed: its cache hit and times into the ledger, its tool time
        into EVD, the matching continuation adopted, ``H`` extended."""
        run, ledger = self._run, self._run.ledger
        now = self._clock.now_ns()
        if cache_hit_ns is not None:
            ledger.cache_hit(now, action.key, cache_hit_ns)
        tool_ns = fork.tool_ns(now)
        tool_waited = 0
        if fork.exec_start_ns is not None:
            end = fork.exec_end_ns if fork.exec_end_ns is not None else now
            tool_waited = _overlap(emitted_ns, now, fork.exec_start_ns, end)
        ledger.committed_step(
            now,
            action.key,
            wait_actor_ns=emitted_ns - run.boundary_ns,
            wait_tool_ns=now - emitted_ns,
            decode_ns=branch.decoded_ns - branch.started_ns,
            tool_ns=tool_ns,
            decode_waited_ns=_overlap(run.boundary_ns, emitted_ns, branch.started_ns, branch.decoded_ns),
            tool_waited_ns=tool_waited,
            executed=not action.is_none,
        )
        if run.evd is not None and not action.is_none:
            try:
                run.evd.observe(action, observation, tool_ns * 1e-9)
            except Exception as exc:
                self._speculation_failed("learning the step's tool time (EVD)", exc)  # it only ranks drafts
        run.boundary_ns = now
        run.pending = None

        successor = run.successor = self._adopt(branch, observation, now)
        run.history = successor.history if successor is not None else run.history.extend(action, observation)

    def _note_failure(self, exc: BaseException, action: Action) -> None:
        """Name the failed step on an error of the verified path (once)."""
        if getattr(exc, "_aospec_noted", False):
            return
        try:
            exc._aospec_noted = True  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions without a __dict__
            return
        n = len(self._run.history)
        what = action.command if action.command is not None else action.key
        exc.add_note(
            f"aospec: step {n} ({_short(what)!r}) failed on the verified path; the verified history "
            f"holds {n} committed step(s) and the committed sandbox is at their state"
        )

    # ------------------------------------------------------------------ Algorithm 1, line by line

    async def _finish_actor(self) -> Branch:
        """*Finish the actor*: ``B`` is the adopted ``B'`` once it has decoded, or (none was
        adopted, or its decode failed) a fresh decode of ``H``."""
        run = self._run
        branch, run.successor = run.successor, None
        if branch is not None:
            await branch.wait_decoded()
            if branch.action is None:
                branch = None
        if branch is None:
            # The verified history's own decode runs right here: nothing else waits for it.
            branch = Branch(run.history, 0, None, 1.0, self._clock.now_ns())
            await self._decode(branch)
        return branch

    def _verify(self, action: Action) -> ForkEntry | None:
        """*Verify the action with JASV*: the fork that runs or ran ``action`` from the
        committed version, if any. A fork is reused only for the same action AND the same
        origin version."""
        return self._run.forks.take(action, self._sandbox.version)

    async def _execute(self, action: Action) -> ForkEntry:
        """*Execute*: run the emitted action now, in a fresh fork when speculation needs the
        committed sandbox kept idle (:meth:`_commit` commits it), else on the committed
        sandbox itself."""
        clock = self._clock
        fork = ForkEntry(action, offset=0, probability=1.0, launched_ns=clock.now_ns(), speculative=False)
        if not self._use_forks:
            origin = self._sandbox.version
            fork.exec_start_ns = clock.now_ns()
            try:
                fork.observation = await self._sandbox.execute(action)
            except Exception as exc:
                # Without forks the step runs on the committed sandbox itself, as serial
                # execution does: what a failed command left there stays.
                try:
                    moved = self._sandbox.version != origin
                except Exception:
                    moved = True
                if moved:
                    exc._aospec_noted = True  # type: ignore[attr-defined]
                    exc.add_note(
                        f"aospec: step {len(self._run.history)} failed on the committed sandbox itself (no forks) "
                        "after changing it: the committed sandbox holds changes the verified history does not"
                    )
                raise
            fork.exec_end_ns = clock.now_ns()
            fork.finish(ForkState.IDLE)
            return fork
        self._enter_critical()
        try:
            sandbox = await self._sandbox.fork()
        finally:
            self._leave_critical()
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
        fork.sandbox = sandbox
        fork.finish(ForkState.IDLE)
        return fork

    def _predict_observations(self, branch: Branch) -> None:
        """*Predict observations* of ``branch``'s action while it runs: drafting starts the
        continuations ``P`` (see :meth:`_start_continuations`)."""
        branch.state = BranchState.DRAFTING
        branch.draft_task = self._run.task_group.start_soon(self._draft, branch)

    def _seal(self, branch: Branch) -> None:
        """The real observation of ``B``'s action has arrived: no continuation starts after it."""
        if branch.state is BranchState.DRAFTING:
            # Why: drafting that finishes after the real observation lost the race; its
            # continuations could only ever be discarded.
            assert branch.draft_task is not None
            branch.draft_task.cancel()
            self._run.ledger.drafting_lost(self._clock.now_ns(), "drafting lost the race")
        if branch.state in (BranchState.DECODED, BranchState.DRAFTING):
            branch.state = BranchState.SEALED

    def _adopt(self, branch: Branch, observation: str, now: int) -> Branch | None:
        """*Adopt the matching continuation* ``B'``: the one whose draft equals
        ``observation`` (byte for byte, else, under canonical acceptance, once
        canonicalised); cancel the rest of ``P``."""
        continuations = branch.continuations
        if not continuations:
            return None
        keep = continuations.pop(observation, None)
        canonical_hit = False
        if keep is None and self._canon is not None:
            try:
                form: str | None = self._canon.canonical(observation)
            except Exception as exc:
                # Canonical acceptance only saves a decode: without it the step decodes afresh.
                self._speculation_failed("canonicalising the observation", exc)
                form = None
            text = (
                None if form is None else next((t for t, c in continuations.items() if c.canonical_form == form), None)
            )
            if text is not None:
                keep = continuations.pop(text)
                canonical_hit = True
        for other in continuations.values():
            # Why: a continuation on a draft that differs from the real observation
            # conditions on a history that never happened.
            self._cancel(other, now)
        branch.continuations = {}
        if keep is None:
            return None
        if canonical_hit:
            self._run.ledger.draft_canonical_hit(now, _short(observation))
            # Why: the actor must finally see the real observation. The continuation keeps
            # decoding on the draft's bytes (the opt-in approximation), but the committed
            # history, and every history drafted or decoded from here on, holds the real one.
            assert branch.action is not None
            self._rebase(keep, branch.history.extend(branch.action, observation))
        else:
            self._run.ledger.draft_hit(now, _short(observation))
        self._promote(keep)
        return keep

    async def _commit(self, fork: ForkEntry, origin: str) -> BaseException | None:
        """*Commit*: the fork's state becomes the committed sandbox's.

        When the backend raises, the fork is discarded and the committed sandbox's version
        decides what happened: still ``origin`` (the commit did not happen, or the step
        changed nothing): the error is raised and ``H`` stays as it is; the fork's version
        (it happened before the error): the error is returned, for the caller to raise once
        the step is in ``H``; anything else: the committed state is unknown (EngineError)."""
        fork.state = ForkState.COMMITTED
        if fork.sandbox is None:
            return None  # it ran on the committed sandbox itself
        sandbox = fork.sandbox
        self._run.idle.discard(fork)
        target: str | None = None
        try:
            target = sandbox.version
            # Why: the fork ran the action from exactly the committed version (JASV, or a fresh
            # fork just taken), so its state is what serial execution would give.
            self._enter_critical()
            try:
                await self._sandbox.commit(sandbox)
            finally:
                self._leave_critical()
        except BaseException as exc:
            fork.state = ForkState.FAILED
            with anyio.CancelScope(shield=True):
                await self._discard_sandbox(sandbox, fork.action, exc)
            try:
                now_at = self._sandbox.version
            except Exception as version_exc:
                if not isinstance(exc, Exception):
                    raise exc from None
                raise EngineError(
                    f"the commit of {_short(fork.action.key)!r} failed ({type(exc).__name__}: {exc}) and the "
                    f"committed sandbox's version cannot be read ({type(version_exc).__name__}: {version_exc}): "
                    "its state is unknown"
                ) from exc
            if now_at == origin:
                raise
            if target is not None and now_at == target:
                # (also when cancelled: the step is in the committed state, so it goes into H)
                self._run.ledger.fork_committed(self._clock.now_ns(), fork.action.key)
                return exc
            if not isinstance(exc, Exception):
                raise
            raise EngineError(
                f"the commit of {_short(fork.action.key)!r} failed ({type(exc).__name__}: {exc}) and left the "
                f"committed sandbox at version {now_at}, neither its version before ({origin}) nor the fork's "
                f"({target}): its state is unknown"
            ) from exc
        self._run.ledger.fork_committed(self._clock.now_ns(), fork.action.key)
        return None

    def _prune(self) -> None:
        """*Prune invalid forks*: those whose origin is not the committed version."""
        # Why: versions never return to an earlier value, so a fork from another origin can
        # never pass JASV again.
        self._release(self._run.forks.stale(self._sandbox.version))

    # ------------------------------------------------------------------ branches

    async def _decode(self, branch: Branch) -> Action | None:
        """Decode ``branch``'s action: the one timed path of both decodes (the verified
        one awaited here, provisional ones in their own task)."""
        try:
            if self._router is None:
                branch.action = await self._actor.decode(branch.history)
            else:
                on_delta = self._route_feed(branch)
                branch.action = await self._actor.decode_streaming(branch.history, on_delta)  # type: ignore[attr-defined]
            branch.decoded_ns = self._clock.now_ns()
        finally:
            branch.end_decode()
        return branch.action

    async def _decode_continuation(self, branch: Branch) -> None:
        """A provisional continuation: decode, then launch its action into a fork
        (``provisional_targets``) and, within ``obs_depth``, draft its observations."""
        try:
            await self._decode(branch)
        except Exception as exc:
            # A provisional decode that fails only costs speed: the verified history's own
            # decode (a fresh one, should this branch be adopted) decides.
            self._speculation_failed("decode", exc)
        if branch.state is not BranchState.DECODED or branch.level == 0:
            return  # cancelled, failed, or adopted as B' while decoding (the step takes it from here)
        action = branch.action
        assert action is not None
        if self._provisional_targets_on and not action.is_none:
            self._launch_fork(action, branch.level, branch.probability)
        if branch.level < self._config.obs_depth:
            self._predict_observations(branch)

    def _restart(self, history: History) -> None:
        """A harness gave another verified history: the continuation adopted for the old
        one conditions on a history that is not the verified one any more."""
        run = self._run
        if run.successor is not None:
            self._cancel(run.successor, self._clock.now_ns())
            run.successor = None
        run.history = history

    def _rebase(self, branch: Branch, history: History) -> None:
        """Give ``branch`` (and its subtree) ``history`` in place of the one it started on."""
        branch.history = history
        if branch.continuations and branch.action is not None:
            for text, child in branch.continuations.items():
                self._rebase(child, history.extend(branch.action, text))

    def _promote(self, branch: Branch) -> None:
        """Shift a subtree one level towards the verified history; branches that now fall
        within ``obs_depth`` and have decoded start drafting."""
        branch.level -= 1
        if branch.continuations:
            for child in branch.continuations.values():
                self._promote(child)
        elif 0 < branch.level < self._config.obs_depth and branch.state is BranchState.DECODED:
            self._predict_observations(branch)

    def _cancel(self, branch: Branch, now: int) -> None:
        """Stop ``branch`` and its subtree: their histories never happened."""
        if branch.state is BranchState.CANCELLED:
            return
        branch.state = BranchState.CANCELLED
        if branch.decode_task is not None:
            branch.decode_task.cancel()
        if branch.draft_task is not None:
            branch.draft_task.cancel()
        decoded = (branch.decoded_ns if branch.action is not None else now) - branch.started_ns
        self._run.ledger.draft_cancelled(now, _short(branch.draft.text) if branch.draft else "", decoded)
        for child in branch.continuations.values():
            self._cancel(child, now)
        branch.continuations = {}

    # ------------------------------------------------------------------ observation drafting

    async def _draft(self, branch: Branch) -> None:
        n = max(self._config.draft_candidates, self._config.branch_budget)
        drafters = self._observation_drafters
        if len(drafters) == 1:
            await self._draft_with(drafters[0], branch, n)
        else:
            # Independent drafters run side by side; each one's drafts start their
            # continuations as soon as they are ready, so cheap ones never wait for slow ones.
            async with anyio.create_task_group() as tg:
                for drafter in drafters:
                    tg.start_soon(self._draft_with, drafter, branch, n)
        if branch.state is BranchState.DRAFTING:
            branch.state = BranchState.DRAFTED

    async def _draft_with(self, drafter: ObservationDrafter, branch: Branch, n: int) -> None:
        """One drafter's candidates for ``branch``'s action, batch by batch when it streams;
        a drafter failure only loses its (remaining) candidates, and invalid drafts are
        dropped (both counted: :meth:`_speculation_failed`)."""
        action = branch.action
        assert action is not None
        who = f"observation drafter {type(drafter).__name__}"
        stream = getattr(drafter, "draft_stream", None)
        if stream is None:
            try:
                drafts = self._valid_drafts(await drafter.draft(branch.history, action, n), ObservationDraft, who)
                self._start_continuations(branch, drafts)
            except Exception as exc:
                self._speculation_failed(who, exc)
            return
        try:
            batches = aiter(stream(branch.history, action, n))
        except Exception as exc:
            self._speculation_failed(who, exc)
            return
        async with aclosing(batches):  # type: ignore[type-var]
            while True:
                try:
                    drafts = self._valid_drafts(await anext(batches), ObservationDraft, who)
                    self._start_continuations(branch, drafts)
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    # (ranking or canonicalising them failing too: speculation only)
                    self._speculation_failed(who, exc)
                    return

    def _valid_drafts(self, drafts: object, kind: type, who: str) -> list:
        """The well-formed drafts of one drafter call (``kind``: ObservationDraft or
        ActionDraft); the malformed ones are dropped and the call counted as a failure. A
        result that is no sequence of drafts raises DrafterError (the call is lost)."""
        if isinstance(drafts, (str, bytes)) or not hasattr(drafts, "__iter__"):
            raise DrafterError(f"returned {type(drafts).__name__}, not a sequence of {kind.__name__}")
        items = list(itertools.islice(drafts, MAX_DRAFTS_PER_CALL + 1))  # type: ignore[call-overload]
        problems: list[str] = []
        if len(items) > MAX_DRAFTS_PER_CALL:
            items = items[:MAX_DRAFTS_PER_CALL]
            problems.append(f"more than {MAX_DRAFTS_PER_CALL} drafts (the rest dropped)")
        good = []
        for d in items:
            problem = _draft_problem(d, kind)
            if problem is None:
                good.append(d)
            else:
                problems.append(problem)
        if problems:
            dropped = len(items) - len(good)
            self._speculation_failed(
                who, DrafterError(f"{dropped} malformed draft(s) dropped; first problem: {problems[0]}"), warn=True
            )
        return good

    def _start_continuations(self, branch: Branch, drafts: Sequence[ObservationDraft]) -> None:
        """Rank ``drafts`` (EVD by default) and start a continuation on each of the best,
        within what is left of the branch budget; texts (or, under canonical acceptance,
        canonical forms) already continued are skipped."""
        if branch.state is not BranchState.DRAFTING:
            return  # sealed or cancelled while these drafts were made
        cfg, run, canon = self._config, self._run, self._canon
        started = branch.continuations
        room = cfg.branch_budget - len(started)
        if room <= 0:
            return
        if started:
            drafts = [d for d in drafts if d.text not in started]
        budget = room if canon is None else len(drafts)
        ranked = rank_drafts(drafts, cfg.rank, budget, run.evd, min_probability=cfg.min_draft_probability)
        forms: list[str | None] = [None] * len(ranked)
        if canon is not None:
            # Drafts that are equal once canonicalised would be accepted for the same real
            # observations: one continuation (the best ranked) stands for them all.
            seen = {c.canonical_form for c in started.values()}
            kept: list[tuple[ObservationDraft, str]] = []
            for d in ranked:
                form = canon.canonical(d.text)
                if form not in seen:
                    seen.add(form)
                    kept.append((d, form))
                    if len(kept) == room:
                        break
            ranked = [d for d, _ in kept]
            forms = [f for _, f in kept]
        action = branch.action
        assert action is not None
        now = self._clock.now_ns()
        for d, form in zip(ranked, forms, strict=True):
            child = Branch(
                branch.history.extend(action, d.text), branch.level + 1, d, branch.probability * d.probability, now
            )
            child.canonical_form = form
            child.decode_task = run.task_group.start_soon(self._decode_continuation, child)
            started[d.text] = child
            run.ledger.draft_started(now, _short(d.text))

    # ------------------------------------------------------------------ routing (tool named mid-decode)

    def _route_feed(self, branch: Branch) -> Callable[[object], None]:
        """The ``on_delta`` callback of ``branch``'s decode: every delta into a fresh router
        session, every router event into :meth:`_route`. Called synchronously by the actor
        for each delta, so it does no more than that, and it never raises: a router that
        fails is counted and not fed again during this decode."""
        assert self._router is not None
        try:
            if self._router_takes_history:
                router_session = self._router.session(branch.history)
            else:
                router_session = self._router.session()
            feed = router_session.feed
        except Exception as exc:
            self._speculation_failed(f"router {type(self._router).__name__}", exc)
            return _ignore_delta
        drafted: set[str] = set()  # tools already sent to the routed drafters for this decode
        broken = False

        def on_delta(delta: object) -> None:
            nonlocal broken
            if broken or branch.state is BranchState.CANCELLED:
                return
            try:
                events = feed(delta)
                if events:
                    for event in events:
                        self._route(branch, event, drafted)
            except Exception as exc:
                broken = True
                self._speculation_failed(f"router {type(self._router).__name__}", exc)

        return on_delta

    def _route(self, branch: Branch, event: Any, drafted: set[str]) -> None:
        """One router event of ``branch``'s decode: into the ledger, to every route listener,
        and (once per tool and decode) to the routed action drafters."""
        tool = event.tool
        if not isinstance(tool, str) or not tool:
            raise DrafterError(f"router event names no tool: {event!r}")
        run = self._run
        now = self._clock.now_ns()
        p = getattr(event, "confidence", None)
        p = f"{p:.2f}" if isinstance(p, float) else p
        detail = f"{tool} ({getattr(event, 'router', '?')}, p={p}, at {getattr(event, 'position', '?')})"
        run.ledger.route_fired(now, _short(detail, 120))
        for listener in self._route_listeners:
            try:
                listener(event)
            except Exception as exc:
                self._speculation_failed(
                    f"route listener {getattr(listener, '__qualname__', type(listener).__name__)}", exc
                )
        if self._routed_on and tool not in drafted and (branch.level == 0 or self._provisional_targets_on):
            # A provisional branch's action is launched early only under provisional_targets
            # (as its decoded action would be): JASV keeps any fork safe, this only bounds work.
            drafted.add(tool)
            run.task_group.start_soon(self._draft_routed, branch, tool)

    async def _draft_routed(self, branch: Branch, tool: str) -> None:
        """The routed drafters' targets for the action ``branch`` is decoding (a router named
        its ``tool``), launched into forks as offset-0 targets of ``branch``'s history."""
        width = self._config.routed_width
        proposals: list[ActionDraft] = []
        drafters = self._routed_drafters
        if len(drafters) == 1:
            await self._propose_routed_with(drafters[0], branch.history, tool, proposals)
        else:
            async with anyio.create_task_group() as tg:
                for drafter in drafters:
                    tg.start_soon(self._propose_routed_with, drafter, branch.history, tool, proposals)
        if branch.state is not BranchState.DECODING:
            # Why: the action is emitted (a routed guess of it is useless now: JASV or the
            # step's own execution has it), or the branch's history never happened. While
            # it decodes, a level-0 branch is still at the boundary it was routed at.
            return
        proposals.sort(key=lambda d: -d.probability)
        seen: set[str] = set()
        launched = 0
        for d in proposals:
            if launched >= width:
                break
            if d.offset != 0 or d.action.is_none or d.action.key in seen:
                continue
            seen.add(d.action.key)
            # offset 0 of the branch's history is offset ``level`` of the verified one
            if self._launch_fork(d.action, branch.level, d.probability, routed=True):
                launched += 1

    async def _propose_routed_with(
        self, drafter: ActionDrafter, history: History, tool: str, out: list[ActionDraft]
    ) -> None:
        """One routed drafter's targets into ``out``; a failure only loses its targets, and
        malformed targets are dropped (both counted)."""
        who = f"routed action drafter {type(drafter).__name__}"
        try:
            proposals = await drafter.propose_routed(history, tool, self._config.routed_width)  # type: ignore[attr-defined]
            out.extend(self._valid_drafts(proposals, ActionDraft, who))
        except Exception as exc:
            self._speculation_failed(who, exc)

    # ------------------------------------------------------------------ action speculation and forks

    def _speculate_actions(self, history: History) -> None:
        """Launch the action drafters' targets for this boundary into forks."""
        run = self._run
        if run.targets is not None:
            # Why: targets drafted for the previous boundary are offsets from a history that
            # is no longer the verified one.
            run.targets.cancel()
        run.targets = run.task_group.start_soon(self._draft_targets, history, run.ledger.step)

    async def _draft_targets(self, history: History, step: int) -> None:
        cfg, run = self._config, self._run
        proposals: list[ActionDraft] = []
        drafters = self._action_drafters
        if len(drafters) == 1:
            await self._propose_with(drafters[0], history, proposals)
        else:
            async with anyio.create_task_group() as tg:
                for drafter in drafters:
                    tg.start_soon(self._propose_with, drafter, history, proposals)
        if run.ledger.step != step:
            return  # the boundary passed while drafting: these offsets no longer apply
        proposals.sort(key=lambda d: (-d.probability, d.offset))
        seen: set[str] = set()
        launched = 0
        for d in proposals:
            if launched >= cfg.fork_width:
                break
            if d.offset >= cfg.depth or d.action.is_none or d.action.key in seen:
                continue
            seen.add(d.action.key)
            if self._launch_fork(d.action, d.offset, d.probability):
                launched += 1

    async def _propose_with(self, drafter: ActionDrafter, history: History, out: list[ActionDraft]) -> None:
        """One action drafter's targets into ``out``; a failure only loses its targets, and
        malformed targets are dropped (both counted)."""
        who = f"action drafter {type(drafter).__name__}"
        try:
            proposals = await drafter.propose(history, self._config.fork_width, self._config.depth)
            out.extend(self._valid_drafts(proposals, ActionDraft, who))
        except Exception as exc:
            self._speculation_failed(who, exc)

    def _launch_fork(self, action: Action, offset: int, probability: float, *, routed: bool = False) -> bool:
        """Start ``f``: ``action`` in a fork of the committed sandbox, registered at once
        under the version it forks from (False when an equal one is live or running).
        ``routed``: drafted once a router named the tool being decoded (counted apart)."""
        run = self._run
        try:
            version = self._sandbox.version
        except Exception as exc:
            # Speculation only: the verified path reads the version too, and fails there.
            self._speculation_failed("reading the committed version", exc)
            return False
        key = action.key
        if run.forks.has(version, key) or run.inflight == (version, key):
            # An equal fork is live, or the committed step is executing this very action
            # from this very state already.
            return False
        excess = len(run.forks) + 1 - self._config.max_live_forks
        if excess > 0:
            # Why: live forks hold sandboxes; past the cap the oldest (drafted for the
            # earliest boundary, so the least likely still to be emitted) make room.
            self._release(run.forks.oldest(excess))
        now = self._clock.now_ns()
        fork = ForkEntry(action, offset=offset, probability=probability, launched_ns=now, speculative=True)
        # Registered at once under the version it will fork from, so JASV finds it (and waits
        # for it) even if the actor emits this action before the fork task has run.
        fork.origin = version
        fork.routed = routed
        run.forks.add(fork)
        run.ledger.fork_launched(now, key, routed=routed)
        fork.task = run.task_group.start_soon(self._run_fork, fork)
        return True

    async def _run_fork(self, fork: ForkEntry) -> None:
        """Fork the committed sandbox and run a speculative target in it. Any failure here
        (forking, executing, reading the fork's version) only loses this fork's result:
        JASV then runs the action as serial execution would."""
        run = self._run
        sandbox: Sandbox | None = None
        try:
            # Why: a fork released before its task ever ran must not fork at all.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                sandbox = await self._speculative_fork(fork)
                if sandbox is None:
                    # released, or the committed state moved on first: it could never pass JASV
                    run.ledger.fork_discarded(self._clock.now_ns(), fork.action.key, 0)
                    return
                fork.sandbox = sandbox
                if fork.state is ForkState.RELEASED or sandbox.version != fork.origin:
                    # Released before it started, or the committed state moved on between launch
                    # and fork: this fork could never pass JASV under the version it is registered for.
                    return
                if fork not in run.awaited:
                    # Why: a guess must never take CPU or IO from the command the agent waits on.
                    await self._prioritize(sandbox, foreground=False)
                    if fork in run.awaited:  # JASV accepted it meanwhile
                        await self._prioritize(sandbox, foreground=True)
                fork.exec_start_ns = self._clock.now_ns()
                fork.observation = await sandbox.execute(fork.action)
            except Exception as exc:
                self._speculation_failed(f"fork {_short(fork.action.key)}", exc)
                return
            fork.exec_end_ns = self._clock.now_ns()
            if fork.state is ForkState.RELEASED:
                return  # released while finishing: discarded below
            # From here the idle fork belongs to the run: JASV commits it, or pruning (or the
            # end of the run) discards it.
            fork.state = ForkState.IDLE
            run.idle.add(fork)
        finally:
            if fork.state is ForkState.IDLE:
                fork.finish(ForkState.IDLE)
            else:
                fork.finish(ForkState.DISCARDED if fork.state is ForkState.RELEASED else ForkState.FAILED)
                run.forks.remove(fork)
                if sandbox is not None:
                    # Why shielded: the fork must be released even when this task is being
                    # cancelled, or its layers/processes would leak.
                    with anyio.CancelScope(shield=True):
                        await self._discard_sandbox(sandbox, fork.action)
                    now = self._clock.now_ns()
                    run.ledger.fork_discarded(now, fork.action.key, fork.tool_ns(now), speculative=fork.speculative)

    def _enter_critical(self) -> None:
        self._critical += 1

    def _leave_critical(self) -> None:
        self._critical -= 1
        if not self._critical:
            self._critical_done.set()
            self._critical_done = anyio.Event()

    async def _speculative_fork(self, fork: ForkEntry) -> Sandbox | None:
        """Fork the committed sandbox for ``fork`` (None when it is no longer at the fork's
        origin): one speculative fork at a time, after the verified path's fork or commit."""
        async with self._fork_gate:
            while self._critical:
                await self._critical_done.wait()
            if fork.state is ForkState.RELEASED or self._sandbox.version != fork.origin:
                return None
            return await self._sandbox.fork()

    async def _prioritize(self, sandbox: Sandbox, *, foreground: bool) -> None:
        """Run ``sandbox``'s commands at foreground or background priority, where the
        backend can (:class:`aospec.protocols.PrioritizedSandbox`); a failure only costs speed."""
        setter = getattr(sandbox, "set_priority", None)
        if setter is None:
            return
        try:
            await setter(foreground=foreground)
        except Exception as exc:
            self._speculation_failed("setting a fork's priority", exc)

    def _release(self, forks: Sequence[ForkEntry]) -> None:
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
            self._run.task_group.start_soon(self._discard_idle, idle)

    async def _discard_idle(self, forks: Sequence[ForkEntry]) -> None:
        # Why shielded: discarding must complete even if the run is being cancelled.
        with anyio.CancelScope(shield=True):
            for fork in forks:
                if fork in self._run.idle:
                    self._run.idle.discard(fork)
                    await self._discard(fork)

    async def _discard(self, fork: ForkEntry) -> None:
        assert fork.sandbox is not None
        await self._discard_sandbox(fork.sandbox, fork.action)
        fork.state = ForkState.DISCARDED
        now = self._clock.now_ns()
        self._run.ledger.fork_discarded(now, fork.action.key, fork.tool_ns(now), speculative=fork.speculative)

    async def _discard_sandbox(self, sandbox: Sandbox, action: Action, cause: BaseException | None = None) -> None:
        """Discard a fork; a discard that raises is counted, never raised: the fork's state
        is never committed, so it costs resources (the backend's session close releases
        them), not results. With ``cause`` (the error being raised), it is noted there."""
        try:
            await sandbox.discard()
        except Exception as exc:
            self._speculation_failed(f"discard of the fork of {_short(action.key)}", exc, warn=True)
            if cause is not None:
                note = f"aospec: discarding the fork of the failed step failed too: {type(exc).__name__}: {exc}"
                cause.add_note(note)

    def _speculation_failed(self, what: str, exc: BaseException, *, warn: bool = False) -> None:
        """A speculative operation failed: it only costs speed. Counted in the ledger
        (``speculative_failures``, a ``fail`` event); an error that is no AospecError (a bug
        in a drafter, an actor or a backend) is also logged, as is one with ``warn``."""
        self._run.ledger.failed(self._clock.now_ns(), f"{what}: {type(exc).__name__}: {exc}")
        if warn or not isinstance(exc, AospecError):
            # Once per kind of failure and run at WARNING (a drafter that is broken fails on
            # every call), the repeats at DEBUG.
            key = f"{what.split(' {')[0]}: {type(exc).__name__}"
            level = logging.DEBUG if key in self._warned else logging.WARNING
            self._warned.add(key)
            _log.log(level, "speculative %s failed (the run goes on without it): %s: %s", what, type(exc).__name__, exc)

    async def close(self) -> None:
        """Discard the idle forks the run still holds (called when the run ends, after its
        task group is done)."""
        run = self._run
        if run.idle:
            with anyio.CancelScope(shield=True):
                for fork in list(run.idle):
                    run.idle.discard(fork)
                    await self._discard(fork)


def _ignore_delta(delta: object) -> None:
    """The ``on_delta`` of a decode whose router could not open a session."""


def _cache_hit_ns(sandbox: Sandbox) -> int | None:
    """The tool time ``sandbox``'s result cache saved on its last ``execute``
    (:class:`aospec.protocols.CachingSandbox`), or None: no hit, no such capability, or a
    value that cannot be read (a cache hit only counts; it never decides anything)."""
    try:
        ns = getattr(sandbox, "last_cache_hit_ns", None)
        if ns is None or isinstance(ns, bool) or not isinstance(ns, numbers.Real) or not ns >= 0:
            return None
        return int(ns)
    except Exception:
        return None


def _takes_an_argument(method: Callable[..., Any]) -> bool:
    """Whether ``method`` can be called with one positional argument (a router's
    ``session(history)``, or an older ``session()`` that takes none)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _valid_probability(p: object) -> bool:
    # numbers.Real: numpy scalars too; NaN fails both comparisons
    return isinstance(p, numbers.Real) and not isinstance(p, bool) and 0.0 <= p <= 1.0


def _draft_problem(d: object, kind: type) -> str | None:
    """Why ``d`` is no well-formed draft of ``kind`` (None: it is one)."""
    if not isinstance(d, kind):
        return f"{type(d).__name__} is not {kind.__name__}"
    if kind is ObservationDraft:
        assert isinstance(d, ObservationDraft)
        if not isinstance(d.text, str):
            return f"text is {type(d.text).__name__}, not str"
        if d.template is not None and not isinstance(d.template, str):
            return f"template is {type(d.template).__name__}, not str"
    else:
        assert isinstance(d, ActionDraft)
        if not isinstance(d.action, Action):
            return f"action is {type(d.action).__name__}, not Action"
        if not isinstance(d.offset, numbers.Integral) or isinstance(d.offset, bool) or d.offset < 0:
            return f"offset {d.offset!r} is not an integer >= 0"
    if not _valid_probability(d.probability):
        return f"probability {d.probability!r} is not in [0, 1]"
    return None
