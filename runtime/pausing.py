"""Pausing a sandbox's commands and metering their CPU
(:class:`aospec.protocols.PausableSandbox`, :class:`aospec.protocols.MeteredSandbox`).

A command's cgroup freezes it (``aospec.runtime.cgroups``: the v1 freezer or v2's
``cgroup.freeze``) and counts its CPU (v1 cpuacct, v2 ``cpu.stat``). A
:class:`CommandPause` is one sandbox's: it freezes every command running there on
:meth:`~CommandPause.pause`, and a command that starts while the sandbox is paused is
frozen before its first instruction (its cgroup is frozen while its init is still
blocked). :class:`PausableDeadline` is a command's timeout that does not run while the
sandbox is paused: a paused guess must never time out where serial execution would not.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
from aospec.runtime.cgroups import CommandCgroup

__all__ = ["CommandPause", "PausableDeadline"]

#: How long :meth:`CommandPause.pause` waits for the kernel to report every process
#: frozen (a process in uninterruptible IO freezes when the IO ends).
FREEZE_WAIT_S = 1.0


class PausableDeadline:
    """A cancel scope whose deadline stops moving while it is held (the sandbox paused)."""

    def __init__(self, timeout_s: float, *, held: bool) -> None:
        self.scope = anyio.CancelScope()
        self._remaining = timeout_s
        self._held = True
        if not held:
            self.release()

    def hold(self) -> None:
        if self._held:
            return
        self._held = True
        if math.isfinite(self.scope.deadline):
            self._remaining = max(0.0, self.scope.deadline - anyio.current_time())
        self.scope.deadline = math.inf

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        self.scope.deadline = anyio.current_time() + self._remaining


class CommandPause:
    """The pause state of one sandbox's commands, and the CPU they have used.

    ``paused`` is the sandbox's state: while it is True every command running there is
    frozen, a command started meanwhile starts frozen, and none of their timeouts runs.
    ``cpu_ns()`` is the CPU time (user + system) of every command finished so far plus
    the running ones' (read from their cgroups; 0 without a CPU accounting controller).
    """

    def __init__(self) -> None:
        self.paused = False
        self._running: list[CommandCgroup] = []
        self._deadlines: list[PausableDeadline] = []
        self._cpu_done_ns = 0

    # -- what the backend calls around a command --------------------------------------

    def started(self, cg: CommandCgroup | None) -> None:
        """A command's init is in ``cg`` and still blocked: freeze it now when paused."""
        if cg is None:
            return
        self._running.append(cg)
        if self.paused:
            cg.freeze(True)

    def stopped(self, cg: CommandCgroup | None) -> None:
        """A command's processes are gone (its cgroup not yet removed): count its CPU."""
        if cg is None or cg not in self._running:
            return
        self._running.remove(cg)
        self._cpu_done_ns += cg.cpu_ns() or 0

    @contextmanager
    def deadline(self, timeout_s: float) -> Iterator[anyio.CancelScope]:
        """A cancel scope that expires after ``timeout_s`` seconds of unpaused time."""
        deadline = PausableDeadline(timeout_s, held=self.paused)
        self._deadlines.append(deadline)
        try:
            with deadline.scope:
                yield deadline.scope
        finally:
            self._deadlines.remove(deadline)

    def kill_running(self) -> None:
        """SIGKILL every running command's processes (frozen ones too: they are thawed)."""
        for cg in list(self._running):
            cg.kill_all()

    def add_cpu(self, ns: int) -> None:
        """Count ``ns`` of CPU measured by the backend itself (Docker)."""
        self._cpu_done_ns += ns

    def cpu_ns(self) -> int:
        return self._cpu_done_ns + sum(cg.cpu_ns() or 0 for cg in self._running)

    # -- the PausableSandbox calls --------------------------------------------------------

    @property
    def can_freeze(self) -> bool:
        """Whether the running commands can be frozen here (True when none runs)."""
        return all(cg.can_freeze for cg in self._running)

    async def pause(self) -> None:
        """Freeze every running command (returns once the kernel reports them frozen, or
        after :data:`FREEZE_WAIT_S`); stop their timeouts."""
        if self.paused:
            return
        self.paused = True
        for d in self._deadlines:
            d.hold()
        for cg in self._running:
            cg.freeze(True)
        with anyio.move_on_after(FREEZE_WAIT_S):
            while not all(cg.is_frozen() for cg in list(self._running)):
                await anyio.sleep(0.0005)

    def resume(self) -> None:
        """Thaw every running command; their timeouts run again from where they stopped."""
        if not self.paused:
            return
        self.paused = False
        for cg in self._running:
            cg.freeze(False)
        for d in self._deadlines:
            d.release()
