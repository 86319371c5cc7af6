"""The host the speculation controller prices guesses on, and the speculation budget of a host.

- :class:`ProcHostMonitor`: a live :class:`aospec.protocols.HostMonitor` reading ``/proc``:
  the CPUs this process may use (affinity, and the cgroup's CPU quota, v2 ``cpu.max`` or v1
  ``cpu.cfs_quota_us``), the host's busy cores (``/proc/stat``), CPU and memory pressure
  (PSI, ``/proc/pressure/cpu`` and ``memory``: the share of wall time some task stalled,
  from the ``total`` counters over the monitor's window) and ``MemAvailable``. A host without
  PSI gives ``None`` pressures and one line in :attr:`ProcHostMonitor.notes` (the
  controller then prices CPU from free cores alone); it never raises.
- :class:`StaticHostMonitor`: a fixed snapshot (tests; a harness that knows its host).
- :class:`DecodeMeter` (:data:`DECODES`, one per process): the decode streams open in this
  process (each session's verified decode and its observation branches' continuations)
  and this process's CPU time beside them, from which the controller learns the cores one
  stream takes here (the client's parsing; with a model served in this process, its
  serving too), the local price of an observation branch. :class:`ProcHostMonitor` carries
  it as ``decodes``, and the engine thread's CPU clock as ``drafting_cpu`` (what a drafting
  round costs); a simulated host (replay) carries neither, so replay never reads them.
- :class:`SpeculationBudget`: ``--speculation-budget CORES[,MEMORY]``, shared by every session
  of the host: each running speculative fork holds one *slot*, an exclusive ``flock`` on
  one of ``slots`` files in a directory all sessions share (``/run/aospec/speculation``, or
  a per-user directory where that is not writable). A session that finds every slot taken
  refuses the guess (reason ``budget``); a lock dies with its process, so a crashed session
  never holds slots. The kernel-enforced part (a cgroup with a CPU quota and a memory
  limit for all speculative work) belongs to the runtime; this is the count every session
  sees.
- :func:`host_budget`: what ``--speculation-budget`` means where it is not given. ``aospec
  run`` and ``aospec mcp`` default to ``auto``: one slot per two cores this process may use
  (at least one), shared as above, because sessions that each price their guesses alone
  drown a busy host (docs/live-benchmark.md: eight sessions on two cores lost 44-119%
  without a shared budget, 8-13% with one slot). ``none`` turns the host budget off;
  ``AOSPEC_SPECULATION_BUDGET`` sets the default for every aospec process of a host.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aospec.errors import ConfigError
from aospec.protocols import HostSnapshot

__all__ = [
    "BUDGET_DIRECTORY",
    "BUDGET_ENV",
    "DECODES",
    "DecodeMeter",
    "ProcHostMonitor",
    "SpeculationBudget",
    "auto_budget_cores",
    "budget_spec",
    "check_budget",
    "host_budget",
    "SpeculationLease",
    "StaticHostMonitor",
    "parse_budget",
    "process_cores",
]

#: Where the slots of :class:`SpeculationBudget` live when this directory is writable.
BUDGET_DIRECTORY = "/run/aospec/speculation"

_PSI_TOTAL = re.compile(r"^some\b.*\btotal=(\d+)", re.MULTILINE)
_PSI_AVG10 = re.compile(r"^some\b.*\bavg10=([0-9.]+)", re.MULTILINE)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def process_cores(proc: str | os.PathLike[str] = "/proc", cgroup: str | os.PathLike[str] = "/sys/fs/cgroup") -> float:
    """The CPUs this process may use: its affinity mask (``os.cpu_count()`` where there is
    none), capped by its cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu/cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``) when one is set."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = float(os.cpu_count() or 1)
    root = Path(cgroup)
    quota: float | None = None
    text = _read(root / "cpu.max")
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            with contextlib.suppress(ValueError, ZeroDivisionError):
                quota = int(parts[0]) / int(parts[1])
    else:
        q, p = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
        if q is not None and p is not None:
            with contextlib.suppress(ValueError, ZeroDivisionError):
                if int(q) > 0:
                    quota = int(q) / int(p)
    if quota is not None and quota > 0:
        cores = min(cores, quota)
    return max(cores, 0.01)


