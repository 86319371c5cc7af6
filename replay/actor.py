"""The replay actor and the virtual clock.

Virtual time runs on trio's ``MockClock(autojump_threshold=0)``: whenever every task waits,
the clock jumps to the next deadline, so a trace replays in milliseconds. One virtual
"second" of that clock stands for one nanosecond here: every duration is an integer number
of nanoseconds, and floats hold integers below 2**53 exactly, so all virtual arithmetic is
exact (a 100-day trace is still far below 2**53 ns). Code that sleeps in replay must go
through :meth:`VirtualClock.sleep_ns`.

:class:`ReplayActor` decodes step ``i`` in ``output_tokens_i * TPOT`` (+ an optional
prefill model) and returns the recorded action ``a_i`` when the history it is given equals
the recorded one (also on a provisional branch); otherwise a deterministic action that no
recorded step has, which therefore can never be committed. Given a canonicaliser (policies
with ``accept="canonical"``), a history whose observations equal the recorded ones once
canonicalised also counts as recorded: that models the assumption canonical acceptance
rests on, that the actor's action does not depend on the canonicalised fields.

:meth:`ReplayActor.decode_streaming` (a :class:`aospec.protocols.StreamingActor`, used by
the engine only when a policy routes) takes the same time and returns the same action, and
on the recorded history reports the step's recorded stream (replay/_streams.py) while it
decodes: after the prefill, delta ``k`` of ``n`` when ``k/n`` of the output tokens' time
has passed. On any other history it reports nothing: the recorded stream belongs to the
recorded action, and a router fed it would name a tool the diverged decode never calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal

import trio
from aospec.replay._streams import step_stream

from aospec.protocols import ObservationCanonicalizer
from aospec.types import Action, History, Trace, Turn

__all__ = ["DIVERGED_TOOL", "END_TOOL", "ReplayActor", "VirtualClock", "ms_to_ns", "seconds_to_ns"]

#: Tool name of the action the replay actor returns on a history that left the recording.
DIVERGED_TOOL = "replay.diverged"
#: Tool name of the action it returns after the last recorded step.
END_TOOL = "replay.end"


def seconds_to_ns(seconds: float) -> int:
    """Exact nanoseconds of a recorded duration (decimal digits as written, no float error)."""
    return int((Decimal(repr(float(seconds))) * 1_000_000_000).to_integral_value())


def ms_to_ns(ms: float) -> int:
    return int((Decimal(repr(float(ms))) * 1_000_000).to_integral_value())


class VirtualClock:
    """Integer-nanosecond clock over trio's (mock) clock, 1 unit = 1 ns (replay runs on trio)."""

    __slots__ = ()

    def now_ns(self) -> int:
        return int(trio.current_time())

    async def sleep_ns(self, ns: int) -> None:
        if ns > 0:
            await trio.sleep(ns)


def estimate_tokens(text: str) -> int:
    """ceil(len/4): the usual characters-per-token estimate."""
    return math.ceil(len(text) / 4)


class ReplayActor:
    """Replays a trace's actions with decode time ``output_tokens * tpot_ns``.

    ``prefill_ns_per_token`` adds a prefill model with prefix caching: decoding step ``i``
    first prefills what the history gained since step ``i-1`` (the task for step 0, the
    observation of step ``i-1`` after it), at ``ceil(len/4)`` tokens per text.
    ``canonicalizer``: observations equal to the recorded ones once canonicalised match.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        tpot_ns: int,
        clock: VirtualClock,
        prefill_ns_per_token: int = 0,
        canonicalizer: ObservationCanonicalizer | None = None,
    ) -> None:
        self.trace = trace
        self.clock = clock
        self._canon = canonicalizer
        self._canon_obs: dict[int, str] = {}
        steps = trace.steps
        self._actions = [s.action for s in steps]
        self._turns = [Turn(s.action, s.observation) for s in steps]
        self._known: list[Turn | None] = [None] * len(steps)
        task = trace.instruction or trace.task
        self.decode_ns: list[int] = []
        self._prefill_ns: list[int] = []
        for i, s in enumerate(steps):
            prefill = 0
            if prefill_ns_per_token:
                new_text = task if i == 0 else steps[i - 1].observation
                prefill = estimate_tokens(new_text) * prefill_ns_per_token
            self._prefill_ns.append(prefill)
            self.decode_ns.append(s.output_tokens * tpot_ns + prefill)
        self._streams: list[list[object] | None] = [None] * len(steps)
        self.calls = 0

    def matches(self, history: History) -> bool:
        """Whether ``history`` equals the recorded history of the same length.

        Checks turns from the end until one is a turn object already verified at that
        position (histories share their prefix objects), so the cost is O(new turns).
        """
        turns = history.turns
        n = len(turns)
        if n > len(self._turns):
            return False
        known, rec = self._known, self._turns
        k = n - 1
        while k >= 0:
            t = turns[k]
            if t is known[k]:
                break
            r = rec[k]
            if t.action != r.action or (t.observation != r.observation and not self._same_canonical(k, t.observation)):
                return False
            k -= 1
        if n:
            known[n - 1] = turns[n - 1]
        return True

    def _same_canonical(self, k: int, observation: str) -> bool:
        canon = self._canon
        if canon is None:
            return False
        rec = self._canon_obs.get(k)
        if rec is None:
            rec = self._canon_obs[k] = canon.canonical(self._turns[k].observation)
        return canon.canonical(observation) == rec

    async def decode(self, history: History) -> Action:
        self.calls += 1
        i = len(history)
        if i >= len(self._actions):
            return Action(END_TOOL)
        ok = self.matches(history)
        await self.clock.sleep_ns(self.decode_ns[i])
        return self._actions[i] if ok else Action(DIVERGED_TOOL, {"step": i})

    def stream(self, i: int) -> list[object]:
        """The recorded stream of step ``i`` (replay/_streams.py: what
        ``aospec.specbox.routers.step_stream`` gives, tool-call pieces as chat-completions chunks)."""
        found = self._streams[i]
        if found is None:
            found = self._streams[i] = step_stream(self.trace.steps[i])
        return found

    async def decode_streaming(self, history: History, on_delta: Callable[[object], None]) -> Action:
        """:meth:`decode`, reporting the recorded stream while decoding on the recorded
        history: the prefill first, then delta ``k`` of ``n`` (from 1) at
        ``round(k/n * output tokens' time)``, so the last one arrives as the action does.
        Nothing is reported on a diverged history or after the last step."""
        i = len(history)
        if i >= len(self._actions) or not self.matches(history):
            return await self.decode(history)
        self.calls += 1
        total = self.decode_ns[i]
        stream = self.stream(i)
        lead = self._prefill_ns[i]
        span = total - lead
        n = len(stream)
        elapsed = 0
        for k, delta in enumerate(stream, 1):
            at = lead + (2 * k * span + n) // (2 * n)  # round(k/n * span), exact in integers
            await self.clock.sleep_ns(at - elapsed)
            elapsed = at
            on_delta(delta)
        await self.clock.sleep_ns(total - elapsed)
        return self._actions[i]
