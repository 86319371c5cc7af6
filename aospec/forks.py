"""The JASV fork registry: speculative target actions running in sandbox forks.

Joint Action-State Verification reuses a fork for the action the actor emitted iff the
fork's action key equals the emitted action's key AND the fork's origin version equals the
committed version. Entries are indexed by ``(origin_version, action_key)`` so that check is
one dict lookup. Forks whose origin is no longer the committed version can never be reused
(versions never return to an earlier value) and are pruned after every commit; forks of
steps that left the filesystem unchanged keep their origin and stay valid across steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio

from aospec.protocols import Sandbox
from aospec.types import Action

if TYPE_CHECKING:
    from anyio import TaskHandle

__all__ = ["ForkEntry", "ForkRegistry"]


class ForkEntry:
    """One execution: ``action`` running in ``sandbox``, forked at ``origin``.

    While it executes, the fork belongs to the task running it: cancelling ``task`` stops
    it, and the task discards the fork. Once ``finished`` with an observation the fork is
    ``idle`` and belongs to the engine, which either commits it (``consumed``, JASV took
    it) or discards it; ``released`` marks one the engine gave up on (pruned or evicted).
    ``failed`` marks an execution that ended without an observation.
    """

    __slots__ = (
        "_waiter",
        "action",
        "consumed",
        "exec_end_ns",
        "exec_start_ns",
        "failed",
        "finished",
        "idle",
        "launched_ns",
        "observation",
        "offset",
        "origin",
        "probability",
        "released",
        "sandbox",
        "speculative",
        "task",
    )

    def __init__(self, action: Action, *, offset: int, probability: float, launched_ns: int, speculative: bool) -> None:
        self.action = action
        self.offset = offset
        self.probability = probability
        self.launched_ns = launched_ns
        self.speculative = speculative
        self.origin: str | None = None
        self.sandbox: Sandbox | None = None
        self.observation: str | None = None
        self.failed = False
        self.finished = False
        self.idle = False
        self.consumed = False
        self.released = False
        self.exec_start_ns: int | None = None
        self.exec_end_ns: int | None = None
        self._waiter: anyio.Event | None = None
        self.task: TaskHandle[None] | None = None

    def finish(self) -> None:
        """Mark the execution over (with or without an observation) and wake waiters."""
        self.finished = True
        self.failed = self.observation is None
        if self._waiter is not None:
            self._waiter.set()

    async def wait_finished(self) -> None:
        """Wait until the execution is over."""
        if not self.finished:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def tool_ns(self, now_ns: int) -> int:
        """Tool time this fork has spent executing so far (all of it once done)."""
        if self.exec_start_ns is None:
            return 0
        end = self.exec_end_ns if self.exec_end_ns is not None else now_ns
        return end - self.exec_start_ns


class ForkRegistry:
    """Live forks by ``(origin_version, action_key)``, in launch order."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], ForkEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[ForkEntry]:
        return iter(list(self._entries.values()))

    def has(self, version: str, action_key: str) -> bool:
        return (version, action_key) in self._entries

    def add(self, entry: ForkEntry) -> bool:
        """Register a forked entry (its ``origin`` set); False if an equal one is live."""
        assert entry.origin is not None
        key = (entry.origin, entry.action.key)
        if key in self._entries:
            return False
        self._entries[key] = entry
        return True

    def take(self, action: Action, version: str) -> ForkEntry | None:
        """JASV: remove and return the fork that ran ``action`` from ``version``, if any
        (a failed fork is never returned)."""
        entry = self._entries.pop((version, action.key), None)
        if entry is not None and entry.failed:
            return None
        return entry

    def remove(self, entry: ForkEntry) -> None:
        if entry.origin is not None and self._entries.get((entry.origin, entry.action.key)) is entry:
            del self._entries[(entry.origin, entry.action.key)]

    def stale(self, version: str) -> list[ForkEntry]:
        """Remove and return every entry whose origin is not ``version``."""
        out = [e for k, e in self._entries.items() if k[0] != version]
        for e in out:
            del self._entries[(e.origin, e.action.key)]  # type: ignore[index]
        return out

    def oldest(self, n: int) -> list[ForkEntry]:
        """Remove and return the ``n`` oldest entries."""
        out = list(self._entries.values())[:n]
        for e in out:
            self.remove(e)
        return out
