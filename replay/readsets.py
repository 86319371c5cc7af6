"""``--state-model readsets``: replaying live recordings with their read and write sets.

A live recording made with read sets (``aospec run --record FILE --record-read-sets``, or the
live benchmark's recorded runs) holds, besides the exact versions around every step, what
each step's command read and wrote (``Step.extra["read_set"]``/``["write_set"]``,
docs/trace-format.md). Under ``recorded`` a fork launched before a state-changing step is
never reused after it; under ``readsets`` it is, exactly when the engine's read-set
validation (:mod:`aospec.readsets`) would accept it live: the recorded read and write sets
of the step it ran are disjoint from the recorded write sets of the steps committed since
its origin. So the figure lies between ``effects``/``recorded`` and ``blind``.

:class:`ReadSetWorld` is a :class:`aospec.replay.sandbox.ReplayWorld` over the recorded
versions; its sandboxes (:class:`ReadSetReplaySandbox`) have the
:class:`aospec.protocols.ReadSetSandbox` capability. A fork at recorded position ``p``
(version ``v``) executing action ``a`` answers the first recorded step ``i >= p`` that ran
``a`` (the step JASV would commit it to): from ``v`` exactly as under ``recorded`` when
``version_before[i] == v``; else with step ``i``'s recorded observation and time when
:meth:`ReadSetWorld.reuse_ok` says a fork from ``p`` is valid for step ``i``, moving to a
version of its own that only a rebase turns into ``version_after[i]``; else off the
recording. A step without recorded sets is never revalidated (its reads are unknown) and
breaks the chain for forks launched before it (its writes are unknown).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aospec.replay.actor import VirtualClock
from aospec.replay.contention import SimulatedHost
from aospec.replay.sandbox import ReplaySandbox, ReplayWorld, recorded_versions_problem

from aospec.errors import ConfigError, SandboxError
from aospec.readsets import ReadSet, WriteSet, conflict, fork_conflict
from aospec.types import Action, Trace, version_hash

__all__ = ["ReadSetReplaySandbox", "ReadSetWorld", "recorded_access", "readsets_problem"]


def recorded_access(extra: Mapping[str, Any]) -> tuple[ReadSet | None, WriteSet | None]:
    """A step's recorded read and write sets (None where absent or unreadable)."""
    reads = writes = None
    try:
        if isinstance(extra.get("read_set"), Mapping):
            reads = ReadSet.from_json(extra["read_set"])
    except ValueError:
        reads = None
    try:
        if isinstance(extra.get("write_set"), Mapping):
            writes = WriteSet.from_json(extra["write_set"])
    except ValueError:
        writes = None
    return reads, writes


def readsets_problem(trace: Trace) -> str | None:
    """Why ``trace`` cannot be replayed under ``readsets`` (None when it can): it needs
    recorded versions and at least one recorded write set."""
    problem = recorded_versions_problem(trace)
    if problem is not None:
        return problem
    if not any(recorded_access(s.extra)[1] is not None for s in trace.steps):
        return f"trace {trace.id!r} records no read or write sets"
    return None


class ReadSetWorld(ReplayWorld):
    """The recorded versions of one trace plus each step's recorded read and write sets."""

    def __init__(self, trace: Trace, clock: VirtualClock, host: SimulatedHost | None = None) -> None:
        if host is not None:
            raise ConfigError("--state-model readsets does not model contention yet: leave out --cores (and --background-load)")
        problem = readsets_problem(trace)
        if problem is not None:
            raise ConfigError(
                f"--state-model readsets: {problem}: record live runs with their read sets "
                "(aospec run --record FILE --record-read-sets), or choose --state-model recorded"
            )
        super().__init__(trace, clock, "recorded")
        self.state_model = "readsets"
        access = [recorded_access(s.extra) for s in trace.steps]
        self.reads = [r for r, _ in access]
        self.writes = [w for _, w in access]
        self._first: dict[str, list[int]] = {}
        for i, s in enumerate(trace.steps):
            self._first.setdefault(s.action.key, []).append(i)

    def first(self, action: Action, position: int) -> int | None:
        """The first recorded step ``i >= position`` that ran ``action``."""
        for i in self._first.get(action.key, ()):
            if i >= position:
                return i
        return None

    def reuse_ok(self, origin: int, step: int) -> bool:
        """Whether a fork launched at recorded position ``origin`` is valid for ``step``:
        the same version, or (read-set validation) step ``step``'s recorded reads and writes
        disjoint from what the steps ``origin..step-1`` wrote."""
        if self.version_before[origin] == self.version_before[step]:
            return True
        reads, own = self.reads[step], self.writes[step]
        if reads is None or own is None:
            return False
        since = WriteSet()
        for k in range(origin, step):
            ws = self.writes[k]
            if ws is None:
                return False
            since = since.union(ws)
        return conflict(reads, since) is None and fork_conflict(own, since) is None

    def sandbox(self) -> ReadSetReplaySandbox:
        return ReadSetReplaySandbox(self, self.origin, 0)


class ReadSetReplaySandbox(ReplaySandbox):
    """A replay sandbox with the :class:`aospec.protocols.ReadSetSandbox` capability (see
    the module docstring); ``step`` is the recorded step its last ``execute`` answered."""

    __slots__ = ("step",)
    world: ReadSetWorld

    def __init__(self, world: ReadSetWorld, version: str, position: int) -> None:
        super().__init__(world, version, position)
        self.step: int | None = None

    async def execute(self, action: Action) -> str:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        w = self.world
        i = w.first(action, self._position)
        if i is None or w.version_before[i] == self._version:
            self.step = i
            return await super().execute(action)
        if not w.reuse_ok(self._position, i):
            self.step = None
            return await super().execute(action)  # off the recording from this state
        self.step = i
        await w.clock.sleep_ns(w.tool_ns[i])
        self._version = version_hash(self._version, "readsets", str(i))  # only a rebase makes it version_after[i]
        return w.observations[i]

    async def fork(self) -> ReadSetReplaySandbox:
        if self._closed:
            raise SandboxError("replay sandbox was discarded or committed")
        return ReadSetReplaySandbox(self.world, self._version, self._position)

    async def trace_reads(self) -> None:
        """Nothing to do: the reads are the recording's."""

    async def read_set(self) -> ReadSet | None:
        return None if self.step is None else self.world.reads[self.step]

    async def write_set(self) -> WriteSet | None:
        return None if self.step is None else self.world.writes[self.step]

    async def rebase(self, fork: ReadSetReplaySandbox) -> WriteSet:
        w = self.world
        if fork._closed or fork.world is not w or fork.step is None:
            raise SandboxError("rebase of a fork that is closed, from another replay, or off the recording")
        i = fork.step
        if self._version != w.version_before[i]:
            raise SandboxError(f"rebase of recorded step {i + 1} onto a state it was not recorded from")
        self._version, self._position = w.version_after[i], i + 1
        fork._closed = True
        return w.writes[i] or WriteSet()

