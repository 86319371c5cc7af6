"""Running one command isolated: bubblewrap namespaces, rlimits, cgroups, timeouts.

A command runs as ``bwrap ... -- /bin/bash -c CMD`` with the sandbox's merged overlay as
``/``: every namespace unshared (no network unless asked), capabilities dropped, no
further user namespaces, a new session, ``/proc`` of its own PID namespace and a minimal
``/dev``; no host path is visible unless bound explicitly. bwrap is started blocked
(``--block-fd``): before the command starts we apply rlimits to the sandbox's init with
prlimit and move it into a fresh cgroup, so every process of the command inherits both.
On timeout or cancellation we SIGKILL the PID namespace's init, which makes the kernel
kill the whole namespace: no process of the command survives it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio
import xxhash

from aospec.errors import SandboxError, SandboxUnavailableError
from runtime.config import Bind, Limits
from runtime.observation import TIMEOUT_RETURNCODE, CommandResult
from runtime.seccomp import program_fd

__all__ = [
    "MARKER_ENV",
    "OWNER_ENV",
    "Cgroups",
    "HostSupport",
    "bwrap_argv",
    "check_binds",
    "host_support",
    "kill_marked",
    "live_owner_tokens",
    "marked_processes",
    "missing_bind_points",
    "owner_token",
    "process_environments",
    "process_identity",
    "reached_file_size",
    "remove_bind_points",
    "run_bwrap",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

T = TypeVar("T")


class _Cgroup:
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

    def create(self, rel: str, limits: Limits) -> _Cgroup:
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
            _Cgroup(self, dirs).remove()
            raise
        return _Cgroup(self, dirs)

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
    cg = _Cgroup(owner, [d])
    cg.kill_all()
    cg.remove()
    removed.append(str(d))


@dataclass(frozen=True, slots=True)
class HostSupport:
    """What this host can do for the overlay backend (``aospec sandbox info``)."""

    root: bool
    overlayfs: bool
    bwrap: str | None
    cgroup_version: int | None
    cgroup_controllers: tuple[str, ...]
    can_mount: bool = True

    def problems(self) -> list[str]:
        out = []
        if not self.root:
            out.append("the overlay backend needs root (mounting overlayfs); run as root or use --backend docker")
        elif not self.can_mount:
            out.append("mounting is not permitted here (an unprivileged container?); run with CAP_SYS_ADMIN")
        if not self.overlayfs:
            out.append("the kernel has no overlayfs (modprobe overlay)")
        if not self.bwrap:
            out.append("bubblewrap is not installed (apt-get install bubblewrap)")
        return out

    def unenforced(self, limits: Limits, memory_budget_bytes: int | None = None) -> list[str]:
        """The limits (and the session memory budget) this host cannot enforce."""
        missing = []
        have = set(self.cgroup_controllers)
        if memory_budget_bytes is not None and "memory" not in have:
            missing.append("memory budget (no writable memory cgroup: host memory held by sandboxes is not bounded)")
        if limits.pids is not None and "pids" not in have:
            missing.append("pids")
        if limits.memory_bytes is not None and "memory" not in have:
            missing.append("memory (RLIMIT_AS used instead)")
        if limits.cpus is not None and "cpu" not in have:
            missing.append("cpus")
        return missing


def _can_mount() -> bool:
    import tempfile

    from runtime import _fs

    d = tempfile.mkdtemp(prefix="aospec-probe-")
    try:
        _fs.mount("tmpfs", d, "tmpfs", 0, "size=64k")
    except OSError:
        return False
    else:
        _fs.umount(d)
        return True
    finally:
        os.rmdir(d)


_support: HostSupport | None = None
_cgroups: Cgroups | None = None
_support_lock = threading.Lock()


def host_support() -> tuple[HostSupport, Cgroups | None]:
    """Probe the host once per process."""
    global _support, _cgroups
    with _support_lock:
        if _support is None:
            with open("/proc/filesystems") as f:
                overlay = any(line.split()[-1] == "overlay" for line in f if line.strip())
            is_root = os.geteuid() == 0
            cg = Cgroups.detect() if is_root else None
            bwrap = shutil.which("bwrap")
            _cgroups = cg
            _support = HostSupport(
                root=is_root,
                overlayfs=overlay,
                bwrap=bwrap,
                cgroup_version=cg.version if cg else None,
                cgroup_controllers=cg.controllers if cg else (),
                can_mount=is_root and _can_mount(),
            )
        return _support, _cgroups


def bwrap_argv(
    root: str,
    command: str,
    *,
    shell: str,
    cwd: str,
    env: Mapping[str, str],
    network: bool,
    binds: Sequence[Bind],
    cap_add: Sequence[str],
    info_fd: int,
    block_fd: int,
) -> list[str]:
    """The bubblewrap command line running ``command`` with ``root`` as ``/`` (bwrap must
    be started in ``root``)."""
    argv = [
        "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    for cap in cap_add:
        argv += ["--cap-add", cap]
    if network:
        argv.append("--share-net")
    # the root is bound relative to bwrap's working directory (``root``): the sandbox can
    # read bwrap's command line as /proc/1/cmdline, and host paths have no business there
    argv += ["--hostname", "sandbox", "--bind", ".", "/", "--proc", "/proc", *_PROC_MASKS, "--dev", "/dev"]
    if network and os.path.exists("/etc/resolv.conf") and os.path.lexists(os.path.join(root, "etc/resolv.conf")):
        argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for b in binds:
        argv += ["--bind" if b.writable else "--ro-bind", b.source, b.target]
    argv += ["--chdir", cwd, "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    argv += ["--info-fd", str(info_fd), "--block-fd", str(block_fd), "--", shell, "-c", command]
    return argv


def check_binds(binds: Sequence[Bind]) -> None:
    """SandboxError naming the first bind whose host source does not exist."""
    for b in binds:
        if not os.path.exists(b.source):
            raise SandboxError(
                f"bind {b.source}:{b.target}: the source {b.source} does not exist on the host; "
                "create it or remove the bind"
            )


def _walk_nofollow(root: str, parts: Sequence[str]) -> tuple[int, int]:
    """Open the directories ``parts`` below ``root`` without following symlinks; returns
    (fd of the deepest one reached, how many of ``parts`` were opened). Close the fd."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    for i, name in enumerate(parts):
        try:
            nxt = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return fd, i
        os.close(fd)
        fd = nxt
    return fd, len(parts)


