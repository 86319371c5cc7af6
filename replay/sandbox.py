"""The replay sandbox: recorded observations after recorded tool times, with versions.

A :class:`ReplayWorld` holds one trace's filesystem versions: ``v_0`` at the start, and
after step ``i`` a new version when the step may have changed the filesystem
(:func:`aospec.effects.step_effect` is ``MAY_CHANGE``), the same version otherwise; exact
hashes are used where the trace recorded them. Versions never return to an earlier value,
like the chained root hashes of the real runtime.

A :class:`ReplaySandbox` at version ``v`` whose lineage has committed ``p`` steps executes
action ``a`` by finding the first recorded step ``i >= p`` with ``version_before[i] == v``
and action ``a``: it sleeps ``T_i``, returns ``o_i`` and moves to ``version_after[i]``. That
is exactly the step JASV can commit this result to (a fork is consumed by the first
emission of ``a`` at ``v``, and the engine never forks the action the committed step is
executing from the same state). An action with no such step is off the recording: it
returns a deterministic placeholder after a plausible time (the same action's recorded time
elsewhere in the trace, else the trace's median tool time) and moves to a version of its
own, so it can never pass JASV for a recorded step.
"""

from __future__ import annotations

import bisect
import statistics

from aospec.effects import step_effect
from aospec.errors import SandboxError
from aospec.types import Action, Effect, Trace, version_hash
from replay.actor import VirtualClock, seconds_to_ns

__all__ = ["OFF_RECORD_PREFIX", "ReplaySandbox", "ReplayWorld"]

#: Every off-record observation starts with this text.
OFF_RECORD_PREFIX = "[aospec replay] no recorded result for this action from this state: "


class ReplayWorld:
    """Versions, results and tool times of one trace (shared by a sandbox and its forks).

    ``tool_ns[i]`` is the recorded tool time in exact nanoseconds; an unknown one counts as
    0 and is listed in ``unknown_tool_steps``.
    """

    def __init__(self, trace: Trace, clock: VirtualClock) -> None:
        self.trace = trace
        self.clock = clock
        steps = trace.steps
        n = len(steps)
        self.observations = [s.observation for s in steps]
        self.tool_ns: list[int] = []
        self.unknown_tool_steps: list[int] = []
        for i, s in enumerate(steps):
            if s.tool_duration_s is None:
                self.tool_ns.append(0)
                self.unknown_tool_steps.append(i)
            else:
                self.tool_ns.append(seconds_to_ns(s.tool_duration_s))
        self.version_before: list[str] = []
        self.version_after: list[str] = []
        self.effects: list[Effect] = []
        v = steps[0].version_before if n and steps[0].version_before else version_hash("origin", trace.id)
        self.origin = v
        for i, s in enumerate(steps):
            if s.version_before:
                v = s.version_before
            effect = step_effect(s)
            self.effects.append(effect)
            self.version_before.append(v)
            if s.version_after:
                v = s.version_after
            elif effect is Effect.MAY_CHANGE:
                v = version_hash(v, "step", str(i))
            self.version_after.append(v)
        self._index: dict[tuple[str, str], list[int]] = {}
        self._first_ns: dict[str, int] = {}
        unknown = set(self.unknown_tool_steps)
        for i, s in enumerate(steps):
            self._index.setdefault((self.version_before[i], s.action.key), []).append(i)
            if i not in unknown:
                self._first_ns.setdefault(s.action.key, self.tool_ns[i])
        known = [self.tool_ns[i] for i in range(n) if i not in unknown]
        self._median_ns = int(statistics.median_low(known)) if known else 0

    def match(self, version: str, action: Action, position: int) -> int | None:
        """The first recorded step ``i >= position`` that ran ``action`` from ``version``."""
        found = self._index.get((version, action.key))
        if not found:
            return None
        k = bisect.bisect_left(found, position)
        return found[k] if k < len(found) else None

    def off_record_ns(self, action: Action) -> int:
        return self._first_ns.get(action.key, self._median_ns)

    def sandbox(self) -> ReplaySandbox:
        """The committed sandbox at the trace's initial version."""
        return ReplaySandbox(self, self.origin, 0)


class ReplaySandbox:
    """A sandbox (or fork) replaying its world's recorded results; see the module docstring."""

    __slots__ = ("_closed", "_position", "_version", "world")

    def __init__(self, world: ReplayWorld, version: str, position: int) -> None:
        self.world = world
        self._version = version
        self._position = position
        self._closed = False

    @property
    def version(self) -> str:
        return self._version

    @property
    def position(self) -> int:
        """Recorded steps this sandbox's lineage has executed."""
        return self._position

    async def execute(self, action: Action) -> str:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        w = self.world
        i = w.match(self._version, action, self._position)
        if i is None:
            await w.clock.sleep_ns(w.off_record_ns(action))
            self._version = version_hash(self._version, "off-record", action.key)
            return OFF_RECORD_PREFIX + action.key[:200]
        await w.clock.sleep_ns(w.tool_ns[i])
        self._version = w.version_after[i]
        self._position = i + 1
        return w.observations[i]

    async def fork(self) -> ReplaySandbox:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        return ReplaySandbox(self.world, self._version, self._position)

    async def commit(self, fork: ReplaySandbox) -> None:
        if fork._closed or fork.world is not self.world:
            raise SandboxError("commit of a fork that is closed or from another replay")
        self._version = fork._version
        self._position = fork._position
        fork._closed = True

    async def discard(self) -> None:
        self._closed = True