class DecodeMeter:
    """Decode streams open in this process, integrated over time, beside the process's CPU
    time (every thread, not its children: sandboxed commands are not in it).
    :meth:`streaming` wraps one decode; :meth:`sample` gives ``(cpu_ns, stream_ns)``: the
    process's CPU time and the stream-nanoseconds so far (two open streams for one second
    count 2e9), so two samples' differences give the CPU per second of a stream (an upper
    bound: what the process does beside its streams counts too). Thread-safe; ``clock``
    and ``cpu`` are for tests."""

    def __init__(
        self, *, clock: Callable[[], int] = time.monotonic_ns, cpu: Callable[[], int] = time.process_time_ns
    ) -> None:
        self._clock = clock
        self._cpu = cpu
        self._lock = threading.Lock()
        self._open = 0
        self._stream_ns = 0
        self._since = clock()

    def _advance(self, now: int) -> None:
        self._stream_ns += self._open * max(0, now - self._since)
        self._since = now

    @property
    def open(self) -> int:
        return self._open

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with self._lock:
            self._advance(self._clock())
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._advance(self._clock())
                self._open -= 1

    def sample(self) -> tuple[int, int]:
        with self._lock:
            self._advance(self._clock())
            return self._cpu(), self._stream_ns


#: This process's decode streams (:class:`DecodeMeter`).
DECODES = DecodeMeter()


class StaticHostMonitor:
    """A :class:`aospec.protocols.HostMonitor` that always reads ``snapshot``."""

    def __init__(self, snapshot: HostSnapshot) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> HostSnapshot:
        return self._snapshot


@dataclass(slots=True)
class _Counters:
    t: float
    busy: int
    total: int
    cpu_stall_us: int | None
    memory_stall_us: int | None