def missing_bind_points(root: str, binds: Sequence[Bind]) -> list[tuple[str, ...]]:
    """The mount points bubblewrap will create in ``root`` for ``binds`` (each missing
    target and its missing parents, outermost first), as path components."""
    points: list[tuple[str, ...]] = []
    for b in binds:
        parts = [p for p in b.target.split("/") if p and p != "."]
        if ".." in parts or not parts:
            continue
        fd, depth = _walk_nofollow(root, parts[:-1])
        try:
            if depth < len(parts) - 1:
                try:
                    os.stat(parts[depth], dir_fd=fd, follow_symlinks=False)
                    continue  # a non-directory (or symlink) in the way: bwrap resolves it, not ours
                except FileNotFoundError:
                    pass
            else:
                try:
                    os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                    continue  # the target exists
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)
        for k in range(depth + 1, len(parts) + 1):
            if tuple(parts[:k]) not in points:
                points.append(tuple(parts[:k]))
    return points


def remove_bind_points(root: str, points: Sequence[tuple[str, ...]]) -> None:
    """Remove the mount points :func:`missing_bind_points` listed, innermost first, where
    they are still an empty directory or an empty file (a bind is not part of the
    sandbox's state; what the command put beside them stays)."""
    for parts in sorted(points, key=len, reverse=True):
        fd, depth = _walk_nofollow(root, parts[:-1])
        try:
            if depth < len(parts) - 1:
                continue
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(parts[-1], dir_fd=fd)
                elif stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    os.unlink(parts[-1], dir_fd=fd)
            except OSError:
                pass  # gone, or not empty: the command's own doing
        finally:
            os.close(fd)


