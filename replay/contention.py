"""Contention in replay: the host as processor sharing in virtual time (``--cores``).

Without a host model a replayed command takes exactly its recorded tool time, whatever
else runs. With one (:class:`HostModel`: ``cores`` C, ``background_load`` L), every command
of a replay (the committed step and every speculative fork that is not paused, of every
session on the host) runs on one :class:`SimulatedHost` of C cores beside L always-runnable
background processes, and progresses at the share of the CPU it gets:

- A recorded step took ``T`` of wall time and used ``U`` of CPU (``Step.tool_cpu_s``; when
  not recorded, ``HostModel.unrecorded_cpu`` x T, by default all of it: a command is taken
  to be CPU-bound unless the recording says otherwise). It runs as ``n = max(1, U/T)``
  threads, each wanting a CPU ``v = U/(n T)`` of the time and waiting (IO, sleeps, the
  network) the rest. Only the CPU part contends: a thread that gets a share ``s`` (0..1) of
  a core while it wants one spends ``vT/s`` on CPU and ``(1 - v)T`` waiting, so the command
  progresses at ``s / (v + s(1 - v))`` of its recorded speed and uses
  ``n v s / (v + s(1 - v))`` cores meanwhile (a fluid model: CPU bursts and waits are
  taken to interleave finely).
- The C cores are shared like Linux's fair scheduler shares them: every runnable thread
  gets ``s = min(1, w x lambda)`` for the one ``lambda`` at which the cores in use add up to
  C (or ``s = 1`` for everyone when they fit). ``w`` is 1 for a command at normal priority
  and for a background process, and :data:`IDLE_WEIGHT` for a speculative fork the engine
  put in the background (``set_priority(foreground=False)``: the runtime runs those under
  SCHED_IDLE, whose weight is 3 against a normal task's 1024). Background processes are
  CPU-bound threads (``v = 1``).
- A paused command (:class:`aospec.protocols.PausableSandbox` on a replay fork) is frozen:
  it takes no CPU and makes no progress until resumed.

So two CPU-bound commands on one core each take twice their time; L background processes
slow a CPU-bound committed step by ``max(1, (L + 1) / C)`` (a command waiting a fraction of
its time by less); a command that waits all its time (``U = 0``) is never slowed. Whenever
the set of running commands changes (one starts, ends, is paused, resumed or reprioritised)
the host settles everyone's progress and CPU up to that instant and recomputes the shares,
and every command whose share changed recomputes when it will finish. With enough cores for every
command (no contention) each takes exactly its recorded time, in integer nanoseconds.

The host reads as a :class:`aospec.protocols.HostMonitor` (:meth:`SimulatedHost.snapshot`,
``SimulatedHost.host_monitor``): its cores, the cores in use (background included), and as
``cpu_pressure`` the share of their runnable time the runnable threads wait for a CPU, all
instantaneous (there is no averaging window in virtual time). Memory is not modelled.

Replay runs on trio (replay/actor.py), so the waiting here uses trio directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import trio
from aospec.replay.actor import VirtualClock

from aospec.errors import ConfigError
from aospec.protocols import HostSnapshot

__all__ = ["IDLE_WEIGHT", "HostModel", "HostedCommand", "SimulatedHost", "shares"]

#: CPU weight of a speculative fork at background priority, relative to a normal task:
#: SCHED_IDLE's 3 against nice 0's 1024 (the kernel's WEIGHT_IDLEPRIO and NICE_0_LOAD).
IDLE_WEIGHT = 3 / 1024

#: Progress (in recorded nanoseconds) below which a command counts as finished: what float
#: rounding of the settled progress can leave behind.
_DONE_NS = 0.5
#: Bisection steps for the share level: far below a nanosecond's worth of any rate.
_BISECTIONS = 64


@dataclass(frozen=True, slots=True)
class HostModel:
    """The simulated host of a contended replay (docs/replay.md, "Contention").

    ``cores``: CPUs (C, > 0, fractions allowed); ``background_load``: always-runnable
    CPU-bound processes beside the replay (L >= 0); ``unrecorded_cpu``: the CPU time of a
    step that recorded none, as a share of its tool time (0..1; default 1: CPU-bound)."""

    cores: float
    background_load: int = 0
    unrecorded_cpu: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not (isinstance(self.cores, (int, float)) and math.isfinite(self.cores)):
            raise ConfigError(f"--cores must be a positive number, got {self.cores!r}")
        if self.cores <= 0:
            raise ConfigError(f"--cores must be a positive number, got {self.cores:g}")
        if isinstance(self.background_load, bool) or not isinstance(self.background_load, int):
            raise ConfigError(f"--background-load must be a whole number of processes, got {self.background_load!r}")
        if self.background_load < 0:
            raise ConfigError(f"--background-load must be >= 0, got {self.background_load}")
        u = self.unrecorded_cpu
        if isinstance(u, bool) or not (isinstance(u, (int, float)) and math.isfinite(u) and 0 <= u <= 1):
            raise ConfigError(f"--unrecorded-cpu must be a share of tool time between 0 and 1, got {u!r}")

    def slowdown(self, sessions: int = 1) -> float:
        """The most a committed step at normal priority can be slowed: every session's
        committed step and the background load sharing the cores."""
        return max(1.0, (self.background_load + sessions) / self.cores)

    def describe(self) -> str:
        """One line for summaries: ``2 cores, 2 background processes, ...``."""
        return (
            f"{self.cores:g} core{'s' if self.cores != 1 else ''}, {self.background_load} background "
            f"process{'es' if self.background_load != 1 else ''}; a step without a recorded CPU time uses "
            f"{self.unrecorded_cpu:.0%} of its tool time on CPU"
        )


def _consumption(v: float, s: float) -> float:
    """Cores one thread uses that wants a CPU ``v`` of its time and gets ``s`` of one."""
    if v >= 1.0:
        return s
    return v * s / (v + s * (1.0 - v))


def _rate(v: float, s: float) -> float:
    """Recorded time per virtual time of a thread as in :func:`_consumption`."""
    if s >= 1.0:
        return 1.0
    if v >= 1.0:
        return s
    return s / (v + s * (1.0 - v))


def shares(cores: float, threads: Sequence[tuple[float, float, float]]) -> list[float]:
    """The CPU share ``s`` (0..1) each group of threads gets while it wants a CPU.

    ``threads``: ``(n, v, w)`` per group: ``n`` threads each wanting a CPU ``v`` of the
    time (0 < v <= 1), at weight ``w``. Every group gets ``min(1, w * lambda)`` for the
    ``lambda`` at which the cores used add up to ``cores`` (everyone 1 when they fit)."""
    if sum(n * v for n, v, _ in threads) <= cores:
        return [1.0] * len(threads)
    if all(v >= 1.0 for _, v, _ in threads):
        return _water_fill(cores, threads)

    def used(level: float) -> float:
        return sum(n * _consumption(v, min(1.0, w * level)) for n, v, w in threads)

    lo, hi = 0.0, 1.0 / min(w for _, _, w in threads)  # at hi every group has s = 1: more than the cores
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if used(mid) < cores:
            lo = mid
        else:
            hi = mid
    # hi, not lo: an exact share (1/2 for two CPU-bound threads on one core) stays exact
    return [min(1.0, w * hi) for _, _, w in threads]


def _water_fill(cores: float, threads: Sequence[tuple[float, float, float]]) -> list[float]:
    """:func:`shares` when every thread always wants a CPU (``v = 1``), exactly: the
    heaviest groups reach a whole core first; the rest share what is left by weight."""
    out = [0.0] * len(threads)
    left, weight = float(cores), sum(n * w for n, _, w in threads)
    order = sorted(range(len(threads)), key=lambda i: -threads[i][2])
    for k, i in enumerate(order):
        n, _, w = threads[i]
        if w * left < weight:  # below a whole core at this level: so is everyone lighter
            for j in order[k:]:
                out[j] = threads[j][2] * left / weight
            break
        out[i] = 1.0
        left -= n
        weight -= n * w
    return out


class HostedCommand:
    """One command on a :class:`SimulatedHost`: ``wall_ns`` of recorded time, ``cpu_ns`` of
    recorded CPU. ``cpu_used_ns`` is the CPU it has used so far (settled when read through
    :meth:`SimulatedHost.cpu_used_ns`)."""

    __slots__ = ("cpu_used_ns", "left_ns", "paused", "rate", "threads", "use", "wake", "want", "weight")

    def __init__(self, wall_ns: int, cpu_ns: int, *, weight: float = 1.0, paused: bool = False) -> None:
        self.left_ns = float(wall_ns)
        self.threads = max(1.0, cpu_ns / wall_ns) if wall_ns > 0 else 1.0
        self.want = min(1.0, cpu_ns / (self.threads * wall_ns)) if wall_ns > 0 else 0.0
        self.weight = weight
        self.paused = paused
        self.rate = 0.0  # recorded ns per virtual ns, now
        self.use = 0.0  # cores used now
        self.cpu_used_ns = 0.0 if wall_ns > 0 else float(cpu_ns)
        self.wake: trio.Event | None = None  # set when its rate changes


class SimulatedHost:
    """C cores shared by the commands of a replay and L background processes, in virtual
    time (see the module docstring). One host serves every session replayed on it."""

    def __init__(self, model: HostModel, clock: VirtualClock) -> None:
        self.model = model
        self.clock = clock
        self._running: list[HostedCommand] = []
        self._settled_ns = 0
        self._background_use = 0.0
        self._pressure = 0.0
        self._allocate()

    @property
    def host_monitor(self) -> SimulatedHost:
        """This host as an :class:`aospec.protocols.HostMonitor`."""
        return self

    @property
    def running(self) -> int:
        """Commands on the host now (paused ones included)."""
        return len(self._running)

    def snapshot(self) -> HostSnapshot:
        """What the simulated host has to spare right now."""
        busy = self._background_use + sum(c.use for c in self._running)
        return HostSnapshot(
            cores=float(self.model.cores),
            busy_cores=min(float(self.model.cores), busy),
            cpu_pressure=self._pressure,
            memory_pressure=0.0,
        )

    def cpu_used_ns(self, command: HostedCommand) -> int:
        """The CPU ``command`` has used up to now."""
        self._settle()
        return int(command.cpu_used_ns)

    async def run(self, command: HostedCommand) -> None:
        """Run ``command`` on the host until it has made all its recorded progress. Cancel
        safe: a cancelled command leaves the host, and the others speed up at once."""
        if command.left_ns <= _DONE_NS:
            return
        self._settle()
        self._running.append(command)
        self._allocate()
        try:
            while command.left_ns > _DONE_NS:
                wake = command.wake = trio.Event()
                deadline = math.inf
                if command.rate > 0:
                    # (less a micro-nanosecond of float noise, so an exact finish stays exact)
                    deadline = self._settled_ns + max(0, math.ceil(command.left_ns / command.rate - 1e-6))
                with trio.move_on_at(deadline):
                    await wake.wait()
                self._settle()
        finally:
            self._settle()
            self._running.remove(command)
            self._allocate()

    def set_paused(self, command: HostedCommand, paused: bool) -> None:
        """Freeze or thaw ``command`` (it keeps its place on the host)."""
        if command.paused != paused:
            self._settle()
            command.paused = paused
            self._allocate()

    def set_weight(self, command: HostedCommand, weight: float) -> None:
        """Change ``command``'s CPU weight (its priority)."""
        if command.weight != weight:
            self._settle()
            command.weight = weight
            self._allocate()

    def _settle(self) -> None:
        """Advance every running command's progress and CPU to now at its current rate."""
        now = self.clock.now_ns()
        dt = now - self._settled_ns
        if dt > 0:
            for c in self._running:
                c.left_ns -= c.rate * dt
                c.cpu_used_ns += c.use * dt
        self._settled_ns = now

    def _allocate(self) -> None:
        """Recompute every running command's share (after a change), and wake those whose
        rate changed to recompute when they finish (the others' finish times stand)."""
        model = self.model
        active = [c for c in self._running if not c.paused and c.want > 0]
        groups = [(c.threads, c.want, c.weight) for c in active]
        if model.background_load:
            groups.append((float(model.background_load), 1.0, 1.0))
        got = shares(model.cores, groups) if groups else []
        before = [c.rate for c in self._running]
        for c in self._running:
            c.rate, c.use = (0.0, 0.0) if c.paused else (1.0, 0.0)
        for c, s in zip(active, got, strict=False):
            c.rate, c.use = _rate(c.want, s), c.threads * _consumption(c.want, s)
        for c, rate in zip(self._running, before, strict=True):
            if c.rate != rate and c.wake is not None:
                c.wake.set()
        self._background_use = model.background_load * got[-1] if model.background_load else 0.0
        # runnable threads: each wants a CPU v/s / (v/s + 1 - v) of its time while it gets s
        runnable = sum(
            n * (1.0 if v >= 1.0 else (v / s) / (v / s + 1.0 - v)) for (n, v, _), s in zip(groups, got, strict=True)
        )
        served = self._background_use + sum(c.use for c in active)
        self._pressure = max(0.0, 1.0 - served / runnable) if runnable > 0 else 0.0
