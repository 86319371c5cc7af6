"""Replay charges each drafter of a policy its own drafting time in virtual time."""

from __future__ import annotations

import anyio
import trio
from aospec.replay.actor import VirtualClock
from aospec.replay.policies import ChargedObservationDrafter, DrafterFailures
from trio.testing import MockClock

from aospec.errors import DrafterError
from aospec.protocols import ObservationDraft
from aospec.testing import ScriptedObservationDrafter
from aospec.types import Action, History

MS = 1_000_000


def drafter(*drafts: ObservationDraft) -> ScriptedObservationDrafter:
    return ScriptedObservationDrafter(lambda h, a: list(drafts))


class Broken:
    async def draft(self, history, action, n):
        raise DrafterError("model went away")


def run_virtual(fn):
    return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})


def test_each_drafter_is_charged_its_own_time_and_its_drafts_arrive_then():
    cheap_a = drafter(ObservationDraft("a", 0.5))
    cheap_b = drafter(ObservationDraft("b", 0.4))
    slow = drafter(ObservationDraft("lm", 0.9, tokens=100))
    failures = DrafterFailures()
    charged = ChargedObservationDrafter([slow, cheap_a, Broken(), cheap_b], VirtualClock(), 2 * MS, 5 * MS, failures)

    async def main():
        t0 = trio.current_time()
        arrivals = []
        async for batch in charged.draft_stream(History("t"), Action.bash("ls"), 8):
            arrivals.append((int(trio.current_time() - t0), [d.text for d in batch]))
        t1 = trio.current_time()
        merged = await charged.draft(History("t"), Action.bash("ls"), 8)
        return arrivals, int(trio.current_time() - t1), [d.text for d in merged]

    arrivals, merged_ns, merged = run_virtual(main)
    # drafters of equal cost arrive together (ranked together), the LM's 100 tokens later
    assert arrivals == [(2 * MS, ["a", "b"]), (2 * MS + 100 * 5 * MS, ["lm"])]
    assert merged_ns == 2 * MS + 100 * 5 * MS and merged == ["lm", "a", "b"]
    assert failures.count == 2 and "model went away" in failures.first


def test_a_policy_whose_drafters_all_fail_still_costs_one_call():
    charged = ChargedObservationDrafter([Broken()], VirtualClock(), 2 * MS, 5 * MS)

    async def main():
        t0 = trio.current_time()
        batches = [list(b) async for b in charged.draft_stream(History("t"), Action.bash("ls"), 8)]
        return batches, int(trio.current_time() - t0)

    assert run_virtual(main) == ([[]], 2 * MS)
