"""The speculation ledger: every draft, fork, reuse, commit, discard, cancel, router event,
cache hit, pause, resume and drop is an event; the speculation controller's decisions are
counted.

The engine appends :class:`SpeculationEvent` records as it works and keeps running totals,
so :meth:`Ledger.statistics` is O(1). Times are integer nanoseconds of the engine's clock
(virtual in replay, monotonic in live runs).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from aospec.errors import AospecError, EngineError
from aospec.types import Action

__all__ = ["EngineStatistics", "EventKind", "Ledger", "SpeculationEvent", "StepTimes", "label", "short"]

_log = logging.getLogger("aospec.engine")


def short(text: str, n: int = 60) -> str:
    """``text`` cut to ``n`` characters (``...`` marks a cut): an event's ``detail``."""
    return text if len(text) <= n else text[: n - 3] + "..."


def label(action: Action) -> str:
    """An action in a message: its command (else its key), cut to 60 characters."""
    return short(action.command if action.command is not None else action.key)


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    """Length of the intersection of the intervals [a0, a1] and [b0, b1]."""
    return max(0, min(a1, b1) - max(a0, b0))


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One committed step's times (ns), the keywords of :meth:`Ledger.committed_step`."""

    wait_actor_ns: int
    wait_tool_ns: int
    decode_ns: int
    tool_ns: int
    decode_waited_ns: int
    tool_waited_ns: int

    @classmethod
    def measure(
        cls,
        *,
        boundary_ns: int,
        emitted_ns: int,
        now_ns: int,
        decode: tuple[int, int],
        tool_ns: int,
        tool_start_ns: int | None,
    ) -> StepTimes:
        """The times of a step whose action was decoded over ``decode`` (start, end) and
        emitted at ``emitted_ns`` after the boundary ``boundary_ns``, and whose tool ran
        ``tool_ns`` from ``tool_start_ns`` (None: it did not run), committed at ``now_ns``."""
        tool_waited = 0
        if tool_start_ns is not None:
            tool_waited = _overlap(emitted_ns, now_ns, tool_start_ns, tool_start_ns + tool_ns)
        return cls(
            wait_actor_ns=emitted_ns - boundary_ns,
            wait_tool_ns=now_ns - emitted_ns,
            decode_ns=decode[1] - decode[0],
            tool_ns=tool_ns,
            decode_waited_ns=_overlap(boundary_ns, emitted_ns, *decode),
            tool_waited_ns=tool_waited,
        )

    @property
    def hidden_ns(self) -> int:
        """Decode and tool time that speculation hid (that fell outside the step's waits)."""
        return self.decode_ns - self.decode_waited_ns + self.tool_ns - self.tool_waited_ns

    @property
    def overhead_ns(self) -> int:
        """The step's waits beyond its own decode and tool time."""
        return self.wait_actor_ns - self.decode_waited_ns + self.wait_tool_ns - self.tool_waited_ns


class EventKind(enum.Enum):
    """What happened."""

    STEP = "step"  # a step was committed (action verified + observation)
    DRAFT = "draft"  # a provisional continuation started on a drafted observation
    DRAFT_HIT = "draft_hit"  # a draft was byte-identical to the real observation
    DRAFT_CANONICAL_HIT = "draft_canonical_hit"  # a draft equal to it only once canonicalised was accepted
    DRAFT_CANCEL = "draft_cancel"  # a provisional continuation (or a drafting call) was cancelled
    FORK = "fork"  # a speculative target action was launched into a fork
    REUSE = "reuse"  # JASV accepted a fork for the emitted action
    COMMIT = "commit"  # a fork's state became the committed state
    DISCARD = "discard"  # a fork was thrown away (stale origin, evicted, run ended)
    FAIL = "fail"  # a speculative operation failed and was dropped
    ROUTE = "route"  # a stream router named the tool of an action being decoded
    CACHE_HIT = "cache_hit"  # a committed step's result came from the sandbox's result cache (ns: time saved)
    PAUSE = "pause"  # a speculative fork was paused: the command the agent waits on needs the CPU
    RESUME = "resume"  # a paused fork was resumed (ns: how long it was paused)
    DROP = "drop"  # a speculative fork was dropped under memory pressure (the lowest-value one)