def reached_file_size(upper: str, paths: Iterator[bytes], limit: int | None) -> bool:
    """Whether a regular file among ``paths`` (relative to ``upper``) reached ``limit``
    bytes: writes past RLIMIT_FSIZE fail (EFBIG, or SIGXFSZ that a shell survives), so a
    file at the limit is the trace a command that ran into it leaves."""
    if limit is None:
        return False
    base = os.fsencode(upper)
    for rel in paths:
        try:
            st = os.lstat(base + b"/" + rel)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size >= limit:
            return True
    return False


def _proc_masks() -> list[str]:
    """Keep host-global parts of /proc out of reach, as Docker does: the sandbox's uid 0 is
    the host's uid 0 (bubblewrap maps it so), which would let it write host sysctls."""
    args = []
    for p in ("sys", "sysrq-trigger", "irq", "bus", "fs", "mtrr"):
        if os.path.lexists(f"/proc/{p}"):
            args += ["--ro-bind", f"/proc/{p}", f"/proc/{p}"]
    for p in ("kcore", "keys", "timer_list", "sched_debug", "latency_stats", "kallsyms"):
        if os.path.lexists(f"/proc/{p}"):
            args += ["--ro-bind", "/dev/null", f"/proc/{p}"]
    return args


_PROC_MASKS = _proc_masks()

_RLIMITS = (
    ("file_size_bytes", resource.RLIMIT_FSIZE),
    ("open_files", resource.RLIMIT_NOFILE),
    ("cpu_time_s", resource.RLIMIT_CPU),
)


class _Output:
    """Collects output up to ``cap`` bytes, keeping the head and the tail beyond it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            half = self.cap // 2
            if len(self.tail) > half:
                self.dropped += len(self.tail) - half
                del self.tail[: len(self.tail) - half]

    def text(self) -> tuple[str, bool]:
        if not self.dropped and not self.tail:
            return self.head.decode("utf-8", "replace"), False
        if not self.dropped:
            return (self.head + self.tail).decode("utf-8", "replace"), False
        keep = self.head[: self.cap // 2]
        dropped = self.dropped + len(self.head) - len(keep)
        return (
            keep.decode("utf-8", "replace")
            + f"\n[... {dropped} bytes of output dropped ...]\n"
            + self.tail.decode("utf-8", "replace"),
            True,
        )


@dataclass(slots=True)
class _Started:
    """A bwrap process and what it takes to kill and reap everything it started."""

    proc: subprocess.Popen[bytes]
    outer_pidfd: int  # bwrap itself: readable when it exited
    init_pidfd: int = -1  # the PID namespace's init: killing it kills the whole command
    cg: _Cgroup | None = None


MARKER_ENV = "AOSPEC_SANDBOX"
OWNER_ENV = "AOSPEC_OWNER"


def process_identity(pid: int) -> str:
    """``PID:START_TIME`` of a process (unique even when PIDs are reused), or ""."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{pid}:{stat_line.rpartition(')')[2].split()[19]}"


def owner_token(identity: str) -> str:
    """What ``AOSPEC_OWNER`` holds: a hash of the owner's :func:`process_identity`, so
    that a sandbox reading it learns nothing of the host (not the owner's pid)."""
    return xxhash.xxh3_64_hexdigest(identity.encode())


def live_owner_tokens() -> set[str]:
    """The :func:`owner_token` of every running process."""
    return {owner_token(i) for pid in os.listdir("/proc") if pid.isdigit() and (i := process_identity(int(pid)))}


_owner: tuple[int, str] = (0, "")


def _owner_identity() -> str:
    global _owner
    if _owner[0] != os.getpid():
        _owner = (os.getpid(), owner_token(process_identity(os.getpid())))
    return _owner[1]


def process_environments() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment items) of every process whose environment can be read."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        yield int(pid), env.split(b"\0")


def marked_processes(prefix: str, *, exact: bool = False) -> list[int]:
    """Processes whose environment marks them as sandbox processes of ``prefix`` (orphans
    too); ``exact``: the marker of one run only."""
    needle = f"{MARKER_ENV}={prefix}".encode()
    return [
        pid
        for pid, env in process_environments()
        if any(item == needle if exact else item.startswith(needle) for item in env)
    ]


