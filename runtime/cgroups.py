"""Cgroups of sandbox commands: a command's cgroup nests in its sandbox's, which nests in
its store's (session's), under ``aospec/`` of the v1 controllers or the v2 hierarchy."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

from aospec.runtime.config import Limits

__all__ = ["Cgroups", "CommandCgroup"]


class CommandCgroup:
    """One command's cgroup (all controllers)."""

    def __init__(self, owner: Cgroups, dirs: list[Path]) -> None:
        self.owner = owner
        self.dirs = dirs

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
        if self.owner.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs[0] / "cgroup.kill").write_text("1")
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

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

    V1 = ("pids", "memory", "cpu")

    def __init__(self, version: int, roots: dict[str, Path]) -> None:
        self.version = version
        self.roots = roots  # controller -> directory holding our per-command cgroups
        self._made: set[str] = set()  # intermediate cgroups this process made (a cache)

    @classmethod
    def detect(cls) -> Cgroups | None:
        base = Path("/sys/fs/cgroup")
        v1 = {c: base / c for c in cls.V1 if (base / c / "cgroup.procs").exists()}
        if v1:
            roots = {}
            for c, d in v1.items():
                try:
                    (d / "aospec").mkdir(exist_ok=True)
                    roots[c] = d / "aospec"
                except OSError:
                    continue
            if roots:
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
                return cls(2, {c: top for c in wanted})
            except OSError:
                return None
        return None

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(sorted(self.roots))

    def _dirs(self, rel: str) -> list[tuple[str, Path]]:
        """(controller, directory) of ``rel`` in every hierarchy (one for v2)."""
        if self.version == 2:
            return [("*", next(iter(self.roots.values())) / rel)]
        return [(c, root / rel) for c, root in self.roots.items()]

    def ensure_group(self, rel: str, memory_bytes: int | None, *, update: bool = False) -> None:
        """Create the intermediate cgroup ``rel`` (its parent must exist) with a memory
        limit; an existing one keeps its limit unless ``update``."""
        if rel in self._made and not update:
            return
        for c, d in self._dirs(rel):
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
            if c in ("memory", "*") and "memory" in self.roots and not (created and memory_bytes is None):
                _set_memory_limit(d, self.version, memory_bytes)
        self._made.add(rel)

    def create(self, rel: str, limits: Limits) -> CommandCgroup:
        """A command's cgroup ``rel`` (its parents must exist) with ``limits``."""
        dirs = []
        try:
            for c, d in self._dirs(rel):
                d.mkdir()
                dirs.append(d)
                if c in ("pids", "*") and "pids" in self.roots and limits.pids is not None:
                    (d / "pids.max").write_text(str(limits.pids))
                if c in ("memory", "*") and "memory" in self.roots and limits.memory_bytes is not None:
                    _set_memory_limit(d, self.version, limits.memory_bytes)
                if c in ("cpu", "*") and "cpu" in self.roots and limits.cpus is not None:
                    if self.version == 2:
                        (d / "cpu.max").write_text(f"{int(limits.cpus * 100000)} 100000")
                    else:
                        (d / "cpu.cfs_period_us").write_text("100000")
                        (d / "cpu.cfs_quota_us").write_text(str(int(limits.cpus * 100000)))
        except BaseException:
            CommandCgroup(self, dirs).remove()
            raise
        return CommandCgroup(self, dirs)

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
        try:
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
    cg = CommandCgroup(owner, [d])
    cg.kill_all()
    cg.remove()
    removed.append(str(d))