class ProcHostMonitor:
    """The live host, read from ``/proc`` (see the module docstring).

    A snapshot covers the time since the previous one, at least ``window_s`` (a snapshot
    asked for sooner is the previous one again, so pricing every guess costs nothing). The
    first snapshot, with no previous counters, takes busy cores from the 1-minute load
    average and pressure from PSI's ``avg10``. ``proc`` and ``clock`` are for tests.
    """

    def __init__(
        self,
        *,
        window_s: float = 0.25,
        proc: str | os.PathLike[str] = "/proc",
        cgroup: str | os.PathLike[str] = "/sys/fs/cgroup",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self._proc = Path(proc)
        self._clock = clock
        self.cores = process_cores(proc, cgroup)
        self._host_cpus = self._count_cpus()
        self._last: _Counters | None = None
        self._snapshot: HostSnapshot | None = None
        #: this process's decode streams: the live controller learns a stream's cores from it
        self.decodes: DecodeMeter = DECODES
        #: the clock drafting rounds are measured on (the engine's thread's CPU time): the live
        #: controller learns what a round costs from it (a simulated host has none)
        self.drafting_cpu: Callable[[], int] = time.thread_time_ns
        self.notes: list[str] = []
        """One line per thing this host lacks that the controller would use (PSI)."""
        if _read(self._proc / "pressure" / "cpu") is None:
            self.notes.append(
                f"this host has no PSI ({self._proc}/pressure): the speculation controller prices CPU from "
                "free cores alone and cannot see stalls"
            )

    def _count_cpus(self) -> int:
        text = _read(self._proc / "stat") or ""
        n = sum(1 for line in text.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
        return n or (os.cpu_count() or 1)

    def _counters(self) -> _Counters:
        busy = total = 0
        text = _read(self._proc / "stat")
        if text:
            fields = text.split("\n", 1)[0].split()
            if fields and fields[0] == "cpu":
                values = [int(v) for v in fields[1:9] if v.isdigit()]
                total = sum(values)
                idle = sum(values[3:5])  # idle + iowait
                busy = total - idle
        return _Counters(self._clock(), busy, total, self._stall("cpu"), self._stall("memory"))

    def _stall(self, resource: str) -> int | None:
        text = _read(self._proc / "pressure" / resource)
        if text is None:
            return None
        m = _PSI_TOTAL.search(text)
        return int(m.group(1)) if m else None

    def _avg10(self, resource: str) -> float | None:
        text = _read(self._proc / "pressure" / resource)
        m = _PSI_AVG10.search(text) if text else None
        return min(1.0, float(m.group(1)) / 100.0) if m else None

    def _memory_available(self) -> int | None:
        text = _read(self._proc / "meminfo") or ""
        for line in text.splitlines():
            if line.startswith("MemAvailable:"):
                parts = line.split()
                with contextlib.suppress(ValueError, IndexError):
                    return int(parts[1]) * 1024
        return None

    def snapshot(self) -> HostSnapshot:
        """What the host has to spare now (never raises: what cannot be read is None)."""
        now = self._clock()
        last = self._last
        if self._snapshot is not None and last is not None and now - last.t < self.window_s:
            return self._snapshot
        counters = self._counters()
        if last is None or counters.total <= last.total:
            load = _read(self._proc / "loadavg")
            try:
                busy = float(load.split()[0]) if load else 0.0
            except (ValueError, IndexError):
                busy = 0.0
            cpu_p, mem_p = self._avg10("cpu"), self._avg10("memory")
        else:
            busy = (counters.busy - last.busy) / (counters.total - last.total) * self._host_cpus
            wall_us = max((counters.t - last.t) * 1e6, 1.0)
            cpu_p = _stall_share(last.cpu_stall_us, counters.cpu_stall_us, wall_us)
            mem_p = _stall_share(last.memory_stall_us, counters.memory_stall_us, wall_us)
        self._last = counters
        self._snapshot = HostSnapshot(
            cores=self.cores,
            busy_cores=max(0.0, min(busy, float(self._host_cpus))),
            cpu_pressure=cpu_p,
            memory_pressure=mem_p,
            memory_available_bytes=self._memory_available(),
        )
        return self._snapshot


def _stall_share(before: int | None, after: int | None, wall_us: float) -> float | None:
    if before is None or after is None:
        return None
    return max(0.0, min(1.0, (after - before) / wall_us))


# ---------------------------------------------------------------------- the host's budget


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}


#: The environment variable that sets the default of ``--speculation-budget`` for every aospec
#: process that reads it (``auto``, ``none`` or ``CORES[,MEMORY]``).
BUDGET_ENV = "AOSPEC_SPECULATION_BUDGET"

#: The words ``--speculation-budget`` takes besides ``CORES[,MEMORY]``.
BUDGET_WORDS = ("auto", "none")


def auto_budget_cores(cores: float | None = None) -> float:
    """The ``auto`` budget: one speculative fork per two of the ``cores`` this process may use
    (:func:`process_cores` by default), at least one."""
    available = process_cores() if cores is None else cores
    return float(max(1, math.floor(available / 2)))


def budget_spec(text: str | None, default: str = "auto", env: dict[str, str] | None = None) -> tuple[str, str]:
    """(the budget ``text`` names, where it came from): ``text``, else :data:`BUDGET_ENV`,
    else ``default``."""
    if text is not None:
        return text, "--speculation-budget"
    value = (os.environ if env is None else env).get(BUDGET_ENV, "").strip()
    return (value, BUDGET_ENV) if value else (default, "--speculation-budget")


def check_budget(text: str | None, *, default: str = "auto", env: dict[str, str] | None = None) -> None:
    """ConfigError naming the option or variable when the budget ``text`` names (see
    :func:`host_budget`) is not ``auto``, ``none`` or ``CORES[,MEMORY]``."""
    spec, where = budget_spec(text, default, env)
    if spec.strip().lower() not in BUDGET_WORDS:
        parse_budget(spec, where=where)


def host_budget(
    text: str | None, *, default: str = "auto", env: dict[str, str] | None = None
) -> SpeculationBudget | None:
    """The host's budget a ``--speculation-budget`` value names: ``text``, or where it is None
    the :data:`BUDGET_ENV` variable, or ``default``. ``auto``: :func:`auto_budget_cores`;
    ``none``: no host budget (None); else ``CORES[,MEMORY]`` (:func:`parse_budget`)."""
    spec, where = budget_spec(text, default, env)
    word = spec.strip().lower()
    if word == "none":
        return None
    if word == "auto":
        return SpeculationBudget(auto_budget_cores())
    return SpeculationBudget(*parse_budget(spec, where=where))


def parse_budget(text: str, *, where: str = "--speculation-budget") -> tuple[float, int | None]:
    """``CORES[,MEMORY]`` (``2``, ``1.5,4G``, ``0.5,512M``) -> (cores, memory bytes or None);
    ConfigError naming the part that is wrong (``where``: the option or variable it came
    from)."""
    cores_text, _, memory_text = text.partition(",")
    try:
        cores = float(cores_text)
    except ValueError:
        raise ConfigError(f"{where} {text!r}: CORES must be a number (e.g. 2 or 1.5,4G), or auto or none") from None
    if not math.isfinite(cores) or cores < 0:
        raise ConfigError(f"{where} {text!r}: CORES must be >= 0 (0: no speculation)")
    if not memory_text:
        return cores, None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", memory_text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{where} {text!r}: MEMORY must be bytes with an optional K, M or G (e.g. 4G)")
    return cores, int(float(m.group(1)) * _UNITS[unit])