def kill_marked(prefix: str, *, exact: bool = False) -> list[int]:
    """SIGKILL every process :func:`marked_processes` finds (bwrap processes orphaned when
    their session was killed mid-setup)."""
    killed = []
    for pid in marked_processes(prefix, exact=exact):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def _release(
    st: _Started, child: int, limits: Limits, cgroup_name: str, cgroup_parents: Sequence[tuple[str, int | None]]
) -> None:
    """Put the blocked sandbox init in its cgroup (below ``cgroup_parents``, outermost
    first: name and memory budget, created when missing) with its rlimits. cgroupfs and
    prlimit are in-memory and take microseconds: done inline, without a thread hop."""
    _, cgroups = host_support()
    try:
        if cgroups is not None:
            try:
                for attempt in range(2):
                    try:
                        rel = ""
                        for name, budget in cgroup_parents:
                            rel += name + "/"
                            cgroups.ensure_group(rel.rstrip("/"), budget)
                        st.cg = cgroups.create(rel + cgroup_name, limits)
                        break
                    except FileNotFoundError:
                        if attempt:
                            raise
                        cgroups._made.clear()  # a parent was removed (gc): make it again
                st.cg.add(child)
            except ProcessLookupError:
                raise
            except OSError as exc:
                raise SandboxError(f"cannot put the command in a cgroup ({exc}); see aospec sandbox info") from None
        for field, res in _RLIMITS:
            value = getattr(limits, field)
            if value is not None:
                resource.prlimit(child, res, (value, value))
        if limits.memory_bytes is not None and (cgroups is None or "memory" not in cgroups.roots):
            resource.prlimit(child, resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    except ProcessLookupError:
        pass


async def _read_info(fd: int) -> dict | None:
    buf = b""
    while True:
        await anyio.wait_readable(fd)
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buf += chunk
        try:
            return json.loads(buf)
        except json.JSONDecodeError:
            continue


async def run_bwrap(
    argv_for: Callable[[int, int], list[str]],
    *,
    cwd: str,
    timeout_s: float,
    limits: Limits,
    cgroup_name: str,
    max_output_bytes: int,
    before: Callable[[], None],
    after: Callable[[], T],
    cgroup_parents: Sequence[tuple[str, int | None]] = (),
    seccomp: bytes | None = None,
) -> tuple[CommandResult, T]:
    """Run ``argv_for(info_fd, block_fd)`` (a bwrap command line, started in ``cwd``)
    to completion: ``before()`` first and ``after()`` last, both in worker threads;
    ``after`` runs also when the command fails or is cancelled. Returns the result and
    what ``after`` returned. The command's cgroup ``cgroup_name`` nests in
    ``cgroup_parents`` (see :meth:`Cgroups.ensure_group`); ``seccomp`` is a compiled
    filter (:func:`runtime.seccomp.filter_program`) bwrap loads before the command.

    bwrap is spawned from the event loop's thread on purpose: ``--die-with-parent``
    ties the sandbox's life to the *thread* that spawned it, and a worker thread may
    exit (idle) while a long command runs. Cancel-safe: when the caller's scope is
    cancelled the whole PID namespace is killed and reaped before ``after`` runs and
    the cancellation propagates.
    """
    out = _Output(max_output_bytes)
    started_at = time.perf_counter()
    timed_out = False
    limits_hit: list[str] = []
    st: _Started | None = None
    info_r = info_w = block_r = block_w = seccomp_r = -1
    try:
        await anyio.to_thread.run_sync(before)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        block_r, block_w = os.pipe2(os.O_CLOEXEC)
        argv = argv_for(info_w, block_r)
        if seccomp is not None:
            seccomp_r = program_fd(seccomp)
            argv[argv.index("--") : argv.index("--")] = ["--seccomp", str(seccomp_r)]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # the markers let recovery and gc find this run's processes, even orphans
                # (the sandbox can read them in /proc/1/environ: no host paths in them)
                env={"PATH": DEFAULT_PATH, MARKER_ENV: cgroup_name, OWNER_ENV: _owner_identity()},
                pass_fds=tuple(fd for fd in (info_w, block_r, seccomp_r) if fd >= 0),
                cwd=cwd,
                umask=0o022,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SandboxUnavailableError("bubblewrap is not installed (apt-get install bubblewrap)") from None
        st = _Started(proc, os.pidfd_open(proc.pid))
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        for fd in (info_w, block_r, seccomp_r):
            if fd >= 0:
                os.close(fd)
        info_w = block_r = seccomp_r = -1
        info = await _read_info(info_r)
        if info is None:
            # bwrap failed before starting the command; its message is the output
            await _drain(proc.stdout.fileno(), out)
            raise SandboxError(f"bwrap could not start the command: {out.text()[0].strip()}")
        child = int(info["child-pid"])
        st.init_pidfd = os.pidfd_open(child)
        _release(st, child, limits, cgroup_name, cgroup_parents)
        os.write(block_w, b"1")
        with anyio.move_on_after(timeout_s) as scope:
            await _drain(proc.stdout.fileno(), out)
            await anyio.wait_readable(st.outer_pidfd)
        if scope.cancelled_caught:
            timed_out = True
            limits_hit.append("timeout")
            _kill_tree(st.init_pidfd, st.cg)
            with anyio.move_on_after(10):
                await _drain(proc.stdout.fileno(), out)
                await anyio.wait_readable(st.outer_pidfd)
    finally:
        # normal exit, failure or cancellation alike: kill and reap the whole namespace
        # before anything reads the sandbox's filesystem, then clean up and run ``after``.
        # The pipes close last: bwrap dies of SIGPIPE writing to a closed info pipe, and
        # a bwrap dying while setting up leaves its child blocked forever.
        with anyio.CancelScope(shield=True):
            if st is not None:
                await _reap(st, cgroup_name)
            for fd in (info_r, info_w, block_r, block_w, seccomp_r):
                if fd >= 0:
                    os.close(fd)
            hits, value = await anyio.to_thread.run_sync(_cleanup, st, after)
    for what in hits:
        if what not in limits_hit:
            limits_hit.append(what)
    text, truncated = out.text()
    rc = st.proc.returncode if st.proc.returncode is not None else -1
    if timed_out:
        rc = TIMEOUT_RETURNCODE
    if rc == 128 + signal.SIGXFSZ:
        limits_hit.append("file_size")
    result = CommandResult(
        returncode=rc,
        output=text,
        timed_out=timed_out,
        duration_s=time.perf_counter() - started_at,
        limits_hit=tuple(limits_hit),
        truncated=truncated,
    )
    return result, value


async def _reap(st: _Started, marker: str) -> None:
    """Kill (if still running) and reap bwrap and everything in its PID namespace."""
    if st.init_pidfd < 0:
        # stopped before bwrap said who its child is (cancelled, or bwrap failed): find
        # this run's processes by their marker until none is left
        for _ in range(500):
            if not kill_marked(marker, exact=True) and st.proc.poll() is not None:
                break
            await anyio.sleep(0.002)
    elif st.proc.poll() is None:
        _kill_tree(st.init_pidfd, st.cg)
    if st.proc.poll() is None:
        with anyio.move_on_after(10):
            await anyio.wait_readable(st.outer_pidfd)
        if st.proc.poll() is None:
            st.proc.kill()
    st.proc.wait()
    if st.init_pidfd >= 0:
        # the namespace's init exits only after every process in it is gone
        with anyio.move_on_after(10):
            await anyio.wait_readable(st.init_pidfd)


def _cleanup(st: _Started | None, after: Callable[[], T]) -> tuple[list[str], T]:
    hits: list[str] = []
    if st is not None:
        if st.proc.stdout is not None:
            st.proc.stdout.close()
        for fd in (st.outer_pidfd, st.init_pidfd):
            if fd >= 0:
                os.close(fd)
        if st.cg is not None:
            hits = st.cg.limits_hit()
            st.cg.remove()
    return hits, after()


def _kill_tree(pidfd: int, cg: _Cgroup | None) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if cg is not None:
        cg.kill_all()


async def _drain(fd: int, out: _Output) -> None:
    """Read a non-blocking pipe until EOF."""
    while True:
        await anyio.wait_readable(fd)
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            continue
        if not chunk:
            return
        out.add(chunk)
