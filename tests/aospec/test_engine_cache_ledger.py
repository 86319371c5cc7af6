"""Cache accounting: a committed step whose executing sandbox (the reused fork, the step's
own fork, or the committed sandbox without forks) served the action from its result cache
is counted (``cache_hits``, ``cache_saved_ns``, a ``cache_hit`` event); discarded forks,
sandboxes without the capability and unreadable values count nothing. And the new
statistics fields leave older users of ``EngineStatistics`` as they were."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
from trio.testing import MockClock

from aospec.engine import Engine
from aospec.engine_config import EngineConfig
from aospec.ledger import EngineStatistics, EventKind, Ledger
from aospec.protocols import ActionDraft, CachingSandbox
from aospec.testing import InMemorySandbox, ScriptedActionDrafter, ScriptedActor
from aospec.types import Action, History

SCRIPT = [
    Action.bash("echo a > x"),
    Action.bash("cat x"),
    Action.bash("ls"),
    Action.bash("echo b >> x"),
    Action.bash("cat x"),
]
#: what the "cache" claims to have saved, per command (the others miss)
SAVED_NS = {"cat x": 7_000_000, "ls": 3_000_000, "rm nothing": 11_000_000}


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


class CacheReporting:
    """A test-only sandbox wrapper with the CachingSandbox capability: after each execute,
    ``last_cache_hit_ns`` is ``SAVED_NS`` of the command (None for the rest). ``broken``
    makes reading it raise (or return ``broken`` when that is not an exception)."""

    def __init__(self, inner: InMemorySandbox, broken: object = None) -> None:
        self.inner = inner
        self.broken = broken
        self._last: int | None = None

    @property
    def version(self) -> str:
        return self.inner.version

    @property
    def last_cache_hit_ns(self) -> int | None:
        if isinstance(self.broken, BaseException):
            raise self.broken
        return self.broken if self.broken is not None else self._last

    def cache_counts(self) -> dict[str, int]:
        return {"hits": 0}

    async def execute(self, action: Action) -> str:
        self._last = None
        out = await self.inner.execute(action)
        self._last = SAVED_NS.get(action.command)
        return out

    async def fork(self) -> CacheReporting:
        return CacheReporting(await self.inner.fork(), self.broken)

    async def commit(self, fork: CacheReporting) -> None:
        await self.inner.commit(fork.inner)

    async def discard(self) -> None:
        await self.inner.discard()


def choose(history: History) -> Action:
    return SCRIPT[len(history)] if len(history) < len(SCRIPT) else Action.none()


def expected_hits() -> list[tuple[int, int]]:
    return [(i, SAVED_NS[a.command]) for i, a in enumerate(SCRIPT) if a.command in SAVED_NS]


@pytest.mark.parametrize("mode", ["no forks", "own forks", "reused forks"])
def test_committed_cache_hits_are_counted_wherever_the_step_ran(mode):
    # no forks: each step runs on the committed sandbox; own forks: speculation is on but
    # every target is wrong, so each step runs in its own fork; reused forks: JASV takes
    # the right target's fork. The wrong targets ("rm nothing") hit the cache too, in forks
    # that are discarded: not counted.
    right = mode == "reused forks"
    targets = ScriptedActionDrafter(
        lambda h: [ActionDraft(Action.bash("rm nothing"), 0, 0.3), *([ActionDraft(choose(h), 0, 0.9)] if right else [])]
    )

    async def main():
        sb = InMemorySandbox(op_delay_s=0.01)
        engine = Engine(
            ScriptedActor(choose, 1.0),
            CacheReporting(sb),
            action_drafters=[] if mode == "no forks" else [targets],
            config=EngineConfig(admission="off"),  # every target launched: the cache is what is counted
        )
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, sb, engine

    history, sb, engine = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert sb.live_forks == 0
    stats = engine.statistics()
    if mode == "no forks":
        assert stats.forks_launched == 0
    else:
        assert stats.forks_launched >= 1 and stats.forks_reused == (len(SCRIPT) if right else 0)
    hits = [(e.step, e.ns) for e in engine.ledger.events if e.kind is EventKind.CACHE_HIT]
    assert hits == expected_hits()
    assert stats.cache_hits == len(hits) == 3
    assert stats.cache_saved_ns == sum(ns for _, ns in hits) == 17_000_000
    assert stats.cache_saved_s == pytest.approx(0.017)
    assert all(e.detail == SCRIPT[e.step].key for e in engine.ledger.events if e.kind is EventKind.CACHE_HIT)
    # the cache only counts: latency and the split of time are what they would be without it
    assert stats.latency_ns == stats.wait_actor_ns + stats.wait_tool_ns


@pytest.mark.parametrize("broken", [RuntimeError("cache gone"), "7 ms", -5, float("nan"), True])
def test_an_unreadable_or_malformed_cache_hit_counts_nothing(broken):
    async def main():
        engine = Engine(ScriptedActor(choose, 0.1), CacheReporting(InMemorySandbox(), broken))
        history = await engine.run(History("t"), steps=len(SCRIPT))
        return history, engine.statistics()

    history, stats = run_virtual(main)
    assert history.actions == tuple(SCRIPT)
    assert (stats.cache_hits, stats.cache_saved_ns, stats.speculative_failures) == (0, 0, 0)


def test_the_wrapper_is_a_caching_sandbox_and_the_in_memory_one_is_not():
    assert isinstance(CacheReporting(InMemorySandbox()), CachingSandbox)
    assert not isinstance(InMemorySandbox(), CachingSandbox)


def test_without_a_caching_sandbox_or_a_router_the_new_totals_stay_zero():
    async def main():
        engine = Engine(
            ScriptedActor(choose, 0.1),
            InMemorySandbox(),
            action_drafters=[ScriptedActionDrafter(lambda h: [ActionDraft(choose(h), 0, 0.9)])],
            # admission off: these commands take no time, so the controller would not fork them
            config=EngineConfig(admission="off"),
        )
        await engine.run(History("t"), steps=len(SCRIPT))
        return engine

    engine = run_virtual(main)
    stats = engine.statistics()
    assert stats.forks_reused == len(SCRIPT)
    new = ("routes_fired", "routed_forks_launched", "routed_forks_reused", "cache_hits", "cache_saved_ns")
    assert [getattr(stats, f) for f in new] == [0] * len(new)
    assert not any(e.kind in (EventKind.ROUTE, EventKind.CACHE_HIT) for e in engine.ledger.events)


#: The fields appended after ``wasted_decode_ns``, in order: routing and caching, then the
#: speculation controller's.
APPENDED = [
    "routes_fired",
    "routed_forks_launched",
    "routed_forks_reused",
    "cache_hits",
    "cache_saved_ns",
    "wasted_cpu_ns",
    "admitted",
    "refused_price",
    "refused_guard",
    "refused_budget",
    "refused_memory",
    "probes",
    "guarded_steps",
    "forks_paused",
    "paused_ns",
    "forks_dropped",
    "forks_rebased",
    "forks_traced",
    "drafting_skipped",
    "drafting_probes",
]


def test_the_new_statistics_fields_come_last_and_default_to_zero():
    names = [f.name for f in dataclasses.fields(EngineStatistics)]
    assert names[-len(APPENDED) :] == APPENDED
    # positional construction with the fields that were there before still works
    old = EngineStatistics(*range(len(names) - len(APPENDED)))
    assert all(getattr(old, f) == 0 for f in APPENDED)
    assert (old.cache_saved_s, old.efficiency, old.refused) == (0.0, None, 0)
    assert old.wasted_decode_ns == len(names) - len(APPENDED) - 1


def test_the_ledger_counts_routes_routed_forks_and_cache_hits():
    ledger = Ledger()
    ledger.route_fired(1, "cat (scripted, p=1.00, at 3)")
    ledger.fork_launched(2, "a", routed=True)
    ledger.fork_launched(2, "b")
    ledger.fork_reused(3, "a", routed=True)
    ledger.fork_reused(3, "b")
    ledger.cache_hit(4, "a", 9)
    ledger.committed_step(
        5,
        "a",
        wait_actor_ns=3,
        wait_tool_ns=2,
        decode_ns=3,
        tool_ns=2,
        decode_waited_ns=3,
        tool_waited_ns=2,
        executed=True,
    )
    stats = ledger.statistics()
    assert (stats.routes_fired, stats.routed_forks_launched, stats.routed_forks_reused) == (1, 1, 1)
    assert (stats.forks_launched, stats.forks_reused) == (2, 2)
    assert (stats.cache_hits, stats.cache_saved_ns) == (1, 9)
    kinds = [e.kind for e in ledger.events]
    assert kinds.count(EventKind.ROUTE) == 1 and kinds.count(EventKind.CACHE_HIT) == 1
    assert [e.step for e in ledger.events if e.kind is EventKind.CACHE_HIT] == [0]  # the step it belongs to
    off = Ledger(keep_events=False)
    off.cache_hit(4, "a", 9)
    assert off.events == [] and off.statistics().cache_saved_ns == 9


def test_the_speculation_config_does_not_change_what_is_counted():
    # fork_width 0 and no observation drafting: forks off, the committed sandbox runs the steps
    async def main():
        engine = Engine(
            ScriptedActor(choose, 0.1),
            CacheReporting(InMemorySandbox()),
            action_drafters=[ScriptedActionDrafter(lambda h: [ActionDraft(choose(h), 0, 0.9)])],
            config=EngineConfig(fork_width=0, provisional_targets=False),
        )
        await engine.run(History("t"), steps=len(SCRIPT))
        return engine.statistics()

    stats = run_virtual(main)
    assert stats.forks_launched == 0 and stats.cache_hits == 3 and stats.cache_saved_ns == 17_000_000
