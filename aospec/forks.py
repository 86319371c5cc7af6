"""The JASV fork registry: speculative target actions running in sandbox forks.

Joint Action-State Verification reuses a fork for the action the actor emitted iff the
fork's action key equals the emitted action's key AND the fork's origin version equals the
committed version. Entries are indexed by ``(origin_version, action_key)`` so that check is
one dict lookup. Forks whose origin is no longer the committed version can never be reused
(versions never return to an earlier value) and are pruned after every commit; forks of
steps that left the filesystem unchanged keep their origin and stay valid across steps.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio

from aospec.protocols import Sandbox
from aospec.types import Action

if TYPE_CHECKING:
    from anyio import TaskHandle

__all__ = ["ForkEntry", "ForkRegistry", "ForkState"]


class ForkState(enum.Enum):
    """The life of one execution ``f`` (a speculative target, or the committed step's own).

    ``RUNNING`` -> ``IDLE`` -> ``COMMITTED`` when JASV takes it (or it ran the step itself);
    ``RUNNING`` -> ``FAILED`` when it ends without an observation; ``RUNNING`` or ``IDLE`` ->
    ``RELEASED`` -> ``DISCARDED`` when the engine gives up on it (pruned, evicted, run over).
    Who owns the fork: its task while ``RUNNING`` (or ``RELEASED`` from ``RUNNING``), the
    engine while ``IDLE`` (or ``RELEASED`` from ``IDLE``); nobody once it is gone.
    """

    RUNNING = "running"  # its task is forking the committed sandbox or executing the action in the fork
    IDLE = "idle"  # executed, with an observation; waits for JASV
    COMMITTED = "committed"  # its result is the committed step's
    FAILED = "failed"  # ended without an observation (failed, stopped, or forked from a moved state)
    RELEASED = "released"  # given up: it can never pass JASV; its fork is being discarded
    DISCARDED = "discarded"  # its fork was thrown away


class ForkEntry:
    """One execution ``f``: ``action`` running in ``sandbox``, forked at ``origin``.

    ``state`` is its life (:class:`ForkState`); ``task`` the task that runs it (a
    speculative target), cancelled to stop it. ``speculative`` is False for the execution
    of the committed step itself. ``exec_start_ns``/``exec_end_ns`` bound its tool time.
    """

    __slots__ = (
        "_waiter",
        "action",
        "exec_end_ns",
        "exec_start_ns",
        "launched_ns",
        "observation",
        "offset",
        "origin",
        "probability",
        "routed",
        "sandbox",
        "speculative",
        "state",
        "task",
    )

    def __init__(self, action: Action, *, offset: int, probability: float, launched_ns: int, speculative: bool) -> None:
        self.action = action
        self.offset = offset
        self.probability = probability
        self.launched_ns = launched_ns
        self.speculative = speculative
        #: launched for a routed draft (a router's program, drafted mid-decode)
        self.routed = False
        self.state = ForkState.RUNNING
        self.origin: str | None = None
        self.sandbox: Sandbox | None = None
        self.observation: str | None = None
        self.exec_start_ns: int | None = None
        self.exec_end_ns: int | None = None
        self._waiter: anyio.Event | None = None
        self.task: TaskHandle[None] | None = None

    @property
    def running(self) -> bool:
        return self.state is ForkState.RUNNING

    def finish(self, state: ForkState) -> None:
        """End the execution in ``state`` (IDLE, FAILED or DISCARDED) and wake waiters."""
        self.state = state
        if self._waiter is not None:
            self._waiter.set()

    async def wait_finished(self) -> None:
        """Wait until the execution is over (the entry is no longer RUNNING)."""
        if self.state is ForkState.RUNNING:
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
    """Live forks by ``(origin_version, action_key)``, in launch order: every entry is
    RUNNING or IDLE (an entry leaves the registry before any other state)."""

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
        """JASV: remove and return the fork that runs or ran ``action`` from ``version``,
        if any."""
        return self._entries.pop((version, action.key), None)

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