@dataclass(frozen=True, slots=True)
class SpeculationEvent:
    """One ledger entry. ``step`` is the committed step index when it happened (0-based),
    ``detail`` a short description (action key or draft text prefix), ``ns`` a duration
    where one applies (tool time of a fork, decode time of a continuation)."""

    kind: EventKind
    t_ns: int
    step: int
    detail: str = ""
    ns: int = 0


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Totals of one engine run, in integer nanoseconds of the engine's clock (the ``_s``
    properties convert to float seconds).

    The committed path: ``latency_ns = wait_actor_ns + wait_tool_ns``, where each step waits
    from its boundary (the previous commit) until the actor emits the action
    (``wait_actor_ns``), then until its observation is committed (``wait_tool_ns``). That
    latency splits into the decoding and tool time waited for and the engine's own work:
    ``latency_ns = (decode_ns - decode_hidden_ns) + (tool_ns - tool_hidden_ns) + overhead_ns``.

    - ``decode_ns`` / ``tool_ns``: decode and tool time of the committed steps.
    - ``decode_hidden_ns``: decoding of committed steps that ran before their boundary, i.e.
      while the previous step's tool ran (a continuation on a matching draft); ``>= 0``.
    - ``tool_hidden_ns``: tool time of committed steps that ran before their action was
      emitted, i.e. while the actor decoded (a reused speculative fork); ``>= 0``.
    - ``overhead_ns``: time on the committed path that was neither decoding nor tool time:
      forking, committing, scheduling (0 in replay's virtual time); ``>= 0``.
    - ``wasted_tool_ns``: tool time spent in speculative forks that were discarded;
      ``wasted_decode_ns``: decoding of provisional continuations that were cancelled.

    ``drafts_hit`` counts byte-identical drafts adopted; ``drafts_canonical_hit`` drafts
    adopted under ``accept="canonical"`` that equal the real observation only once
    canonicalised (always 0 under exact acceptance).

    Routing and caching (0 without a router and without a caching sandbox):

    - ``routes_fired``: router events (a tool named mid-decode), over every decode routed;
    - ``routed_forks_launched`` / ``routed_forks_reused``: the forks launched from routed
      action drafts, and those JASV reused (also counted in ``forks_launched`` /
      ``forks_reused``);
    - ``cache_hits`` / ``cache_saved_ns``: committed steps whose executing sandbox served the
      action from its result cache, and the tool time those entries originally took.

    The speculation controller (``aospec.admission``; docs/engine.md):

    - ``wasted_cpu_ns``: CPU of the discarded speculative forks, measured where the fork's
      sandbox is a :class:`aospec.protocols.MeteredSandbox`, else its tool time (wall) stands
      in; :attr:`efficiency` is ``tool_hidden_ns / wasted_cpu_ns``;
    - ``admitted``: candidates launched (forks and branches; with ``admission="off"``
      every one); ``refused_price`` / ``refused_guard`` / ``refused_budget`` /
      ``refused_memory``: refused because their cost exceeded their benefit, by the
      no-regret guard, for want of a slot of the host's speculation budget, or under memory
      pressure; ``probes``: candidates the guard let through; ``guarded_steps``: steps
      committed while the guard held speculation back;
    - ``forks_paused`` / ``paused_ns``: pauses of speculative forks while the command the
      agent waited on was CPU-bound, and the time they spent paused; ``forks_dropped``:
      forks dropped under memory pressure.
    ``forks_rebased``: forks reused by read-set validation, from an origin older than the
    committed version (also counted in ``forks_reused``; 0 without it, docs/engine.md);
    ``forks_traced``: speculative forks whose reads were traced for it (only while the host
    has a core to spare: the tracer multiplies a command's CPU).
    ``drafting_skipped``: drafting rounds not run because the last ones, priced at the host's
    price then, were not worth the CPU a round takes; ``drafting_probes``: rounds run all
    the same (one in ``aospec.admission.ROUND_PROBE_EVERY``) while they were not.
    """

    steps: int
    actions_executed: int
    forks_launched: int
    forks_reused: int
    forks_wasted: int
    drafts_started: int
    drafts_hit: int
    drafts_canonical_hit: int
    drafts_cancelled: int
    speculative_failures: int
    latency_ns: int
    wait_actor_ns: int
    wait_tool_ns: int
    decode_ns: int
    tool_ns: int
    decode_hidden_ns: int
    tool_hidden_ns: int
    overhead_ns: int
    wasted_tool_ns: int
    wasted_decode_ns: int
    routes_fired: int = 0
    routed_forks_launched: int = 0
    routed_forks_reused: int = 0
    cache_hits: int = 0
    cache_saved_ns: int = 0
    wasted_cpu_ns: int = 0
    admitted: int = 0
    refused_price: int = 0
    refused_guard: int = 0
    refused_budget: int = 0
    refused_memory: int = 0
    probes: int = 0
    guarded_steps: int = 0
    forks_paused: int = 0
    paused_ns: int = 0
    forks_dropped: int = 0

    @property
    def refused(self) -> int:
        """Candidates the controller refused, for any reason."""
        return self.refused_price + self.refused_guard + self.refused_budget + self.refused_memory

    @property
    def efficiency(self) -> float | None:
        """Tool seconds hidden per wasted CPU-second (None when nothing was wasted)."""
        return self.tool_hidden_ns / self.wasted_cpu_ns if self.wasted_cpu_ns else None

    @property
    def wasted_cpu_s(self) -> float:
        return self.wasted_cpu_ns * _S

    forks_rebased: int = 0
    forks_traced: int = 0
    drafting_skipped: int = 0
    drafting_probes: int = 0

    @property
    def latency_s(self) -> float:
        return self.latency_ns * _S

    @property
    def wait_actor_s(self) -> float:
        return self.wait_actor_ns * _S

    @property
    def wait_tool_s(self) -> float:
        return self.wait_tool_ns * _S

    @property
    def decode_time_s(self) -> float:
        return self.decode_ns * _S

    @property
    def tool_time_s(self) -> float:
        return self.tool_ns * _S

    @property
    def decode_time_hidden_s(self) -> float:
        return self.decode_hidden_ns * _S

    @property
    def tool_time_hidden_s(self) -> float:
        return self.tool_hidden_ns * _S

    @property
    def overhead_s(self) -> float:
        return self.overhead_ns * _S

    @property
    def speculative_tool_time_wasted_s(self) -> float:
        return self.wasted_tool_ns * _S

    @property
    def provisional_decode_wasted_s(self) -> float:
        return self.wasted_decode_ns * _S

    @property
    def cache_saved_s(self) -> float:
        return self.cache_saved_ns * _S


_S = 1e-9
#: What the speculation controller's decisions are counted by (aospec.admission).
_DECISIONS = ("admitted", "probe", "off", "price", "guard", "budget", "memory")


class Ledger:
    """Speculation events of one engine run plus running totals."""

    __slots__ = (
        "_cache_hits",
        "_cache_saved_ns",
        "_decisions",
        "_decode_hidden_ns",
        "_decode_ns",
        "_drafting_probes",
        "_drafting_skipped",
        "_drafts_cancelled",
        "_drafts_canonical_hit",
        "_drafts_hit",
        "_drafts_started",
        "_dropped",
        "_executed",
        "_failures",
        "_forks_launched",
        "_forks_rebased",
        "_forks_reused",
        "_forks_traced",
        "_forks_wasted",
        "_guarded",
        "_latency_ns",
        "_overhead_ns",
        "_paused",
        "_paused_ns",
        "_routed_launched",
        "_routed_reused",
        "_routes_fired",
        "_tool_hidden_ns",
        "_tool_ns",
        "_wait_actor_ns",
        "_wait_tool_ns",
        "_warned",
        "_wasted_cpu_ns",
        "_wasted_decode_ns",
        "_wasted_tool_ns",
        "events",
        "keep_events",
        "step",
    )

    def __init__(self, *, keep_events: bool = True) -> None:
        self.keep_events = keep_events
        self.events: list[SpeculationEvent] = []
        self.step = 0
        self._executed = self._forks_launched = self._forks_reused = self._forks_wasted = 0
        self._drafts_started = self._drafts_hit = self._drafts_cancelled = self._failures = 0
        self._drafts_canonical_hit = 0
        self._latency_ns = self._wait_actor_ns = self._wait_tool_ns = 0
        self._tool_ns = self._decode_ns = self._wasted_tool_ns = self._wasted_decode_ns = 0
        self._decode_hidden_ns = self._tool_hidden_ns = self._overhead_ns = 0
        self._routes_fired = self._routed_launched = self._routed_reused = 0
        self._cache_hits = self._cache_saved_ns = 0
        self._wasted_cpu_ns = self._guarded = self._paused = self._paused_ns = self._dropped = 0
        self._decisions = dict.fromkeys(_DECISIONS, 0)
        self._forks_rebased = self._forks_traced = 0
        self._drafting_skipped = self._drafting_probes = 0
        self._warned: set[str] = set()

    def _event(self, kind: EventKind, t_ns: int, detail: str, ns: int) -> None:
        if self.keep_events:
            self.events.append(SpeculationEvent(kind, t_ns, self.step, detail, ns))

    def committed_step(
        self,
        t_ns: int,
        detail: str,
        *,
        wait_actor_ns: int,
        wait_tool_ns: int,
        decode_ns: int,
        tool_ns: int,
        decode_waited_ns: int,
        tool_waited_ns: int,
        executed: bool,
    ) -> None:
        """A step was verified and committed. ``wait_actor_ns``/``wait_tool_ns``: its
        critical path (boundary to emission, emission to commit); ``decode_ns``/``tool_ns``:
        its decode and tool time; ``decode_waited_ns``/``tool_waited_ns``: the parts of
        those that fell within its waits (at most the decode/tool time and the wait)."""
        if not (
            0 <= decode_waited_ns <= min(decode_ns, wait_actor_ns) and 0 <= tool_waited_ns <= min(tool_ns, wait_tool_ns)
        ):
            raise EngineError(
                f"ledger: waited decode/tool time {decode_waited_ns}/{tool_waited_ns} ns outside the step's "
                f"decode/tool time {decode_ns}/{tool_ns} ns or its waits {wait_actor_ns}/{wait_tool_ns} ns"
            )
        self._wait_actor_ns += wait_actor_ns
        self._wait_tool_ns += wait_tool_ns
        self._latency_ns += wait_actor_ns + wait_tool_ns
        self._decode_ns += decode_ns
        self._tool_ns += tool_ns
        self._decode_hidden_ns += decode_ns - decode_waited_ns
        self._tool_hidden_ns += tool_ns - tool_waited_ns
        self._overhead_ns += wait_actor_ns - decode_waited_ns + wait_tool_ns - tool_waited_ns
        self._executed += executed
        self._event(EventKind.STEP, t_ns, detail, wait_actor_ns + wait_tool_ns)
        self.step += 1

    def draft_started(self, t_ns: int, detail: str) -> None:
        self._drafts_started += 1
        self._event(EventKind.DRAFT, t_ns, detail, 0)

    def draft_hit(self, t_ns: int, detail: str) -> None:
        self._drafts_hit += 1
        self._event(EventKind.DRAFT_HIT, t_ns, detail, 0)

    def draft_canonical_hit(self, t_ns: int, detail: str) -> None:
        """A draft equal to the real observation only after canonicalisation was accepted."""
        self._drafts_canonical_hit += 1
        self._event(EventKind.DRAFT_CANONICAL_HIT, t_ns, detail, 0)

    def draft_cancelled(self, t_ns: int, detail: str, decoded_ns: int) -> None:
        self._drafts_cancelled += 1
        self._wasted_decode_ns += decoded_ns
        self._event(EventKind.DRAFT_CANCEL, t_ns, detail, decoded_ns)

    def drafting_lost(self, t_ns: int, detail: str) -> None:
        """A drafting call was cancelled because the real observation came first (no
        continuation had started, so nothing is counted as a cancelled draft)."""
        self._event(EventKind.DRAFT_CANCEL, t_ns, detail, 0)

    def fork_launched(self, t_ns: int, detail: str, *, routed: bool = False) -> None:
        """A speculative fork was launched (``routed``: from a routed action draft)."""
        self._forks_launched += 1
        self._routed_launched += routed
        self._event(EventKind.FORK, t_ns, detail, 0)

    def fork_reused(self, t_ns: int, detail: str, *, routed: bool = False, rebased: bool = False) -> None:
        """JASV reused a fork (``routed``: one launched from a routed action draft;
        ``rebased``: accepted by read-set validation, from an older origin)."""
        self._forks_reused += 1
        self._routed_reused += routed
        self._forks_rebased += rebased
        self._event(EventKind.REUSE, t_ns, detail, 0)

    def fork_traced(self) -> None:
        """A speculative fork's command is traced for its read set."""
        self._forks_traced += 1

    def route_fired(self, t_ns: int, detail: str) -> None:
        """A stream router named the tool of an action being decoded."""
        self._routes_fired += 1
        self._event(EventKind.ROUTE, t_ns, detail, 0)

    def cache_hit(self, t_ns: int, detail: str, saved_ns: int) -> None:
        """The step about to be committed was served by its sandbox's result cache, which
        saved ``saved_ns`` of tool time (recorded before :meth:`committed_step`, so the
        event carries that step's index)."""
        self._cache_hits += 1
        self._cache_saved_ns += saved_ns
        self._event(EventKind.CACHE_HIT, t_ns, detail, saved_ns)

    def fork_committed(self, t_ns: int, detail: str) -> None:
        self._event(EventKind.COMMIT, t_ns, detail, 0)

    def fork_discarded(
        self, t_ns: int, detail: str, tool_ns: int, *, speculative: bool = True, cpu_ns: int | None = None
    ) -> None:
        """A fork was thrown away after ``tool_ns`` of tool time (``cpu_ns``: the CPU it
        used, where its sandbox is metered; else its tool time counts as its CPU)."""
        if speculative:
            self._forks_wasted += 1
            self._wasted_tool_ns += tool_ns
            self._wasted_cpu_ns += cpu_ns if cpu_ns is not None else tool_ns
        self._event(EventKind.DISCARD, t_ns, detail, tool_ns)

    def decided(self, reason: str) -> None:
        """The speculation controller decided on a candidate (``reason``: admitted, probe,
        off, or why it was refused)."""
        self._decisions[reason] += 1

    def drafting_round(self, *, skipped: bool = False, probe: bool = False) -> None:
        """A drafting round was skipped (not worth its CPU), or run as a probe while rounds
        of its kind were not."""
        self._drafting_skipped += skipped
        self._drafting_probes += probe

    def guarded_step(self) -> None:
        """A step was committed while the no-regret guard held speculation back."""
        self._guarded += 1

    def fork_paused(self, t_ns: int, detail: str) -> None:
        self._paused += 1
        self._event(EventKind.PAUSE, t_ns, detail, 0)

    def fork_resumed(self, t_ns: int, detail: str, paused_ns: int) -> None:
        self._paused_ns += paused_ns
        self._event(EventKind.RESUME, t_ns, detail, paused_ns)

    def fork_dropped(self, t_ns: int, detail: str) -> None:
        """The lowest-value fork was dropped under memory pressure (its discard is an event
        of its own)."""
        self._dropped += 1
        self._event(EventKind.DROP, t_ns, detail, 0)

    def failed(self, t_ns: int, detail: str) -> None:
        self._failures += 1
        self._event(EventKind.FAIL, t_ns, detail, 0)

    def speculation_failed(self, t_ns: int, what: str, exc: BaseException, *, warn: bool = False) -> None:
        """A speculative operation (``what``) failed with ``exc``: it only costs speed.
        Counted (``speculative_failures``, a ``fail`` event); an error that is no
        AospecError (a bug in a drafter, an actor or a backend) is also logged on the
        ``aospec.engine`` logger, as is one with ``warn``."""
        self.failed(t_ns, f"{what}: {type(exc).__name__}: {exc}")
        if warn or not isinstance(exc, AospecError):
            # Once per kind of failure and run at WARNING (a drafter that is broken fails on
            # every call), the repeats at DEBUG.
            key = f"{what.split(' {')[0]}: {type(exc).__name__}"
            level = logging.DEBUG if key in self._warned else logging.WARNING
            self._warned.add(key)
            _log.log(level, "speculative %s failed (the run goes on without it): %s: %s", what, type(exc).__name__, exc)

    def statistics(self) -> EngineStatistics:
        """A frozen snapshot of the running totals."""
        d = self._decisions
        return EngineStatistics(
            steps=self.step,
            actions_executed=self._executed,
            forks_launched=self._forks_launched,
            forks_reused=self._forks_reused,
            forks_wasted=self._forks_wasted,
            drafts_started=self._drafts_started,
            drafts_hit=self._drafts_hit,
            drafts_canonical_hit=self._drafts_canonical_hit,
            drafts_cancelled=self._drafts_cancelled,
            speculative_failures=self._failures,
            latency_ns=self._latency_ns,
            wait_actor_ns=self._wait_actor_ns,
            wait_tool_ns=self._wait_tool_ns,
            decode_ns=self._decode_ns,
            tool_ns=self._tool_ns,
            decode_hidden_ns=self._decode_hidden_ns,
            tool_hidden_ns=self._tool_hidden_ns,
            overhead_ns=self._overhead_ns,
            wasted_tool_ns=self._wasted_tool_ns,
            wasted_decode_ns=self._wasted_decode_ns,
            routes_fired=self._routes_fired,
            routed_forks_launched=self._routed_launched,
            routed_forks_reused=self._routed_reused,
            cache_hits=self._cache_hits,
            cache_saved_ns=self._cache_saved_ns,
            wasted_cpu_ns=self._wasted_cpu_ns,
            admitted=d["admitted"] + d["probe"] + d["off"],
            refused_price=d["price"],
            refused_guard=d["guard"],
            refused_budget=d["budget"],
            refused_memory=d["memory"],
            probes=d["probe"],
            guarded_steps=self._guarded,
            forks_paused=self._paused,
            paused_ns=self._paused_ns,
            forks_dropped=self._dropped,
            forks_rebased=self._forks_rebased,
            forks_traced=self._forks_traced,
            drafting_skipped=self._drafting_skipped,
            drafting_probes=self._drafting_probes,
        )
