"""One trajectory's engine state, and Algorithm 1 step by step.

A :class:`Session` holds the state of one run (the verified history, the branch tree of
provisional continuations, the ledger) inside the task group that owns every speculative
task of the run. :meth:`aospec.engine.Engine.run` drives it; so can a harness that owns
its agent loop::

    async with engine.session(History(task)) as session:
        while not finished:
            action = await session.decode()          # the actor's next action
            observation = await session.execute(action)

Notation of the paper's Algorithm 1 (written in ASCII here: ``B'`` is B-prime, ``P`` the
script P of the paper; docs/engine.md has the table), and the names used here:

- ``H``: the verified history (:attr:`Session.history`); ``v``: the committed sandbox's
  version (``sandbox.version``).
- ``B``: the branch that decodes the next action of ``H`` (a :class:`aospec.branches.Branch`
  at level 0).
- ``P``: a branch's provisional continuations, one per drafted observation of its action
  (:attr:`Branch.continuations`); each is a :class:`Branch` one level deeper.
- ``B'``: the continuation whose draft matched the real observation: it is adopted and
  becomes the next step's ``B`` (``_Run.successor``).
- ``f``: one execution of an action in a copy-on-write fork of the committed sandbox
  (:class:`aospec.forks.ForkEntry`); ``F``: the registry of live ones, in
  :class:`aospec.forks.Forks`, which runs the fork lifecycle (launch, JASV, commit,
  release). :class:`aospec.drafting.Drafting` makes every drafter call (observations,
  targets, routing).

"Root" is not used: in runtime/ it names the committed sandbox, which is ``sandbox`` here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

from aospec.admission import PROVISIONAL, Admission, AdmissionModel, DraftRound
from aospec.branches import Branch, BranchState
from aospec.drafting import MAX_DRAFTS_PER_CALL, Drafting
from aospec.engine_config import EngineConfig
from aospec.errors import EngineError, FailedAfterCommitError, StateUnknownError
from aospec.evd import EVDSession
from aospec.forks import ForkEntry, Forks
from aospec.ledger import EngineStatistics, Ledger, StepTimes, label, short
from aospec.protocols import (
    ActionDrafter,
    Actor,
    Capabilities,
    Clock,
    HostMonitor,
    ObservationCanonicalizer,
    ObservationDraft,
    ObservationDrafter,
    Sandbox,
    StreamingActor,
    StreamRouter,
)
from aospec.readsets import ReadSet, WriteSet
from aospec.types import Action, History

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from aospec.host import SpeculationBudget

__all__ = ["MAX_DRAFTS_PER_CALL", "Branch", "BranchState", "Session"]


@dataclass(eq=False, slots=True)
class _Run:
    """Everything one run holds beside its forks and drafting; each field says the
    invariant the steps keep."""

    task_group: TaskGroup
    """Owns every speculative task of the run (decodes, drafting, target drafting, forks);
    cancelled when the run ends, so no task outlives it."""
    ledger: Ledger
    history: History
    """``H``: the verified history; it holds committed turns only."""
    boundary_ns: int
    """When ``H`` was verified (the last commit, or the start): a step's actor wait starts here."""
    successor: Branch | None = None
    """``B'``: the continuation adopted at the last commit; it decodes from exactly ``H``."""
    pending: Branch | None = None
    """``B`` from the moment :meth:`Session.decode` returned its action until
    :meth:`Session.execute` committed it; None between steps."""
    emitted_ns: int = 0
    """When ``pending``'s action was emitted."""


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
        capabilities: Capabilities,
        router: StreamRouter | None = None,
        route_listeners: Sequence[Callable[[Any], None]] = (),
        admission_model: AdmissionModel | None = None,
        host: HostMonitor | None = None,
        budget: SpeculationBudget | None = None,
    ) -> None:
        self._actor = actor
        self._sandbox = sandbox
        self._config = config
        self._clock = clock
        self._capabilities = capabilities
        self._obs_on = config.branch_budget > 0 and bool(observation_drafters)
        self._targets_on = config.fork_width > 0 and bool(action_drafters)
        self._provisional_targets_on = config.provisional_targets and self._obs_on
        self._use_forks = self._targets_on or self._provisional_targets_on
        self._run = _Run(task_group, ledger, history, clock.now_ns())

        def failed(what: str, exc: BaseException, *, warn: bool = False) -> None:
            ledger.speculation_failed(clock.now_ns(), what, exc, warn=warn)

        self._speculation_failed = failed
        self._admission = admission = Admission(
            admission_model if admission_model is not None else AdmissionModel(),
            config,
            clock=clock,
            ledger=ledger,
            failed=failed,
            host=host,
            budget=budget,
        )
        admission.boundary(self._run.boundary_ns)
        common = {"config": config, "clock": clock, "ledger": ledger, "task_group": task_group, "failed": failed}
        self._forks = Forks(sandbox, capabilities.sandbox, use_forks=self._use_forks, admission=admission, **common)
        self._drafting = Drafting(
            observation_drafters=observation_drafters,
            action_drafters=action_drafters,
            capabilities=capabilities,
            router=router,
            route_listeners=route_listeners,
            evd=evd,
            canonicalizer=canonicalizer,
            forks=self._forks,
            admission=admission,
            targets_on=self._targets_on,
            provisional_targets_on=self._provisional_targets_on,
            **common,
        )

    @property
    def history(self) -> History:
        """``H``: the verified history (committed steps only)."""
        return self._run.history

    @property
    def admission(self) -> Admission:
        """The run's speculation controller (a SpecBox pool prices its forks with
        :meth:`aospec.admission.Admission.pool`)."""
        return self._admission

    @property
    def capabilities(self) -> Capabilities:
        """The optional capabilities of this run's seams, found once when it started."""
        return self._capabilities

    def statistics(self) -> EngineStatistics:
        """Frozen totals of this run so far."""
        return self._run.ledger.statistics()

    @property
    def record_access(self) -> bool:
        """Whether each committed step's read and write sets are kept (:attr:`step_access`)."""
        return self._forks.record_access

    @record_access.setter
    def record_access(self, on: bool) -> None:
        self._forks.record_access = on

    @property
    def step_access(self) -> tuple[ReadSet | None, WriteSet | None] | None:
        """``(reads, writes)`` of the step committed last, with :attr:`record_access` (a read
        set only where the sandbox traced that step's own command, e.g. a runtime sandbox
        with ``read_sets="all"``; docs/engine.md, "Read sets")."""
        return self._forks.step_access

    def live_forks(self) -> int:
        """Speculative forks alive now (running, or executed and waiting for JASV)."""
        return len(self._forks.registry)

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
            self._drafting.speculate_actions(run.history)
        branch = await self._finish_actor()
        run.emitted_ns = self._clock.now_ns()
        run.pending = branch
        assert branch.action is not None
        self._admission.emitted(branch.action, run.emitted_ns)
        return branch.action

    async def execute(self, action: Action) -> str:
        """Verify, execute and commit the action :meth:`decode` returned; returns its
        observation. ``H`` then ends in this step.

        A failure on this path (reading the committed version, forking it for the step,
        the step's own execution, its commit) is raised as itself, with a note naming the
        step, when ``H`` and the committed sandbox still agree (docs/engine.md, Faults):
        calling ``execute(action)`` again retries the step. When they do not, it is raised
        as :class:`~aospec.errors.FailedAfterCommitError` (the step is committed: ``H``
        holds it) or :class:`~aospec.errors.StateUnknownError`, from the original error."""
        run = self._run
        branch = run.pending
        if branch is None or action != branch.action:
            raise EngineError("execute() runs the action decode() returned, once: call decode() first")
        try:
            return await self._execute_step(branch, action)
        except Exception as exc:
            if not isinstance(exc, (FailedAfterCommitError, StateUnknownError)):
                n = len(run.history)
                exc.add_note(
                    f"aospec: step {n} ({label(action)!r}) failed on the verified path; the verified history "
                    f"holds {n} committed step(s) and the committed sandbox is at their state"
                )
            raise
        finally:
            self._forks.inflight = None

    async def _execute_step(self, branch: Branch, action: Action) -> str:
        run, forks = self._run, self._forks
        emitted_ns = run.emitted_ns
        origin = self._sandbox.version
        forks.inflight = (origin, action.key)

        fork = await forks.verify(action, emitted_ns) if self._use_forks else None
        # (once per step: a branch whose round was skipped stays DECODED)
        predict = self._obs_on and branch.state is BranchState.DECODED
        if fork is not None:
            if predict and fork.running:
                self._predict_observations(branch)
                predict = False
            fork = await forks.wait(fork)
        if fork is None:
            if predict:
                self._predict_observations(branch)
            fork = await forks.execute(action, len(run.history))
        observation = fork.observation
        assert observation is not None
        # Read before the commit consumes the fork: did the executing sandbox's result cache
        # serve this action (counted once the step is committed)?
        cache_hit_ns = forks.cache_hit_ns(fork)

        if branch.seal():
            run.ledger.drafting_lost(self._clock.now_ns(), "drafting lost the race")
        before = run.history
        late_error = await forks.commit(fork, origin, len(before))
        try:
            try:
                changed = self._sandbox.version != origin
            except Exception:
                changed = True  # (the verified path reads it again below, and fails there)
            self._after_commit(branch, action, fork, observation, emitted_ns, cache_hit_ns, changed=changed)
        except BaseException as exc:
            if run.history is before:
                # Why: the step is committed; whatever failed after the commit (adopting a
                # continuation, the ledger), H must hold it, as the committed state does.
                run.successor = None
                run.history = before.extend(action, observation)
            if isinstance(exc, Exception):
                raise self._failed_after_commit(exc, action, "then this failed") from exc
            raise
        finally:
            run.pending = None
        if late_error is not None:
            # The backend raised (or the run was cancelled), but the commit took effect: the
            # step is in H as it is in the committed state; the error is raised all the same.
            if not isinstance(late_error, Exception):
                raise late_error
            raise self._failed_after_commit(late_error, action, "but the backend's commit raised") from late_error
        if self._use_forks:
            forks.prune()
        return observation

    def _failed_after_commit(self, exc: Exception, action: Action, how: str) -> FailedAfterCommitError:
        history = self._run.history
        n = len(history) - 1
        return FailedAfterCommitError(
            f"step {n} ({label(action)!r}) was committed, {how}: {type(exc).__name__}: {exc}; the verified "
            f"history holds the step ({len(history)} in all) and the committed sandbox is at their state",
            step=n,
        )

    def _after_commit(
        self,
        branch: Branch,
        action: Action,
        fork: ForkEntry,
        observation: str,
        emitted_ns: int,
        cache_hit_ns: int | None = None,
        *,
        changed: bool = True,
    ) -> None:
        """The step is committed: its cache hit and times into the ledger, its tool time
        into EVD, the matching continuation adopted, ``H`` extended (``changed``: the step
        changed the committed state, which the speculation controller learns)."""
        run, ledger = self._run, self._run.ledger
        now = self._clock.now_ns()
        if cache_hit_ns is not None:
            ledger.cache_hit(now, action.key, cache_hit_ns)
        times = StepTimes.measure(
            boundary_ns=run.boundary_ns,
            emitted_ns=emitted_ns,
            now_ns=now,
            decode=(branch.started_ns, branch.decoded_ns),
            tool_ns=fork.tool_ns(now),
            tool_start_ns=fork.exec_start_ns,
        )
        ledger.committed_step(now, action.key, **asdict(times), executed=not action.is_none)
        self._admission.committed(
            action, decode_ns=times.decode_ns, hidden_ns=times.hidden_ns, overhead_ns=times.overhead_ns, changed=changed
        )
        self._admission.boundary(now)
        self._drafting.learn_tool_time(action, observation, times.tool_ns)
        run.boundary_ns = now
        run.pending = None

        successor = run.successor = self._adopt(branch, observation, now)
        run.history = successor.history if successor is not None else run.history.extend(action, observation)

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

    def _predict_observations(self, branch: Branch) -> None:
        """*Predict observations* of ``branch``'s action while it runs: drafting starts the
        continuations ``P`` (see :meth:`_start_continuations`), unless the round is not
        worth its CPU now (then ``P`` stays empty)."""
        r = self._drafting.observations_round()
        if r is None:
            # not worth its CPU now: the branch stays DECODED, so that it is asked again
            # where a decoded branch is drafted for (promoted, or its step executes)
            return
        branch.state = BranchState.DRAFTING
        branch.draft_task = self._run.task_group.start_soon(self._draft, branch, r)

    def _adopt(self, branch: Branch, observation: str, now: int) -> Branch | None:
        """*Adopt the matching continuation* ``B'``: the one whose draft equals
        ``observation`` (byte for byte, else, under canonical acceptance, once
        canonicalised); cancel the rest of ``P``."""
        continuations = branch.continuations
        admission = self._admission
        for refused_text, decision in branch.refused.items():
            # what a refused branch would have done: learned all the same
            admission.outcome(decision, refused_text == observation)
        branch.refused = {}
        if not continuations:
            return None
        text = self._drafting.accepted(observation, continuations)
        keep = continuations.pop(text) if text is not None else None
        if keep is not None:
            admission.outcome(keep.decision, True)
        for other in continuations.values():
            admission.outcome(other.decision, False)
            # Why: a continuation on a draft that differs from the real observation
            # conditions on a history that never happened.
            self._cancel(other, now)
        branch.continuations = {}
        if keep is None:
            return None
        if text != observation:
            self._run.ledger.draft_canonical_hit(now, short(observation))
            # Why: the actor must finally see the real observation. The continuation keeps
            # decoding on the draft's bytes (the opt-in approximation), but the committed
            # history, and every history drafted or decoded from here on, holds the real one.
            assert branch.action is not None
            keep.rebase(branch.history.extend(branch.action, observation))
        else:
            self._run.ledger.draft_hit(now, short(observation))
        keep.promote(self._config.obs_depth, self._predict_observations)
        return keep

    # ------------------------------------------------------------------ the branch tree

    async def _decode(self, branch: Branch) -> Action | None:
        """Decode ``branch``'s action: the one timed path of both decodes (the verified
        one awaited here, provisional ones in their own task)."""
        try:
            # counted among this process's open streams where the host monitor meters them
            # (live): the controller prices a branch's local CPU from them
            meter = self._admission.decodes
            with meter.streaming() if meter is not None else contextlib.nullcontext():
                if self._drafting.router is None:
                    branch.action = await self._actor.decode(branch.history)
                else:
                    on_delta = self._drafting.route_feed(branch)
                    branch.action = await cast(StreamingActor, self._actor).decode_streaming(branch.history, on_delta)
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
            self._forks.launch(action, branch.level, branch.probability, kind=PROVISIONAL, source="continuation")
        if branch.level < self._config.obs_depth:
            self._predict_observations(branch)

    async def _draft(self, branch: Branch, r: DraftRound) -> None:
        await self._drafting.observations(
            branch, lambda who, drafts: self._start_continuations(branch, drafts, who, r), r
        )
        if branch.state is BranchState.DRAFTING:
            branch.state = BranchState.DRAFTED

    def _start_continuations(
        self, branch: Branch, drafts: Sequence[ObservationDraft], source: str = "", r: DraftRound | None = None
    ) -> None:
        """Start a continuation on each of the best ``drafts`` (:meth:`Drafting.pick`) that
        the speculation controller admits (the branch start point: each is priced first, in
        drafting round ``r``)."""
        if branch.state is not BranchState.DRAFTING:
            return  # sealed or cancelled while these drafts were made
        run, action = self._run, branch.action
        assert action is not None
        now = self._clock.now_ns()
        admission = self._admission
        for d, form in self._drafting.pick(drafts, branch.continuations):
            t_hit = self._drafting.tool_if_hit(d)
            decision = admission.branch(
                action, source=source, level=branch.level + 1, score=d.probability, tool_if_hit_s=t_hit, drafted_in=r
            )
            if not decision.launch:
                branch.refused[d.text] = decision
                continue
            child = Branch(
                branch.history.extend(action, d.text), branch.level + 1, d, branch.probability * d.probability, now
            )
            child.canonical_form = form
            child.decision = decision
            child.decode_task = run.task_group.start_soon(self._decode_continuation, child)
            branch.continuations[d.text] = child
            run.ledger.draft_started(now, short(d.text))

    def _restart(self, history: History) -> None:
        """A harness gave another verified history: the continuation adopted for the old
        one conditions on a history that is not the verified one any more."""
        run = self._run
        if run.successor is not None:
            self._cancel(run.successor, self._clock.now_ns())
            run.successor = None
        run.history = history

    def _cancel(self, branch: Branch, now: int) -> None:
        """Stop ``branch`` and its subtree: their histories never happened."""

        def cancelled(b: Branch, decoded_ns: int) -> None:
            self._run.ledger.draft_cancelled(now, short(b.draft.text) if b.draft else "", decoded_ns)
            self._admission.wasted_decode(decoded_ns)

        branch.cancel(now, cancelled)

    # ------------------------------------------------------------------ the end

    async def close(self) -> None:
        """Discard the idle forks the run still holds (called when the run ends, after its
        task group is done)."""
        await self._forks.close()
