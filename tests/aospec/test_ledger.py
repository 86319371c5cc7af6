"""The speculation ledger: events and running totals."""

from __future__ import annotations

import dataclasses

import pytest

from aospec.ledger import EngineStatistics, EventKind, Ledger


def test_totals_follow_the_recorded_events():
    ledger = Ledger()
    ledger.fork_launched(0, "a")
    ledger.fork_launched(0, "b")
    ledger.draft_started(1, "draft")
    # step 1: decoded 5 ns of which 4 waited for; tool ran 9 ns of which 5 waited for (1 ns overhead)
    ledger.committed_step(
        10, "a", wait_actor_ns=4, wait_tool_ns=6, decode_ns=5, tool_ns=9, decode_waited_ns=4, tool_waited_ns=5, executed=True
    )
    ledger.fork_reused(12, "a")
    ledger.fork_discarded(13, "b", 7)
    ledger.draft_hit(14, "draft")
    ledger.draft_cancelled(14, "other", 3)
    # step 2: decoded entirely before its boundary; its tool fully waited for
    ledger.committed_step(
        20, "b", wait_actor_ns=0, wait_tool_ns=2, decode_ns=5, tool_ns=2, decode_waited_ns=0, tool_waited_ns=2, executed=True
    )
    stats = ledger.statistics()
    assert isinstance(stats, EngineStatistics)
    assert (stats.steps, stats.forks_launched, stats.forks_reused, stats.forks_wasted) == (2, 2, 1, 1)
    assert (stats.drafts_started, stats.drafts_hit, stats.drafts_cancelled) == (1, 1, 1)
    assert (stats.latency_ns, stats.wait_actor_ns, stats.wait_tool_ns) == (12, 4, 8)
    assert (stats.decode_ns, stats.tool_ns) == (10, 11)
    assert (stats.decode_hidden_ns, stats.tool_hidden_ns, stats.overhead_ns) == (10 - 4, 11 - 7, 1)
    assert stats.latency_ns == stats.decode_ns - stats.decode_hidden_ns + stats.tool_ns - stats.tool_hidden_ns + stats.overhead_ns
    assert (stats.wasted_tool_ns, stats.wasted_decode_ns) == (7, 3)
    assert stats.latency_s == pytest.approx(12e-9)
    assert stats.tool_time_hidden_s == pytest.approx(4e-9) and stats.overhead_s == pytest.approx(1e-9)
    assert stats.speculative_tool_time_wasted_s == pytest.approx(7e-9)
    assert stats.provisional_decode_wasted_s == pytest.approx(3e-9)
    kinds = [e.kind for e in ledger.events]
    assert kinds.count(EventKind.FORK) == 2 and EventKind.REUSE in kinds and EventKind.DISCARD in kinds
    assert [e.step for e in ledger.events if e.kind is EventKind.REUSE] == [1]


def test_events_can_be_switched_off_without_changing_totals():
    on, off = Ledger(), Ledger(keep_events=False)
    for ledger in (on, off):
        ledger.fork_launched(0, "a")
        ledger.committed_step(
            3, "a", wait_actor_ns=1, wait_tool_ns=2, decode_ns=1, tool_ns=2, decode_waited_ns=1, tool_waited_ns=2, executed=True
        )
    assert off.events == [] and len(on.events) == 2
    assert on.statistics() == off.statistics()


def test_non_speculative_discards_are_not_waste():
    ledger = Ledger()
    ledger.fork_discarded(1, "committed step's fork, run cancelled", 50, speculative=False)
    assert ledger.statistics().forks_wasted == 0
    assert ledger.statistics().speculative_tool_time_wasted_s == 0.0


def test_statistics_record_is_frozen():
    stats = Ledger().statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.steps = 1  # type: ignore[misc]


def test_waited_time_outside_the_step_is_an_engine_error():
    from aospec.errors import EngineError

    with pytest.raises(EngineError, match="waited decode/tool time"):
        Ledger().committed_step(
            1, "a", wait_actor_ns=1, wait_tool_ns=2, decode_ns=1, tool_ns=2, decode_waited_ns=0, tool_waited_ns=3, executed=True
        )