class SpeculationLease:
    """One slot of a :class:`SpeculationBudget`, held while a speculative fork runs;
    :meth:`release` (idempotent) gives it back."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the descriptor drops its flock


class SpeculationBudget:
    """The host's speculation budget: at most ``slots`` speculative forks run at once over
    every session that shares ``directory`` (see the module docstring).

    ``slots`` is ``cores`` rounded (at least 1 for a budget above 0; 0 turns speculation
    off), lowered to ``memory_bytes // fork_memory_bytes`` when a memory budget is given.
    A budget above this host's cores is lowered to them, with a line in :attr:`notes`.
    ``directory`` defaults to :data:`BUDGET_DIRECTORY`, else (not writable) a directory per
    user under the temporary directory, noted too.
    """

    def __init__(
        self,
        cores: float,
        memory_bytes: int | None = None,
        *,
        fork_memory_bytes: int = 64 << 20,
        directory: str | os.PathLike[str] | None = None,
        host_cores: float | None = None,
    ) -> None:
        if not math.isfinite(cores) or cores < 0:
            raise ConfigError(f"speculation budget: cores must be >= 0, got {cores!r}")
        if memory_bytes is not None and memory_bytes < 0:
            raise ConfigError(f"speculation budget: memory must be >= 0 bytes, got {memory_bytes!r}")
        self.notes: list[str] = []
        available = host_cores if host_cores is not None else process_cores()
        if cores > available:
            self.notes.append(
                f"--speculation-budget asks for {cores:g} cores but this process may use {available:g}: "
                f"the budget is {available:g} cores"
            )
            cores = available
        self.cores = cores
        self.memory_bytes = memory_bytes
        slots = 0 if cores <= 0 else max(1, round(cores))
        if memory_bytes is not None:
            slots = min(slots, memory_bytes // max(1, fork_memory_bytes))
            if slots == 0 and cores > 0:
                self.notes.append(
                    f"--speculation-budget memory {memory_bytes} bytes is below one fork's estimate "
                    f"({fork_memory_bytes} bytes): no speculative fork will run"
                )
        self.slots = slots
        self.directory = self._directory(directory)

    def _directory(self, directory: str | os.PathLike[str] | None) -> Path:
        if directory is not None:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            return path
        for candidate in (
            Path(BUDGET_DIRECTORY),
            Path(tempfile.gettempdir()) / f"aospec-{os.getuid()}" / "speculation",
        ):
            try:
                candidate.mkdir(parents=True, exist_ok=True, mode=0o755)
                probe = candidate / "slot-0"
                fd = os.open(probe, os.O_RDWR | os.O_CREAT, 0o644)
                os.close(fd)
            except OSError:
                continue
            if candidate != Path(BUDGET_DIRECTORY):
                self.notes.append(
                    f"{BUDGET_DIRECTORY} is not writable: the speculation budget is shared through {candidate} "
                    "(by this user's sessions only)"
                )
            return candidate
        raise ConfigError(f"speculation budget: neither {BUDGET_DIRECTORY} nor a temporary directory is writable")

    def try_acquire(self) -> SpeculationLease | None:
        """A free slot, or None when every slot is held (by any session of the host)."""
        for i in range(self.slots):
            try:
                fd = os.open(self.directory / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            return SpeculationLease(fd)
        return None

    def held(self) -> int:
        """Slots held right now, by every session (a probe: it takes and drops each free one)."""
        n = 0
        for i in range(self.slots):
            try:
                fd = os.open(self.directory / f"slot-{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                n += 1
            finally:
                os.close(fd)
        return n
