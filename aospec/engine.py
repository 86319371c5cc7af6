"""Algorithm 1: lossless co-speculation of tool actions and observations.

One engine, two clocks: live runs drive :class:`Engine` with a real actor and real
sandboxes in real time; trace replay drives the same code in virtual time (replay/).

At every verified boundary (history ``H``, committed sandbox at version ``v``):

1. The actor decodes the next action from ``H`` -- unless a provisional continuation
   started earlier on a drafted observation that turned out byte-identical; that
   continuation *is* the decode of this step and keeps running.
2. Action drafters propose target actions (step offsets ``< depth``); each is launched
   into a fork of the committed sandbox (at most ``fork_width``).
3. When the actor emits ``a``: Joint Action-State Verification reuses a fork iff its
   action key equals ``a.key`` and its origin version equals ``v``; otherwise ``a`` runs
   now (in a fresh fork when speculation is on, so forks can still be taken from the idle
   committed sandbox).
4. While ``a`` runs: observation drafters propose candidates, ranked by EVD
   ``p(c) * T(c)``; the best ``branch_budget`` each start a provisional continuation
   ``decode(H + (a, c))``. Drafting that finishes after the observation lost the race and is
   cancelled. A continuation that finishes decoding may launch its action into a fork
   (``provisional_targets``) and, within ``obs_depth``, draft further observations.
5. On the real observation: keep only the continuation whose draft is byte-identical
   (or, with ``accept="canonical"``, equal once canonicalised), cancel the others, commit
   the fork, prune forks whose origin is no longer the committed version.

Losslessness rests on two conditions, which the caller must meet: the actor is a function
of its history (greedy or seeded decoding), so a continuation on a byte-identical history
decodes what a fresh decode would; and an action's result is a function of the state it
starts from, so a fork from the committed version yields what serial execution would. The
committed trajectory and final state then equal serial execution's. Canonical acceptance
(opt-in) adds a third: the actor's next action must not depend on the canonicalised fields;
the committed history holds the real observation either way.

Every speculative task lives in the engine's task group for the run, each in its own
cancel scope. Forks are owned by exactly one task, which discards them on cancellation
unless JASV consumed them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from aospec.engine_config import EngineConfig, load_canonicalizer
from aospec.errors import AospecError, ConfigError, EngineError
from aospec.evd import EVDEstimator, EVDSession, rank_drafts
from aospec.forks import ForkEntry, ForkRegistry
from aospec.ledger import EngineStatistics, Ledger
from aospec.protocols import (
    ActionDraft,
    ActionDrafter,
    Actor,
    ObservationCanonicalizer,
    ObservationDraft,
    ObservationDrafter,
    Sandbox,
)
from aospec.types import Action, History, Turn

if TYPE_CHECKING:
    from anyio import TaskHandle

__all__ = ["Clock", "Engine", "LoopClock"]


class Clock(Protocol):
    """The engine's notion of time, in integer nanoseconds."""

    def now_ns(self) -> int: ...


class LoopClock:
    """The running event loop's clock (monotonic in live runs)."""

    def now_ns(self) -> int:
        return round(anyio.current_time() * 1e9)


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception a task group failed with (None when there were several)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


class _Branch:
    """A decode of the next action from ``history``; ``level`` 0 is the verified history,
    level k > 0 ends in k drafted observations. ``children`` maps drafted observation text
    of this branch's action to the continuation started on it."""

    __slots__ = (
        "action",
        "cancelled",
        "canon",
        "children",
        "decode_end_ns",
        "decode_start_ns",
        "decode_task",
        "done",
        "draft",
        "draft_done",
        "draft_task",
        "error",
        "history",
        "level",
        "probability",
        "sealed",
        "waiter",
    )

    async def wait_decoded(self) -> None:
        if not self.done:
            if self.waiter is None:
                self.waiter = anyio.Event()
            await self.waiter.wait()

    def __init__(self, history: History, level: int, draft: ObservationDraft | None, probability: float) -> None:
        self.history = history
        self.level = level
        self.draft = draft
        self.probability = probability
        self.action: Action | None = None
        self.error: AospecError | None = None
        self.done = False
        self.waiter: anyio.Event | None = None
        self.decode_task: TaskHandle[None] | None = None
        self.decode_start_ns = 0
        self.decode_end_ns = 0
        self.draft_task: TaskHandle[None] | None = None
        self.draft_done = False
        self.children: dict[str, _Branch] | None = None
        self.cancelled = False
        self.sealed = False
        self.canon: str | None = None


