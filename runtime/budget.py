"""The host's speculation budget: one cgroup, ``aospec/speculation``, holding the background
(speculative) commands of every aospec session on the host, with a CPU quota and a memory
limit the kernel enforces.

::

    from aospec.runtime import set_speculation_budget, speculation_budget

    budget = set_speculation_budget(cores=1.0, memory_bytes=4 << 30)
    budget.enforced        # ("cpu", "memory") where the kernel enforces both
    speculation_budget()   # what the host has now, with what speculation uses

A budget is a property of the host, not of a process: it lives in cgroupfs, so every
session (in this process or another) puts its background commands in it from its next
command on, and it stays after the process that set it exits (until
:func:`clear_speculation_budget`). Overlay backend only: a Docker container's cgroup is
fixed when it is created (its background priority is its CPU shares).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

from aospec.runtime.cgroups import POOL, Cgroups, _cpu_usage, _set_cpu_quota, _set_memory_limit, clamp_cpu_quotas
from aospec.runtime.host import host_support

from aospec.errors import ConfigError, SandboxError

__all__ = ["KernelBudget", "clear_speculation_budget", "set_speculation_budget", "speculation_budget"]

#: The smallest budget a command can run in: a CPU quota under 10 ms per 100 ms period,
#: or memory under 32 MiB, starves every guess (and the kernel refuses quotas under 1 ms).
MIN_CORES = 0.01
MIN_MEMORY_BYTES = 32 << 20
_UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as a huge page-rounded number


@dataclass(frozen=True, slots=True)
class KernelBudget:
    """The host's speculation budget as the kernel holds it.

    ``cores`` / ``memory_bytes``: the limits (None: unlimited); ``enforced``: which of
    ``cpu`` and ``memory`` the kernel enforces on this host; ``note``: one line saying what
    is not enforced and the fallback ("" when both are); ``cpu_used_ns`` /
    ``memory_used_bytes``: what speculation on the host has used (CPU since the budget was
    made) and holds now, where the host can say (None otherwise)."""

    cores: float | None
    memory_bytes: int | None
    enforced: tuple[str, ...] = ()
    note: str = ""
    cpu_used_ns: int | None = None
    memory_used_bytes: int | None = None


def set_speculation_budget(*, cores: float | None = None, memory_bytes: int | None = None) -> KernelBudget:
    """Give speculation on this host at most ``cores`` CPUs and ``memory_bytes`` of memory
    (None: that resource unlimited), shared by every session and process; returns the
    budget as set. Raises ConfigError (one line) for a budget that cannot be met: no
    resource given, a non-positive or non-finite value, fewer than 0.01 cores or more
    than the host has, under 32 MiB or more memory than the host has; SandboxError when the
    memory limit is below what speculation holds now. Where a controller is missing (not
    root, no cgroups, no cpu or memory controller) nothing is refused: the budget's
    ``note`` says what the kernel does not enforce, and the engine's own admission control
    (which reads :func:`speculation_budget`) is the fallback."""
    _check(cores, memory_bytes)
    _, cgroups = host_support()
    if cgroups is None:
        return KernelBudget(cores, memory_bytes, (), _note(set()))
    made = []
    for cs, root in cgroups._hierarchy_roots():
        if not cgroups._pooled(cs):
            continue
        d = root / POOL
        if not d.is_dir():
            d.mkdir()
            made.append(d)
            if cgroups.version == 2:
                (d / "cgroup.subtree_control").write_text(" ".join("+" + c for c in cgroups.roots))
        if "memory" in cs:
            try:
                _set_memory_limit(d, cgroups.version, memory_bytes)
            except OSError as exc:
                used = _memory_used(cgroups)
                raise SandboxError(
                    f"the speculation budget cannot hold {memory_bytes} bytes ({os.strerror(exc.errno or 0)}): "
                    f"speculative commands hold {used} bytes now; raise memory_bytes or wait for them to end"
                ) from None
        if "cpu" in cs:
            if cgroups.version == 1:
                clamp_cpu_quotas(d, cores)
            _set_cpu_quota(d, cgroups.version, cores)
    # what runs in the pool is speculative: the least weight (and the idle class)
    cgroups.set_cpu_priority(POOL, background=True)
    budget = speculation_budget()
    assert budget is not None
    return budget


def speculation_budget() -> KernelBudget | None:
    """The host's speculation budget now (None: none is set, or no cgroups here)."""
    _, cgroups = host_support()
    if cgroups is None or not cgroups.pool_exists():
        return None
    cores = memory = None
    enforced = set()
    for cs, root in cgroups._hierarchy_roots():
        d = root / POOL
        if not cgroups._pooled(cs) or not d.is_dir():
            continue
        if "cpu" in cs:
            enforced.add("cpu")
            cores = _read_cores(d, cgroups.version)
        if "memory" in cs:
            enforced.add("memory")
            memory = _read_memory(d, cgroups.version)
    if cores is None and memory is None:
        # the pool without limits: what background-priority commands left (it is made for
        # them whether a budget is set or not, and stays while one runs), not a budget
        return None
    return KernelBudget(
        cores, memory, tuple(sorted(enforced)), _note(enforced), _cpu_used(cgroups), _memory_used(cgroups)
    )


