"""Cgroups of sandbox commands: a command's cgroup nests in its sandbox's, which nests in
its store's (session's), under ``aospec/`` of the v1 controllers or the v2 hierarchy.

A command's cgroup also freezes it (:meth:`CommandCgroup.freeze`: the v1 ``freezer``
controller's ``freezer.state``, or v2's ``cgroup.freeze``) and meters it
(:meth:`CommandCgroup.cpu_ns`: v1 ``cpuacct.usage``, v2 ``cpu.stat``). Background
(speculative) commands go into the host's speculation pool, ``aospec/speculation``, when
:func:`aospec.runtime.set_speculation_budget` made one (:data:`POOL`)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import time
from pathlib import Path

from aospec.runtime.config import Limits

__all__ = ["POOL", "Cgroups", "CommandCgroup", "thaw_process"]

#: The host's speculation pool below ``aospec/``: background commands of every session
#: nest in it (in the cpu, cpuacct and memory hierarchies on v1), under its CPU quota and memory limit.
POOL = "speculation"
_POOLED_V1 = frozenset({"cpu", "cpuacct", "memory"})
_FREEZE_WAIT_S = 1.0


class CommandCgroup:
    """One command's cgroup (all controllers): ``dirs`` holds one directory per hierarchy
    (one for v2), ``pooled`` those that sit in the speculation pool."""

    def __init__(self, owner: Cgroups, dirs: list[Path], *, limits: Limits | None = None) -> None:
        self.owner = owner
        self.dirs = dirs
        self.limits = limits
        self.pooled: list[Path] = []
        self.cpu_before_ns = 0  # CPU counted in a cgroup the command left (the pool's)
        # controller -> its directory among ``dirs``: looked up on every CPU sample (the
        # engine samples the running command every 20 ms); cleared where ``dirs`` changes
        self._with: dict[str, Path | None] = {}

    def add(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return found

    def kill_all(self) -> None:
        """SIGKILL every process, frozen ones too: v1 frozen processes die only once thawed,
        so the cgroup is thawed after the signal (no process runs a line of its own code
        in between: a pending SIGKILL is taken first)."""
        if self.owner.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for d in self.dirs:
            _thaw_dir(d)

    # -- freezing and metering -------------------------------------------------------------

    def _dir_with(self, controller: str) -> Path | None:
        if self.owner.version == 2:
            return self.dirs[0] if self.dirs else None
        try:
            return self._with[controller]
        except KeyError:
            pass
        root = self.owner.roots.get(controller)
        found = None if root is None else next((d for d in self.dirs if d.is_relative_to(root)), None)
        self._with[controller] = found
        return found

    def moved(self) -> None:
        """``dirs`` changed (the command left the pool): look its controllers up again."""
        self._with.clear()

    @property
    def can_freeze(self) -> bool:
        return self._dir_with("freezer") is not None if self.owner.version == 1 else bool(self.dirs)

    def freeze(self, frozen: bool) -> bool:
        """Start freezing (or thaw) every process of the command; False when this host has
        no freezer (or the cgroup is gone). :meth:`is_frozen` says when it is done."""
        d = self._dir_with("freezer")
        if d is None:
            return False
        try:
            if self.owner.version == 2:
                (d / "cgroup.freeze").write_text("1" if frozen else "0")
            else:
                (d / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        except (FileNotFoundError, ProcessLookupError):
            return False
        return True

    def is_frozen(self) -> bool:
        """Whether every process of the command is frozen (True for a cgroup gone or empty)."""
        d = self._dir_with("freezer")
        if d is None:
            return False
        try:
            if self.owner.version == 2:
                return "frozen 1" in (d / "cgroup.events").read_text()
            return (d / "freezer.state").read_text().strip() == "FROZEN"
        except FileNotFoundError:
            return True

    def cpu_ns(self) -> int | None:
        """CPU time (user + system, ns) the command's processes used so far (the dead ones
        too), or None without a CPU accounting controller."""
        d = self._dir_with("cpuacct")
        used = None if d is None else _cpu_usage(d, self.owner.version)
        return None if used is None else self.cpu_before_ns + used

    def limits_hit(self) -> list[str]:
        hit = []
        for d in self.dirs:
            for name, key, what in (
                ("memory.oom_control", "oom_kill", "memory"),
                ("memory.events", "oom_kill", "memory"),
                ("pids.events", "max", "pids"),
            ):
                f = d / name
                if f.exists():
                    for line in f.read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key and v.strip().isdigit() and int(v) > 0 and what not in hit:
                            hit.append(what)
        return hit

    def remove(self) -> None:
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    self.kill_all()
                    time.sleep(0.002)


class Cgroups:
    """Per-command cgroups under ``aospec/`` of the v1 controllers or the v2 hierarchy.

    A command's cgroup nests in its sandbox's, which nests in its store's (session's):
    ``aospec/aospec-S/aospec-S-X/aospec-S-X-N``. The two upper levels carry the memory
    budgets. Why nest: what a command writes into its tmpfs stays charged to its cgroup
    after the command ends and the cgroup is removed, and the kernel then counts those
    pages in the parent; under a limited ancestor they stay inside a budget instead of
    moving to an unlimited parent.

    ``detect()`` returns None when no writable cgroup hierarchy with the needed
    controllers exists (then memory/cpu/pids limits are not enforced; rlimits still are).
    """

    V1 = ("pids", "memory", "cpu", "cpuacct", "freezer")

    def __init__(self, version: int, roots: dict[str, Path], *, freezer: bool = False, cpuacct: bool = False) -> None:
        self.version = version
        self.roots = roots  # controller -> directory holding our per-command cgroups
        self._made: set[str] = set()  # intermediate cgroups this process made (a cache)
        # v1: which controllers each distinct hierarchy carries (co-mounted ones, such as
        # cpu,cpuacct, share one directory); v2: one hierarchy with every controller
        self._hierarchies: list[tuple[frozenset[str], Path]] = []
        for c, root in roots.items():
            for i, (cs, r) in enumerate(self._hierarchies):
                if r == root:
                    self._hierarchies[i] = (cs | {c}, r)
                    break
            else:
                self._hierarchies.append((frozenset({c}), root))
        # v2 freezes (cgroup.freeze) and meters (cpu.stat) in every cgroup, controllers aside
        self.freezer = "freezer" in roots or (version == 2 and freezer)
        self.cpuacct = "cpuacct" in roots or (version == 2 and cpuacct)

    @classmethod
    def detect(cls) -> Cgroups | None:
        base = Path("/sys/fs/cgroup")
        v1 = {c: (base / c).resolve() for c in cls.V1 if (base / c / "cgroup.procs").exists()}
        if v1:
            roots = {}
            for c, d in v1.items():
                try:
                    (d / "aospec").mkdir(exist_ok=True)
                    roots[c] = d / "aospec"
                except OSError:
                    continue
            if set(roots) & {"pids", "memory", "cpu"}:
                return cls(1, roots)
        if (base / "cgroup.controllers").exists():
            try:
                available = (base / "cgroup.controllers").read_text().split()
                wanted = [c for c in ("pids", "memory", "cpu") if c in available]
                if not wanted:
                    return None
                (base / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
                top = base / "aospec"
                top.mkdir(exist_ok=True)
                (top / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
                return cls(
                    2,
                    {c: top for c in wanted},
                    freezer=(top / "cgroup.freeze").exists(),
                    cpuacct=(top / "cpu.stat").exists(),
                )
            except OSError:
                return None
        return None

    @property
    def controllers(self) -> tuple[str, ...]:
        """The controllers in use (``freezer`` and ``cpuacct`` stand for v2's core
        ``cgroup.freeze`` and ``cpu.stat``)."""
        extra = {"freezer"} if self.freezer else set()
        extra |= {"cpuacct"} if self.cpuacct else set()
        return tuple(sorted(set(self.roots) | extra))

    def _hierarchy_roots(self) -> list[tuple[frozenset[str], Path]]:
        """(controllers, our directory) of every distinct hierarchy (one for v2)."""
        if self.version == 2:
            return [(frozenset(self.roots), next(iter(self.roots.values())))]
        return self._hierarchies

    def _dirs(self, rel: str) -> list[tuple[frozenset[str], Path]]:
        """(controllers, directory) of ``rel`` in every distinct hierarchy (one for v2)."""
        return [(cs, root / rel) for cs, root in self._hierarchy_roots()]

    def _pooled(self, cs: frozenset[str]) -> bool:
        """Whether a hierarchy carrying ``cs`` places background commands in the pool."""
        return self.version == 2 or bool(cs & _POOLED_V1)

    def pool_exists(self) -> bool:
        """Whether the host has a speculation pool (:func:`aospec.runtime.set_speculation_budget`)."""
        return any(self._pooled(cs) and (root / POOL).is_dir() for cs, root in self._hierarchy_roots())

    def ensure_group(self, rel: str, memory_bytes: int | None, *, update: bool = False) -> None:
        """Create the intermediate cgroup ``rel`` (its parent must exist) with a memory
        limit; an existing one keeps its limit unless ``update``."""
        if rel in self._made and not update:
            return
        for cs, d in self._dirs(rel):
            try:
                d.mkdir()
                created = True
            except FileExistsError:
                if not update:
                    continue
                created = False
            if self.version == 2:
                wanted = " ".join("+" + c for c in self.roots)
                (d / "cgroup.subtree_control").write_text(wanted)
            # a new cgroup starts unlimited
            if "memory" in cs and not (created and memory_bytes is None):
                _set_memory_limit(d, self.version, memory_bytes)
        self._made.add(rel)

    def create(self, rel: str, limits: Limits, *, pooled: bool = False) -> CommandCgroup:
        """A command's cgroup ``rel`` (its parents must exist) with ``limits``; ``pooled``:
        directly in the speculation pool (``POOL/<name>``) in the hierarchies that have one."""
        dirs: list[Path] = []
        in_pool: list[Path] = []
        name = Path(rel).name
        try:
            for cs, root in self._hierarchy_roots():
                d = root / rel
                pool = root / POOL
                if pooled and self._pooled(cs) and pool.is_dir():
                    d = pool / name
                    in_pool.append(d)
                d.mkdir()
                dirs.append(d)
                _set_limits(d, cs, self.version, _within(limits, pool) if d.parent == pool else limits)
        except BaseException:
            CommandCgroup(self, dirs).remove()
            raise
        cg = CommandCgroup(self, dirs, limits=limits)
        cg.pooled = in_pool
        return cg

    def unpool(self, cg: CommandCgroup, rel: str) -> None:
        """Move a running command out of the speculation pool into its own cgroup ``rel``
        (below its sandbox's, whose parents exist): every process, until none is left
        behind (one forking meanwhile leaves its child in the old cgroup, moved on the next
        pass). A frozen command stays frozen (v2 thaws what moves into an unfrozen cgroup)."""
        if not cg.pooled:
            return
        frozen = self.version == 2 and cg.can_freeze and cg.is_frozen()
        for cs, root in self._hierarchy_roots():
            old = root / POOL / Path(rel).name
            if old not in cg.pooled:
                continue
            new = root / rel
            new.mkdir(exist_ok=True)
            if cg.limits is not None:
                _set_limits(new, cs, self.version, cg.limits)
            if frozen:
                (new / "cgroup.freeze").write_text("1")
            for _ in range(100):
                try:
                    pids = (old / "cgroup.procs").read_text().split()
                except FileNotFoundError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                        (new / "cgroup.procs").write_text(pid)
            if "cpuacct" in cs or self.version == 2:
                cg.cpu_before_ns += _cpu_usage(old, self.version) or 0
            cg.dirs[cg.dirs.index(old)] = new
            cg.moved()
            cg.pooled.remove(old)
            with contextlib.suppress(OSError):
                old.rmdir()

    def set_cpu_priority(self, rel: str, *, background: bool) -> bool:
        """Give the cgroup ``rel`` (and everything below it, running processes included)
        background CPU priority (the least weight and, where the kernel has it, the idle
        class) or the default; False when there is no cpu controller or no such cgroup."""
        if "cpu" not in self.roots:
            return False
        d = self.roots["cpu"] / rel
        if not d.is_dir():
            return False
        if self.version == 2:
            weight, name = ("1" if background else "100"), "cpu.weight"
        else:
            weight, name = ("2" if background else "1024"), "cpu.shares"
        idle = d / "cpu.idle"
        # an idle group refuses a weight: leave idle before setting one, enter it after
        # (an idle group set to the background again is left as it is)
        try:
            if background and idle.exists() and idle.read_text().strip() == "1":
                return True
            if not background and idle.exists():
                idle.write_text("0")
            (d / name).write_text(weight)
            if background and idle.exists():
                with contextlib.suppress(OSError):
                    idle.write_text("1")
        except FileNotFoundError:
            return False
        return True

    def memory_usage(self, rel: str) -> int | None:
        """Bytes charged to ``rel`` and everything below it (None: no memory controller)."""
        if "memory" not in self.roots:
            return None
        d = self.roots["memory"] / rel
        try:
            return int((d / ("memory.current" if self.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None

    def remove(self, rel: str) -> list[str]:
        """Kill every process in ``rel`` and below, and remove the cgroups (deepest
        first); returns the removed directories."""
        self._made = {m for m in self._made if m != rel and not m.startswith(rel + "/")}
        removed: list[str] = []
        for _, d in self._dirs(rel):
            _remove_tree(self, d, removed)
        return removed

    def remove_stale(self, prefix: str, *, under: str = "") -> list[str]:
        """Kill and remove leftover cgroups (and all below them) whose name starts with
        ``prefix``, directly under ``under`` (a cgroup path relative to the roots)."""
        self._made.clear()
        removed: list[str] = []
        for root in set(self.roots.values()):
            for d in (root / under).glob(prefix + "*") if (root / under).is_dir() else ():
                if d.is_dir():
                    _remove_tree(self, d, removed)
        return removed


def _set_limits(d: Path, cs: frozenset[str], version: int, limits: Limits) -> None:
    """Write a command's limits into its new cgroup ``d`` (of a hierarchy carrying ``cs``)."""
    if "pids" in cs and limits.pids is not None:
        (d / "pids.max").write_text(str(limits.pids))
    if "memory" in cs and limits.memory_bytes is not None:
        _set_memory_limit(d, version, limits.memory_bytes)
    if "cpu" in cs and limits.cpus is not None:
        _set_cpu_quota(d, version, limits.cpus)


def _cpu_usage(d: Path, version: int) -> int | None:
    """CPU time (ns) of cgroup ``d`` and below: v1 cpuacct.usage, v2 cpu.stat's usage_usec."""
    try:
        if version == 1:
            # one open and read: sampled every 20 ms while a command runs beside guesses
            fd = os.open(f"{d}/cpuacct.usage", os.O_RDONLY | os.O_CLOEXEC)
            try:
                return int(os.read(fd, 64))
            finally:
                os.close(fd)
        for line in (d / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) * 1000
    except (OSError, ValueError, IndexError):
        return None
    return None


def _within(limits: Limits, pool: Path) -> Limits:
    """``limits`` with the CPU quota no larger than the pool's: v1 refuses a child's quota
    above its parent's (v2 takes the smaller one by itself)."""
    try:
        quota = int((pool / "cpu.cfs_quota_us").read_text())
    except (OSError, ValueError):
        return limits
    if quota < 0 or limits.cpus is None or limits.cpus * 100000 <= quota:
        return limits
    return dataclasses.replace(limits, cpus=quota / 100000)


def clamp_cpu_quotas(pool: Path, cores: float | None) -> None:
    """v1: lower the CPU quota of every cgroup in ``pool`` to at most ``cores`` (the pool's
    own quota cannot go below its children's)."""
    if cores is None:
        return
    for child in pool.iterdir():
        f = child / "cpu.cfs_quota_us"
        with contextlib.suppress(OSError, ValueError):
            quota = int(f.read_text())
            if quota < 0 or quota > cores * 100000:
                f.write_text(str(int(cores * 100000)))


def _set_cpu_quota(d: Path, version: int, cores: float | None) -> None:
    if version == 2:
        (d / "cpu.max").write_text("max 100000" if cores is None else f"{int(cores * 100000)} 100000")
    else:
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("-1" if cores is None else str(int(cores * 100000)))


def _thaw_dir(d: Path) -> None:
    """Thaw the cgroup directory ``d`` if it can be frozen (v1 freezer or v2)."""
    for name, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        with contextlib.suppress(FileNotFoundError, PermissionError, ProcessLookupError):
            (d / name).write_text(value)
            return


def thaw_process(pid: int) -> None:
    """Thaw the cgroup(s) ``pid`` is frozen in (v1 freezer and v2), so that a SIGKILL sent
    to it takes effect (a v1 frozen process dies only once thawed). Best effort."""
    base = Path("/sys/fs/cgroup")
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if "freezer" in controllers.split(","):
            _thaw_dir(base / "freezer" / rel)
        elif controllers == "":
            for top in (base, base / "unified"):
                if (top / "cgroup.controllers").exists() and rel:
                    _thaw_dir(top / rel)


def _set_memory_limit(d: Path, version: int, value: int | None) -> None:
    if version == 2:
        (d / "memory.max").write_text("max" if value is None else str(value))
        with contextlib.suppress(OSError):
            (d / "memory.swap.max").write_text("0")
        return
    text = "-1" if value is None else str(value)
    # the memory+swap limit may never be below the memory limit: raise it first when growing
    try:
        (d / "memory.limit_in_bytes").write_text(text)
        with contextlib.suppress(FileNotFoundError):
            (d / "memory.memsw.limit_in_bytes").write_text(text)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        (d / "memory.memsw.limit_in_bytes").write_text(text)
        (d / "memory.limit_in_bytes").write_text(text)


def _remove_tree(owner: Cgroups, d: Path, removed: list[str]) -> None:
    try:
        with os.scandir(d) as it:
            children = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    for child in children:
        _remove_tree(owner, child, removed)
    # remove() kills (and thaws) what is still inside only when the cgroup is busy: an
    # empty one, the usual case, costs one rmdir
    CommandCgroup(owner, [d]).remove()
    removed.append(str(d))