class Engine:
    """Runs an agent loop with co-speculation (Algorithm 1); see the module docstring.

    ``observation_drafters`` and ``action_drafters`` are consulted together (their
    candidates merged). ``evd`` supplies historical tool times for ranking (an empty
    estimator with the pattern kernel when omitted). ``canonicalizer`` overrides the one
    ``config.canonicalizer`` names (only with ``config.accept == "canonical"``). One Engine
    runs one trajectory at a time; :meth:`statistics` describes the last (or current) run.
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
    ) -> None:
        self.actor = actor
        self.sandbox = sandbox
        self.observation_drafters = tuple(observation_drafters)
        self.action_drafters = tuple(action_drafters)
        self.config = config or EngineConfig()
        self.evd = evd if evd is not None else EVDEstimator()
        self.clock: Clock = clock or LoopClock()
        self._keep_events = keep_events
        self.ledger = Ledger(keep_events=keep_events)
        cfg = self.config
        self._obs_on = cfg.branch_budget > 0 and bool(self.observation_drafters)
        self._targets_on = cfg.fork_width > 0 and bool(self.action_drafters)
        if cfg.accept == "canonical":
            self._canon = canonicalizer if canonicalizer is not None else load_canonicalizer(cfg.canonicalizer)
        elif canonicalizer is not None:
            raise ConfigError('engine: a canonicalizer was given but config.accept is "exact"')
        else:
            self._canon = None
        self._prov_targets_on = cfg.provisional_targets and self._obs_on
        self._use_forks = self._targets_on or self._prov_targets_on
        self._registry = ForkRegistry()
        self._tg: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock(fast_acquire=True)
        self._evd_session: EVDSession | None = None
        self._target_task_handle: TaskHandle[None] | None = None
        self._inflight: tuple[str, str] | None = None
        self._idle: set[ForkEntry] = set()
        self._first_len = 0
        self._running = False

    def statistics(self) -> EngineStatistics:
        """Frozen totals of the last (or current) run."""
        return self.ledger.statistics()

    # ------------------------------------------------------------------ run loop

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
        self._running = True
        self.ledger = Ledger(keep_events=self._keep_events)
        self._registry = ForkRegistry()
        self._idle = set()
        self._target_task_handle = None
        self._inflight = None
        self._first_len = len(history)
        self._evd_session = self.evd.session()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                try:
                    history = await self._loop(history, steps, stop)
                finally:
                    # Why: whatever is still in flight (forks, continuations, drafting) belongs to
                    # no committed step. Cancelling the run's scope ends it; fork tasks discard
                    # their sandboxes in shielded cleanup, so nothing leaks on success or error.
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            leaf = _single_leaf(group)
            if leaf is None:
                raise
            raise leaf from None
        finally:
            self._tg = None
            self._running = False
            if self._idle:
                # Idle forks left when the run ended (or failed) are released here.
                with anyio.CancelScope(shield=True):
                    for entry in list(self._idle):
                        self._idle.discard(entry)
                        await self._discard(entry)
        return history

    async def _loop(self, history: History, steps: int | None, stop: Callable[[Turn], bool] | None) -> History:
        clock, ledger, registry = self.clock, self.ledger, self._registry
        adopted: _Branch | None = None
        boundary_ns = clock.now_ns()
        done = 0
        while steps is None or done < steps:
            if self._targets_on:
                self._launch_targets(history)
            root = adopted
            if root is not None:
                await root.wait_decoded()
                if root.action is None:
                    root = None  # the adopted continuation failed: decode the verified history afresh
            if root is None:
                # The verified history's own decode runs right here: nothing else waits for it.
                root = _Branch(history, 0, None, 1.0)
                root.decode_start_ns = clock.now_ns()
                root.action = await self.actor.decode(history)
                root.decode_end_ns = clock.now_ns()
                root.done = True
            action = root.action
            assert action is not None
            emitted_ns = clock.now_ns()
            version = self.sandbox.version
            self._inflight = (version, action.key)

            # JASV: a fork is reused only for the same action AND the same origin version.
            entry = registry.take(action, version) if self._use_forks else None
            if entry is not None:
                ledger.fork_reused(emitted_ns, action.key)
                if self._obs_on and not entry.finished and root.draft_task is None:
                    self._start_drafting(root)
                await entry.wait_finished()
                if entry.failed:
                    entry = None
            if entry is None:
                if self._obs_on and root.draft_task is None:
                    self._start_drafting(root)
                entry = await self._execute(action)
            observation = entry.observation
            assert observation is not None

            root.sealed = True  # drafting that has not started its continuations never will
            if root.draft_task is not None and not root.draft_done:
                # Why: drafting that finishes after the real observation lost the race; its
                # continuations could only ever be discarded.
                root.draft_task.cancel()
                ledger.drafting_lost(clock.now_ns(), "drafting lost the race")

            if entry.sandbox is not None:
                # Why: the fork ran `action` from exactly the committed version (JASV above, or
                # a fresh fork just taken), so its state is what serial execution would give.
                entry.consumed = True
                self._idle.discard(entry)
                async with self._lock:
                    await self.sandbox.commit(entry.sandbox)
                ledger.fork_committed(clock.now_ns(), action.key)
            self._inflight = None

            now = clock.now_ns()
            tool_ns = entry.tool_ns(now)
            ledger.committed_step(
                now,
                action.key,
                wait_actor_ns=emitted_ns - boundary_ns,
                wait_tool_ns=now - emitted_ns,
                decode_ns=root.decode_end_ns - root.decode_start_ns,
                tool_ns=tool_ns,
                executed=not action.is_none,
            )
            if self._evd_session is not None and not action.is_none:
                self._evd_session.observe(action, observation, tool_ns * 1e-9)
            boundary_ns = now
            done += 1

            adopted = self._adopt(root, observation, now)
            history = adopted.history if adopted is not None else history.extend(action, observation)
            turn = history.turns[-1]

            if self._use_forks:
                # Why: versions never return to an earlier value, so a fork from another
                # origin can never pass JASV again.
                self._release(registry.stale(self.sandbox.version))

            if stop is not None and stop(turn):
                break
        return history

    async def _execute(self, action: Action) -> ForkEntry:
        """Run the emitted action now: in a fresh fork when speculation needs the committed
        sandbox kept idle (the caller commits it), else on the committed sandbox."""
        entry = ForkEntry(action, offset=0, probability=1.0, launched_ns=self.clock.now_ns(), speculative=False)
        if not self._use_forks:
            async with self._lock:
                entry.exec_start_ns = self.clock.now_ns()
                entry.observation = await self.sandbox.execute(action)
                entry.exec_end_ns = self.clock.now_ns()
            entry.finish()
            return entry
        async with self._lock:
            fork = await self.sandbox.fork()
        try:
            entry.exec_start_ns = self.clock.now_ns()
            entry.observation = await fork.execute(action)
            entry.exec_end_ns = self.clock.now_ns()
        except BaseException:
            # Why shielded: a failed or cancelled step must still release its fork.
            with anyio.CancelScope(shield=True):
                await fork.discard()
            raise
        entry.sandbox = fork
        entry.finish()
        return entry

    def _adopt(self, root: _Branch, observation: str, now: int) -> _Branch | None:
        """Keep the continuation whose draft equals ``observation`` (byte for byte, else,
        under canonical acceptance, once canonicalised); cancel the rest."""
        children = root.children
        if not children:
            return None
        keep = children.pop(observation, None)
        canonical_hit = False
        if keep is None and self._canon is not None:
            canon = self._canon.canonical(observation)
            text = next((t for t, c in children.items() if c.canon == canon), None)
            if text is not None:
                keep = children.pop(text)
                canonical_hit = True
        for other in children.values():
            # Why: a continuation on a draft that differs from the real observation
            # conditions on a history that never happened.
            self._cancel_branch(other, now)
        root.children = None
        if keep is None:
            return None
        if canonical_hit:
            self.ledger.draft_canonical_hit(now, _short(observation))
            # Why: the actor must finally see the real observation. The continuation keeps
            # decoding on the draft's bytes (the opt-in approximation), but the committed
            # history, and every history drafted or decoded from here on, holds the real one.
            assert root.action is not None
            self._rebase(keep, root.history.extend(root.action, observation))
        else:
            self.ledger.draft_hit(now, _short(observation))
        self._promote(keep)
        return keep

    def _rebase(self, branch: _Branch, history: History) -> None:
        """Give ``branch`` (and its subtree) ``history`` in place of the one it started on."""
        branch.history = history
        if branch.children and branch.action is not None:
            for text, child in branch.children.items():
                self._rebase(child, history.extend(branch.action, text))

    def _promote(self, branch: _Branch) -> None:
        """Shift a subtree one level towards the verified history; branches that now fall
        within ``obs_depth`` and have decoded start drafting."""
        branch.level -= 1
        if branch.children:
            for child in branch.children.values():
                self._promote(child)
        elif (
            branch.level > 0
            and branch.action is not None
            and branch.draft_task is None
            and branch.level < self.config.obs_depth
        ):
            self._start_drafting(branch)

    def _cancel_branch(self, branch: _Branch, now: int) -> None:
        if branch.cancelled:
            return
        branch.cancelled = True
        if branch.decode_task is not None:
            branch.decode_task.cancel()
        if branch.draft_task is not None:
            branch.draft_task.cancel()
        decoded = (branch.decode_end_ns if branch.action is not None else now) - branch.decode_start_ns
        self.ledger.draft_cancelled(now, _short(branch.draft.text) if branch.draft else "", decoded)
        if branch.children:
            for child in branch.children.values():
                self._cancel_branch(child, now)
            branch.children = None

    # ------------------------------------------------------------------ decoding

    def _start_branch(self, history: History, level: int, draft: ObservationDraft | None, p: float) -> _Branch:
        branch = _Branch(history, level, draft, p)
        branch.decode_start_ns = self.clock.now_ns()
        assert self._tg is not None
        branch.decode_task = self._tg.start_soon(self._decode_task, branch)
        return branch

    async def _decode_task(self, branch: _Branch) -> None:
        try:
            branch.action = await self.actor.decode(branch.history)
            branch.decode_end_ns = self.clock.now_ns()
        except AospecError as exc:
            branch.error = exc
            self.ledger.failed(self.clock.now_ns(), f"decode: {exc}")
        finally:
            branch.done = True
            if branch.waiter is not None:
                branch.waiter.set()
        if branch.action is None or branch.cancelled or branch.level == 0:
            return
        if self._prov_targets_on and not branch.action.is_none:
            self._launch_fork(branch.action, branch.level, branch.probability)
        if branch.level < self.config.obs_depth:
            self._start_drafting(branch)

    # ------------------------------------------------------------------ observation drafting

    def _start_drafting(self, branch: _Branch) -> None:
        assert self._tg is not None
        branch.draft_task = self._tg.start_soon(self._draft_task, branch)

    async def _draft_task(self, branch: _Branch) -> None:
        cfg = self.config
        action = branch.action
        assert action is not None
        n = max(cfg.draft_candidates, cfg.branch_budget)
        drafts: list[ObservationDraft] = []
        drafters = self.observation_drafters
        if len(drafters) == 1:
            await self._call_drafter(drafters[0].draft(branch.history, action, n), drafts, "observation drafter")
        else:
            # Independent drafters run side by side; drafting costs the slowest of them.
            async with anyio.create_task_group() as tg:
                for drafter in drafters:
                    tg.start_soon(
                        self._call_drafter, drafter.draft(branch.history, action, n), drafts, "observation drafter"
                    )
        if branch.sealed or branch.cancelled:
            return
        canon = self._canon
        budget = cfg.branch_budget if canon is None else len(drafts)
        ranked = rank_drafts(drafts, cfg.rank, budget, self._evd_session, min_probability=cfg.min_draft_probability)
        forms: list[str | None] = [None] * len(ranked)
        if canon is not None:
            # Drafts that are equal once canonicalised would be accepted for the same real
            # observations: one continuation (the best ranked) stands for them all.
            seen: set[str] = set()
            kept = []
            for d in ranked:
                form = canon.canonical(d.text)
                if form not in seen:
                    seen.add(form)
                    kept.append((d, form))
                    if len(kept) == cfg.branch_budget:
                        break
            ranked = [d for d, _ in kept]
            forms = [f for _, f in kept]
        children: dict[str, _Branch] = {}
        now = self.clock.now_ns()
        for d, form in zip(ranked, forms, strict=True):
            child = self._start_branch(
                branch.history.extend(action, d.text), branch.level + 1, d, branch.probability * d.probability
            )
            child.canon = form
            children[d.text] = child
            self.ledger.draft_started(now, _short(d.text))
        branch.children = children
        branch.draft_done = True

    async def _call_drafter(self, call: Awaitable[Sequence[Any]], out: list[Any], what: str) -> None:
        """Await one drafter call into ``out``; a drafter failure only loses its candidates."""
        try:
            out.extend(await call)
        except AospecError as exc:
            self.ledger.failed(self.clock.now_ns(), f"{what}: {exc}")

    # ------------------------------------------------------------------ action targets and forks

    def _launch_targets(self, history: History) -> None:
        if self._target_task_handle is not None:
            # Why: targets drafted for the previous boundary are offsets from a history that
            # is no longer the verified one.
            self._target_task_handle.cancel()
        assert self._tg is not None
        self._target_task_handle = self._tg.start_soon(self._target_task, history)

    async def _target_task(self, history: History) -> None:
        cfg = self.config
        proposals: list[ActionDraft] = []
        drafters = self.action_drafters
        if len(drafters) == 1:
            await self._call_drafter(
                drafters[0].propose(history, cfg.fork_width, cfg.depth), proposals, "action drafter"
            )
        else:
            async with anyio.create_task_group() as tg:
                for drafter in drafters:
                    tg.start_soon(
                        self._call_drafter,
                        drafter.propose(history, cfg.fork_width, cfg.depth),
                        proposals,
                        "action drafter",
                    )
        if self.ledger.step != len(history) - self._first_len:
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

    def _launch_fork(self, action: Action, offset: int, probability: float) -> bool:
        version = self.sandbox.version
        key = action.key
        if self._registry.has(version, key) or self._inflight == (version, key):
            # An equal fork is live, or the committed step is executing this very action
            # from this very state already.
            return False
        excess = len(self._registry) + 1 - self.config.max_live_forks
        if excess > 0:
            # Why: live forks hold sandboxes; past the cap the oldest (drafted for the
            # earliest boundary, so the least likely still to be emitted) make room.
            self._release(self._registry.oldest(excess))
        now = self.clock.now_ns()
        entry = ForkEntry(action, offset=offset, probability=probability, launched_ns=now, speculative=True)
        # Registered at once under the version it will fork from, so JASV finds it (and waits
        # for it) even if the actor emits this action before the fork task has run.
        entry.origin = version
        self._registry.add(entry)
        self.ledger.fork_launched(now, key)
        assert self._tg is not None
        entry.task = self._tg.start_soon(self._fork_task, entry)
        return True

    async def _fork_task(self, entry: ForkEntry) -> None:
        """Fork the committed sandbox and run a speculative target in it."""
        sandbox: Sandbox | None = None
        try:
            async with self._lock:
                sandbox = await self.sandbox.fork()
            entry.sandbox = sandbox
            if entry.released or sandbox.version != entry.origin:
                # Pruned before it started, or the committed state moved on between launch and
                # fork: this fork could never pass JASV under the version it is registered for.
                return
            entry.exec_start_ns = self.clock.now_ns()
            try:
                entry.observation = await sandbox.execute(entry.action)
            except AospecError as exc:
                # A failed speculation only loses its result: JASV falls back to running the action.
                self.ledger.failed(self.clock.now_ns(), f"fork {entry.action.key}: {exc}")
                return
            entry.exec_end_ns = self.clock.now_ns()
            if entry.released:
                return  # pruned while finishing: discarded below
            # From here the idle fork belongs to the engine: JASV commits it, or pruning
            # (or the end of the run) discards it.
            entry.idle = True
            self._idle.add(entry)
        finally:
            entry.finish()
            if not entry.idle and not entry.consumed:
                self._registry.remove(entry)
                if sandbox is not None:
                    # Why shielded: the fork must be released even when this task is being
                    # cancelled, or its layers/processes would leak.
                    with anyio.CancelScope(shield=True):
                        await sandbox.discard()
                    now = self.clock.now_ns()
                    self.ledger.fork_discarded(now, entry.action.key, entry.tool_ns(now), speculative=entry.speculative)

    def _release(self, entries: Sequence[ForkEntry]) -> None:
        """Stop and discard forks that can no longer be reused."""
        idle = []
        for entry in entries:
            entry.released = True
            if entry.idle:
                idle.append(entry)
            elif entry.task is not None:
                entry.task.cancel()  # the executing task discards its fork
        if idle:
            assert self._tg is not None
            self._tg.start_soon(self._discard_idle, idle)

    async def _discard_idle(self, entries: Sequence[ForkEntry]) -> None:
        # Why shielded: discarding must complete even if the run is being cancelled.
        with anyio.CancelScope(shield=True):
            for entry in entries:
                if entry in self._idle:
                    self._idle.discard(entry)
                    await self._discard(entry)

    async def _discard(self, entry: ForkEntry) -> None:
        assert entry.sandbox is not None
        await entry.sandbox.discard()
        now = self.clock.now_ns()
        self.ledger.fork_discarded(now, entry.action.key, entry.tool_ns(now), speculative=entry.speculative)