def clear_speculation_budget() -> None:
    """Remove the host's speculation budget: its limits go at once; its cgroup, once the
    background commands in it have ended (until then it holds them, unlimited)."""
    _, cgroups = host_support()
    if cgroups is None:
        return
    for cs, root in cgroups._hierarchy_roots():
        d = root / POOL
        if not cgroups._pooled(cs) or not d.is_dir():
            continue
        if "memory" in cs:
            _set_memory_limit(d, cgroups.version, None)
        if "cpu" in cs:
            _set_cpu_quota(d, cgroups.version, None)
        with contextlib.suppress(OSError):
            d.rmdir()  # fails while commands still run in it


def _check(cores: float | None, memory_bytes: int | None) -> None:
    if cores is None and memory_bytes is None:
        raise ConfigError(
            "speculation budget: give cores, memory_bytes or both (clear_speculation_budget() removes it)"
        )
    host_cores = os.cpu_count() or 1
    if cores is not None:
        if isinstance(cores, bool) or not isinstance(cores, numbers.Real) or not math.isfinite(cores):
            raise ConfigError(f"speculation budget: cores must be a number, got {cores!r}")
        if not MIN_CORES <= cores <= host_cores:
            raise ConfigError(
                f"speculation budget: cores={cores} cannot be met: give between {MIN_CORES} and the host's "
                f"{host_cores} cores"
            )
    if memory_bytes is not None:
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, numbers.Integral):
            raise ConfigError(f"speculation budget: memory_bytes must be a whole number of bytes, got {memory_bytes!r}")
        total = _mem_total()
        if not MIN_MEMORY_BYTES <= memory_bytes <= total:
            raise ConfigError(
                f"speculation budget: memory_bytes={memory_bytes} cannot be met: give between {MIN_MEMORY_BYTES} "
                f"(32 MiB) and the host's {total} bytes"
            )


def _note(enforced: set[str]) -> str:
    missing = [what for what in ("cpu", "memory") if what not in enforced]
    if not missing:
        return ""
    return (
        f"the kernel does not enforce the speculation budget's {' and '.join(missing)} here (no writable "
        f"{' or '.join(missing)} cgroup controller; aospec sandbox info says why): speculative commands "
        "still run at background priority, and the engine's admission control keeps to the budget"
    )


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _read_cores(d: Path, version: int) -> float | None:
    try:
        if version == 2:
            quota, period = (d / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((d / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def _read_memory(d: Path, version: int) -> int | None:
    try:
        text = (d / ("memory.max" if version == 2 else "memory.limit_in_bytes")).read_text().strip()
    except OSError:
        return None
    if text == "max" or int(text) >= _UNLIMITED_V1:
        return None
    return int(text)


def _memory_used(cgroups: Cgroups) -> int | None:
    return cgroups.memory_usage(POOL)


def _cpu_used(cgroups: Cgroups) -> int | None:
    root = next(iter(cgroups.roots.values())) if cgroups.version == 2 else cgroups.roots.get("cpuacct")
    return None if root is None else _cpu_usage(root / POOL, cgroups.version)
