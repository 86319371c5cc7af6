"""Drafting in one run: observation drafts, action targets and routing, behind one fan-out.

Every drafter call of the engine goes through :meth:`Drafting._fan_out`: the drafters of a
kind are called side by side (each one's drafts used as soon as it has them, so cheap ones
never wait for slow ones; a streaming drafter's batch by batch), each result is checked
(malformed drafts are dropped, a result that is no sequence of drafts is lost), and a
drafter that fails only loses its (remaining) drafts. Every such loss is counted
(``speculative_failures``): drafting is speculation, it never decides what is committed.
Its three uses:

- *predict observations* (:meth:`Drafting.observations`): candidates for a branch's action
  while it runs, which :meth:`Drafting.pick` ranks (EVD by default) for the session to
  start continuations on;
- target actions at each boundary (:meth:`Drafting.speculate_actions`): the action
  drafters' best go into forks (:meth:`aospec.forks.Forks.launch`);
- routing (:meth:`Drafting.route_feed`): a decode's stream goes into the router; each event
  into the ledger, the route listeners and, once per tool and decode, the routed action
  drafters, whose targets go into forks like the boundary's.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import numbers
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio

from aospec.admission import BRANCH, ROUTED, TARGET, Admission, DraftRound
from aospec.branches import Branch, BranchState
from aospec.engine_config import EngineConfig
from aospec.errors import DrafterError
from aospec.evd import EVDSession, rank_drafts
from aospec.forks import Failed, Forks
from aospec.ledger import Ledger, short
from aospec.protocols import (
    ActionDraft,
    ActionDrafter,
    Capabilities,
    Clock,
    ObservationCanonicalizer,
    ObservationDraft,
    ObservationDrafter,
    RouteEvent,
    StreamingObservationDrafter,
    StreamRouter,
)
from aospec.types import Action, History

if TYPE_CHECKING:
    from anyio import TaskHandle
    from anyio.abc import TaskGroup

__all__ = ["MAX_DRAFTS_PER_CALL", "Drafting", "charge_offloaded_cpu"]

#: Drafts the engine reads from one drafter call (or one streamed batch); the rest are
#: dropped and the call counted as a speculative failure. Far above what any sane drafter
#: returns (a few per source drafter): it only stops a runaway drafter from stalling the loop.
MAX_DRAFTS_PER_CALL = 4096

#: The drafting round of the drafter call running in this task, where the controller
#: measures drafting (:func:`charge_offloaded_cpu`).
_ROUND: contextvars.ContextVar[DraftRound | None] = contextvars.ContextVar("aospec_drafting_round", default=None)


def charge_offloaded_cpu(cpu_ns: int) -> None:
    """Charge ``cpu_ns`` of CPU that the drafter call in progress spent on another thread
    (an LM drafter's decode: :func:`aospec.drafters.backends.run_blocking` reports its worker
    thread's) to that call's drafting round, where the speculation controller measures
    drafting; nothing anywhere else. Call it from the event loop's thread, in the task of
    the drafter call."""
    r = _ROUND.get()
    if r is not None and r.open and cpu_ns > 0:
        r.cpu_ns = (r.cpu_ns or 0) + int(cpu_ns)


D = TypeVar("D", ObservationDraft, ActionDraft)
#: One drafter call of a fan-out: its name in failures, and a function that starts the call
#: and returns its batches (one for a drafter that does not stream).
Source = tuple[str, Callable[[], AsyncIterator[object]]]


class Drafting:
    """The drafter calls of one run (see the module docstring), and EVD's tool times.
    ``targets_on``: action drafting is on (then, with a router, router events may launch
    routed targets); ``provisional_targets_on``: provisional branches launch theirs."""

    def __init__(
        self,
        *,
        observation_drafters: Sequence[ObservationDrafter],
        action_drafters: Sequence[ActionDrafter],
        capabilities: Capabilities,
        router: StreamRouter | None,
        route_listeners: Sequence[Callable[[Any], None]],
        config: EngineConfig,
        clock: Clock,
        ledger: Ledger,
        task_group: TaskGroup,
        evd: EVDSession | None,
        canonicalizer: ObservationCanonicalizer | None,
        forks: Forks,
        admission: Admission,
        failed: Failed,
        targets_on: bool,
        provisional_targets_on: bool,
    ) -> None:
        self._observation_drafters = tuple(zip(observation_drafters, capabilities.streaming_drafters, strict=True))
        self._action_drafters = tuple(action_drafters)
        self._routed_drafters = capabilities.routed_drafters
        # Routing needs a streaming actor: decodes then report their stream to a fresh router
        # session each. Without a router the actor is called exactly as before.
        self.router = router if capabilities.streaming_actor else None
        self._router_takes_history = capabilities.router_takes_history
        self._route_listeners = tuple(route_listeners)
        self._config = config
        self._clock = clock
        self._ledger = ledger
        self._task_group = task_group
        self._evd = evd
        self._canon = canonicalizer
        self._forks = forks
        self._admission = admission
        self._failed = failed
        # Routed targets are action drafting: off with fork_width 0 (then forks may be off
        # too, and nothing may fork the committed sandbox while the step runs on it).
        self._routed_on = (
            self.router is not None and targets_on and config.routed_width > 0 and bool(self._routed_drafters)
        )
        self._provisional_targets_on = provisional_targets_on
        self._targets: TaskHandle[None] | None = None
        """The target-drafting task of the current boundary (cancelled at the next one)."""

    # ------------------------------------------------------------------ the fan-out

    async def _fan_out(
        self, sources: Sequence[Source], kind: type[D], take: Callable[[str, list[D]], None], r: DraftRound
    ) -> None:
        """Call every source, side by side when there are several, and pass each batch of
        well-formed drafts to ``take(source, drafts)`` as it arrives (``source``: the
        drafter's name, what the speculation controller learns p(hit) by); the CPU this
        takes is round ``r``'s."""
        if len(sources) == 1:
            await self._drain(*sources[0], kind, take, r)
        else:
            async with anyio.create_task_group() as tg:
                for who, batches in sources:
                    tg.start_soon(self._drain, who, batches, kind, take, r)

    async def _drain(
        self,
        who: str,
        batches: Callable[[], AsyncIterator[object]],
        kind: type[D],
        take: Callable[[str, list[D]], None],
        r: DraftRound,
    ) -> None:
        """One drafter call: its batches, checked, into ``take``; a failure (of the drafter,
        or of ``take`` ranking or canonicalising them) only loses the rest of the call.
        Where the controller measures drafting, round ``r`` is charged the CPU of the call's
        own steps (each resumption of it until it suspends or yields a batch: not what other
        tasks run while it waits), of the work it hands to another thread where that reports
        its CPU (:func:`charge_offloaded_cpu`), and of ``take``."""
        timed = self._admission.measures_drafting
        try:
            with self._measured(r):
                stream = aiter(batches())
        except Exception as exc:
            self._failed(who, exc)
            return
        async with aclosing(stream):  # type: ignore[type-var]
            while True:
                try:
                    step = anext(stream)
                    if timed:
                        # the drafter's own call only (not ``take``, whose continuations'
                        # decodes are priced as branches): what it hands to a worker thread
                        # is charged to ``r`` (charge_offloaded_cpu)
                        token = _ROUND.set(r)
                        try:
                            batch = await _Timed(step, self._admission, r)
                        finally:
                            _ROUND.reset(token)
                    else:
                        batch = await step
                    with self._measured(r):
                        take(_source_name(who), self._valid(batch, kind, who))
                except StopAsyncIteration:
                    return
                except Exception as exc:
                    self._failed(who, exc)
                    return

    def _valid(self, drafts: object, kind: type[D], who: str) -> list[D]:
        """The well-formed drafts of one drafter call (or batch); the malformed ones are
        dropped and the call counted as a failure. A result that is no sequence of drafts
        raises DrafterError (the call is lost)."""
        if isinstance(drafts, (str, bytes)) or not isinstance(drafts, Iterable):
            raise DrafterError(f"returned {type(drafts).__name__}, not a sequence of {kind.__name__}")
        items = list(itertools.islice(drafts, MAX_DRAFTS_PER_CALL + 1))
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
            self._failed(
                who, DrafterError(f"{dropped} malformed draft(s) dropped; first problem: {problems[0]}"), warn=True
            )
        return good

    # ------------------------------------------------------------------ observations

    def observations_round(self) -> DraftRound | None:
        """The drafting round of a branch's observations, or None when it is not worth its
        CPU now (:meth:`aospec.admission.Admission.begin_round`)."""
        return self._admission.begin_round(BRANCH)

    async def observations(
        self, branch: Branch, take: Callable[[str, list[ObservationDraft]], None], r: DraftRound
    ) -> None:
        """*Predict observations*: every observation drafter's candidates for ``branch``'s
        action, each batch into ``take(source, drafts)`` as it is ready, in round ``r``
        (:meth:`observations_round`; over when drafting is, cut short when cancelled)."""
        n = max(self._config.draft_candidates, self._config.branch_budget)
        sources = [_observation_source(d, streams, branch, n) for d, streams in self._observation_drafters]
        try:
            await self._fan_out(sources, ObservationDraft, take, r)
        finally:
            # (sealed or cancelled meanwhile, the round is over all the same)
            self._admission.end_round(r)

    def pick(
        self, drafts: Sequence[ObservationDraft], started: Mapping[str, Branch]
    ) -> list[tuple[ObservationDraft, str | None]]:
        """The drafts to continue, best first, with their canonical forms (None under exact
        acceptance): ranked (EVD by default) within what is left of the branch budget; texts
        (or, under canonical acceptance, canonical forms) already ``started`` are skipped."""
        cfg, canon = self._config, self._canon
        room = cfg.branch_budget - len(started)
        if room <= 0:
            return []
        if started:
            drafts = [d for d in drafts if d.text not in started]
        budget = room if canon is None else len(drafts)
        ranked = rank_drafts(drafts, cfg.rank, budget, self._evd, min_probability=cfg.min_draft_probability)
        if canon is None:
            return [(d, None) for d in ranked]
        # Drafts that are equal once canonicalised would be accepted for the same real
        # observations: one continuation (the best ranked) stands for them all.
        seen = {c.canonical_form for c in started.values()}
        kept: list[tuple[ObservationDraft, str | None]] = []
        for d in ranked:
            form = canon.canonical(d.text)
            if form not in seen:
                seen.add(form)
                kept.append((d, form))
                if len(kept) == room:
                    break
        return kept

    def accepted(self, observation: str, continuations: Mapping[str, Branch]) -> str | None:
        """The text of the continued draft accepted for the real ``observation``: byte for
        byte, else, under canonical acceptance, the first equal to it once canonicalised."""
        if observation in continuations:
            return observation
        if self._canon is None:
            return None
        try:
            form = self._canon.canonical(observation)
        except Exception as exc:
            # Canonical acceptance only saves a decode: without it the step decodes afresh.
            self._failed("canonicalising the observation", exc)
            return None
        return next((t for t, c in continuations.items() if c.canonical_form == form), None)

    def tool_if_hit(self, draft: ObservationDraft) -> float | None:
        """EVD's tool time (s) of the step should ``draft`` be its observation; None without
        EVD or while it knows nothing yet."""
        if self._evd is None:
            return None
        try:
            return self._evd.tool_time(draft) or None  # 0: EVD knows nothing yet
        except Exception as exc:
            self._failed("EVD's tool time of a draft", exc)
            return None

    def learn_tool_time(self, action: Action, observation: str, tool_ns: int) -> None:
        """EVD learns a committed step's tool time (a failure only costs ranking)."""
        if self._evd is not None and not action.is_none:
            try:
                self._evd.observe(action, observation, tool_ns * 1e-9)
            except Exception as exc:
                self._failed("learning the step's tool time (EVD)", exc)  # it only ranks drafts

    # ------------------------------------------------------------------ targets

    def speculate_actions(self, history: History) -> None:
        """Launch the action drafters' targets for this boundary into forks."""
        if self._targets is not None:
            # Why: targets drafted for the previous boundary are offsets from a history that
            # is no longer the verified one.
            self._targets.cancel()
        self._targets = self._task_group.start_soon(self._draft_targets, history, self._ledger.step)

    async def _in_round(self, kind: str, draft: Callable[[DraftRound], Awaitable[None]]) -> None:
        """Run ``draft`` as one drafting round of ``kind``, unless the controller finds such
        rounds not worth their CPU now."""
        r = self._admission.begin_round(kind)
        if r is None:
            return
        try:
            await draft(r)
        finally:
            # (cut short by the next boundary, the round is over all the same)
            self._admission.end_round(r)

    async def _draft_targets(self, history: History, step: int) -> None:
        await self._in_round(TARGET, lambda r: self._draft_targets_in(history, step, r))

    async def _draft_targets_in(self, history: History, step: int, r: DraftRound) -> None:
        cfg = self._config
        sources: list[Source] = [
            (f"action drafter {type(d).__name__}", _call(d.propose, history, cfg.fork_width, cfg.depth))
            for d in self._action_drafters
        ]
        proposals: list[tuple[str, ActionDraft]] = []
        await self._fan_out(sources, ActionDraft, lambda who, ds: proposals.extend((who, d) for d in ds), r)
        if self._ledger.step != step:
            return  # the boundary passed while drafting: these offsets no longer apply
        with self._measured(r):
            self._launch_best([(w, d) for w, d in proposals if d.offset < cfg.depth], cfg.fork_width, drafted_in=r)

    @contextlib.contextmanager
    def _measured(self, r: DraftRound) -> Iterator[None]:
        """The CPU of the block (a drafter call's start, taking its drafts, pricing and
        launching them) is round ``r``'s, where the controller measures drafting."""
        admission = self._admission
        t0 = admission.drafting_cpu_ns()
        try:
            yield
        finally:
            if t0 is not None and (t1 := admission.drafting_cpu_ns()) is not None:
                r.cpu_ns = (r.cpu_ns or 0) + max(0, t1 - t0)

    def _launch_best(
        self,
        proposals: list[tuple[str, ActionDraft]],
        width: int,
        *,
        level: int | None = None,
        drafted_in: DraftRound | None = None,
    ) -> None:
        """Launch the ``width`` most likely distinct actions of ``proposals`` (drafter name,
        draft; ties: nearest first) into forks, at their offsets, or at ``level`` for routed
        ones. Each launch is priced first (:meth:`aospec.forks.Forks.launch`): a refused
        one leaves room for the next."""
        proposals.sort(key=lambda wd: (-wd[1].probability, wd[1].offset))
        seen: set[str] = set()
        launched = 0
        routed = level is not None
        kind = ROUTED if routed else TARGET
        for who, d in proposals:
            if launched >= width:
                break
            if d.action.is_none or d.action.key in seen:
                continue
            seen.add(d.action.key)
            at = d.offset if level is None else level
            if self._forks.launch(
                d.action, at, d.probability, kind=kind, source=who, routed=routed, drafted_in=drafted_in
            ):
                launched += 1

    # ------------------------------------------------------------------ routing (tool named mid-decode)

    def route_feed(self, branch: Branch) -> Callable[[object], None]:
        """The ``on_delta`` callback of ``branch``'s decode: every delta into a fresh router
        session, every router event into :meth:`_route`. Called synchronously by the actor
        for each delta, so it does no more than that, and it never raises: a router that
        fails is counted and not fed again during this decode."""
        router = self.router
        assert router is not None
        who = f"router {type(router).__name__}"
        try:
            if self._router_takes_history:
                router_session = router.session(branch.history)
            else:
                router_session = cast(Callable[[], Any], router.session)()
            feed = router_session.feed
        except Exception as exc:
            self._failed(who, exc)
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
                self._failed(who, exc)

        return on_delta

    def _route(self, branch: Branch, event: RouteEvent, drafted: set[str]) -> None:
        """One router event of ``branch``'s decode: into the ledger, to every route listener,
        and (once per tool and decode) to the routed action drafters."""
        tool = event.tool
        if not isinstance(tool, str) or not tool:
            raise DrafterError(f"router event names no tool: {event!r}")
        self._ledger.route_fired(self._clock.now_ns(), short(_describe(event), 120))
        for listener in self._route_listeners:
            try:
                listener(event)
            except Exception as exc:
                self._failed(f"route listener {_label(listener)}", exc)
        if self._routed_on and tool not in drafted and (branch.level == 0 or self._provisional_targets_on):
            # A provisional branch's action is launched early only under provisional_targets
            # (as its decoded action would be): JASV keeps any fork safe, this only bounds work.
            drafted.add(tool)
            self._task_group.start_soon(self._draft_routed, branch, tool)

    async def _draft_routed(self, branch: Branch, tool: str) -> None:
        """The routed drafters' targets for the action ``branch`` is decoding (a router named
        its ``tool``), launched into forks as offset-0 targets of ``branch``'s history."""
        await self._in_round(ROUTED, lambda r: self._draft_routed_in(branch, tool, r))

    async def _draft_routed_in(self, branch: Branch, tool: str, r: DraftRound) -> None:
        width = self._config.routed_width
        sources: list[Source] = [
            (f"routed action drafter {type(d).__name__}", _call(d.propose_routed, branch.history, tool, width))
            for d in self._routed_drafters
        ]
        proposals: list[tuple[str, ActionDraft]] = []
        await self._fan_out(sources, ActionDraft, lambda who, ds: proposals.extend((who, d) for d in ds), r)
        if branch.state is not BranchState.DECODING:
            # Why: the action is emitted (a routed guess of it is useless now: JASV or the
            # step's own execution has it), or the branch's history never happened. While
            # it decodes, a level-0 branch is still at the boundary it was routed at.
            return
        # offset 0 of the branch's history is offset ``level`` of the verified one
        with self._measured(r):
            self._launch_best(
                [(w, d) for w, d in proposals if d.offset == 0], width, level=branch.level, drafted_in=r
            )


def _observation_source(drafter: ObservationDrafter, streams: bool, branch: Branch, n: int) -> Source:
    """One observation drafter's call for ``branch`` (its history read when the call starts)."""
    who = f"observation drafter {type(drafter).__name__}"
    action = branch.action
    assert action is not None
    if streams:
        streaming = cast(StreamingObservationDrafter, drafter)
        return who, lambda: streaming.draft_stream(branch.history, action, n)
    return who, lambda: _once(drafter.draft(branch.history, action, n))


class _Timed:
    """``inner`` awaited, charging round ``r`` the CPU of ``inner``'s own steps: each
    resumption until it suspends or ends, on the controller's drafting CPU clock. What the
    event loop runs while it is suspended (other sessions, decodes, forks) is not its."""

    __slots__ = ("_admission", "_inner", "_round")

    def __init__(self, inner: Awaitable[Any], admission: Admission, r: DraftRound) -> None:
        self._inner, self._admission, self._round = inner, admission, r

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self._inner.__await__()
        admission, r = self._admission, self._round
        value: Any = None
        error: BaseException | None = None
        while True:
            t0 = admission.drafting_cpu_ns()
            try:
                yielded = it.send(value) if error is None else it.throw(error)
            except StopIteration as stop:
                _charge(admission, r, t0)
                return stop.value
            except BaseException:
                _charge(admission, r, t0)
                raise
            _charge(admission, r, t0)
            try:
                value, error = (yield yielded), None
            except GeneratorExit:
                # closed (as a plain ``await`` would be): close the inner awaitable
                close = getattr(it, "close", None)
                if close is not None:
                    close()
                raise
            except BaseException as exc:  # thrown in by the event loop (a cancellation): passed on
                value, error = None, exc


def _charge(admission: Admission, r: DraftRound, t0: int | None) -> None:
    if t0 is not None and (t1 := admission.drafting_cpu_ns()) is not None:
        r.cpu_ns = (r.cpu_ns or 0) + max(0, t1 - t0)


def _call(method: Callable[..., Awaitable[object]], *args: object) -> Callable[[], AsyncIterator[object]]:
    """A drafter call that does not stream, as a source of one batch."""
    return lambda: _once(method(*args))


async def _once(result: Awaitable[object]) -> AsyncIterator[object]:
    yield await result


def _source_name(who: str) -> str:
    """A drafter's name for the speculation controller: its class name (``who`` is
    "<kind> drafter <ClassName>")."""
    return who.rsplit(" ", 1)[-1]


def _ignore_delta(delta: object) -> None:
    """The ``on_delta`` of a decode whose router could not open a session."""


def _describe(event: RouteEvent) -> str:
    """A router event for the ledger: its tool, router, confidence and position (the tool
    alone when the event lacks the others)."""
    try:
        p: object = event.confidence
        p = f"{p:.2f}" if isinstance(p, float) else p
        return f"{event.tool} ({event.router}, p={p}, at {event.position})"
    except AttributeError:
        return event.tool


def _label(listener: Callable[..., object]) -> str:
    try:
        return listener.__qualname__
    except AttributeError:
        return type(listener).__name__


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
