"""Running one command isolated: bubblewrap namespaces, rlimits, its cgroup, timeouts.

The cgroups live in ``aospec.runtime.cgroups``, the host probe in ``aospec.runtime.host``, the process
markers in ``aospec.runtime.processes``.

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
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import anyio
from anyio.lowlevel import RunVar
from aospec.runtime import _fs
from aospec.runtime.cgroups import CommandCgroup
from aospec.runtime.config import Bind, Limits
from aospec.runtime.host import host_support
from aospec.runtime.observation import TIMEOUT_RETURNCODE, CommandResult, OutputBuffer
from aospec.runtime.pausing import CommandPause
from aospec.runtime.processes import MARKER_ENV, OWNER_ENV, kill_marked, own_owner_token, set_process_priority
from aospec.runtime.seccomp import program_fd

from aospec.errors import SandboxError, SandboxUnavailableError

if TYPE_CHECKING:
    from aospec.runtime.readsets import CommandTrace, EbpfCommandTrace

__all__ = [
    "DEFAULT_PATH",
    "CommandPriority",
    "bwrap_argv",
    "check_binds",
    "missing_bind_points",
    "reached_file_size",
    "remove_bind_points",
    "run_bwrap",
    "scrub_binds",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

T = TypeVar("T")


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


_SETID = stat.S_ISUID | stat.S_ISGID
_CAPABILITY_XATTR = "security.capability"


def scrub_binds(binds: Sequence[Bind], since_ns: int) -> list[str]:
    """After a command (its processes gone): give what it created or changed on each
    writable bind whose host source is not root's to the source's owner, and take from
    it whatever could carry privilege (set-ID bits of non-directories, file
    capabilities, device nodes; none can appear with the seccomp bind rules in place,
    this is the second line). Entries whose inode did not change since ``since_ns`` are
    left alone, and so is a bind owned by root (a root-owned file there is one root
    could have made; the filter alone keeps privilege off it). Never follows a symlink
    or crosses into another mount. Returns what was changed, for the record."""
    fixed: list[str] = []
    for b in binds:
        if not b.writable:
            continue
        try:
            top = os.lstat(b.source)
        except OSError:
            continue
        if top.st_uid == 0:
            continue
        owner = (top.st_uid, top.st_gid)
        if stat.S_ISDIR(top.st_mode):
            fd = os.open(b.source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                for step in _fs.walk_tree(fd):
                    if step.depth and step.st.st_dev != top.st_dev:
                        step.entries[:] = []  # a mount below the bind: not ours to touch
                        continue
                    for entry in step.entries:
                        with contextlib.suppress(FileNotFoundError):
                            st = entry.stat(follow_symlinks=False)
                            if st.st_dev != top.st_dev:
                                continue
                            if st.st_ctime_ns >= since_ns:
                                rel = os.path.join(os.fsdecode(step.rel), entry.name)
                                if _scrub_entry(step.fd, os.fsencode(entry.name), st, owner):
                                    fixed.append(os.path.join(b.source, rel))
                    step.entries[:] = [e for e in step.entries if e.is_dir(follow_symlinks=False)]
            finally:
                os.close(fd)
        elif top.st_ctime_ns >= since_ns:
            parent, name = os.path.split(os.path.abspath(b.source))
            pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if _scrub_entry(pfd, os.fsencode(name), top, owner):
                    fixed.append(b.source)
            finally:
                os.close(pfd)
    return fixed


def _scrub_entry(dir_fd: int, name: bytes, st: os.stat_result, owner: tuple[int, int]) -> bool:
    """Fix one entry of a bind (see :func:`scrub_binds`); whether anything changed."""
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return True
    changed = False
    if st.st_uid == 0 or st.st_gid == 0:
        uid = owner[0] if st.st_uid == 0 else st.st_uid
        gid = owner[1] if st.st_gid == 0 else st.st_gid
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)  # clears set-ID bits and capabilities
        changed = True
    if stat.S_ISLNK(st.st_mode):
        return changed
    # chmod and xattrs through an O_PATH descriptor of the entry itself: a name could be
    # swapped for a symlink in between, and neither call can refuse to follow one
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return changed
        proc = f"/proc/self/fd/{fd}"
        if not stat.S_ISDIR(now.st_mode) and now.st_mode & _SETID:
            os.chmod(proc, stat.S_IMODE(now.st_mode) & ~_SETID)
            changed = True
        try:
            os.removexattr(proc, _CAPABILITY_XATTR)
            changed = True
        except OSError as exc:
            if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
    finally:
        os.close(fd)
    return changed


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


@dataclass(slots=True)
class _Started:
    """A bwrap process and what it takes to kill and reap everything it started."""

    proc: subprocess.Popen[bytes]
    outer_pidfd: int  # bwrap itself: readable when it exited
    init_pidfd: int = -1  # the PID namespace's init: killing it kills the whole command
    cg: CommandCgroup | None = None
    child_pid: int = -1
    cg_rel: str = ""  # where the command's cgroup belongs (outside the speculation pool)
    tracer_pid: int = -1  # strace, when the command's reads are traced (outside the cgroup)


class CommandPriority:
    """The CPU and IO priority of one sandbox's commands, settable while one runs.

    Background: the sandbox's cgroup gets the least CPU weight (and the idle class where
    the kernel has ``cpu.idle``), and the command's processes SCHED_IDLE and the idle IO
    class (set on the blocked init, so every process of the command inherits them); where
    the host has a speculation budget, a background command's cgroup is in its pool
    (``aospec.runtime.budget``). :meth:`set` applies a change at once, to the processes
    already running too (a command raised to the foreground leaves the pool)."""

    def __init__(self, *, background: bool = False) -> None:
        self.background = background
        self._group: str | None = None  # the sandbox's cgroup, once a command created it
        self._group_background = False  # what that cgroup is set to
        self._running: list[_Started] = []
        self._waiting: set[anyio.CancelScope] = set()  # waits for a background thread's turn

    def set(self, *, background: bool) -> None:
        if background == self.background:
            return
        self.background = background
        if not background:
            for scope in list(self._waiting):
                scope.cancel()
        self._apply_group()
        for st in list(self._running):
            _set_tree_priority(st, background=background)
            if not background and st.cg is not None and st.cg.pooled:
                _, cgroups = host_support()
                if cgroups is not None:
                    with contextlib.suppress(OSError):
                        cgroups.unpool(st.cg, st.cg_rel)

    def _apply_group(self) -> None:
        if self._group is None or self._group_background == self.background:
            return
        _, cgroups = host_support()
        if cgroups is not None:
            with contextlib.suppress(OSError):
                cgroups.set_cpu_priority(self._group, background=self.background)
                self._group_background = self.background

    def _started(self, st: _Started, child: int, group: str | None) -> None:
        """A command's init is blocked in its cgroup: give it (and its cgroup) the priority."""
        if group is not None and group != self._group:
            self._group, self._group_background = group, False
        self._apply_group()
        if self.background:
            set_process_priority(child, background=True)
            if st.tracer_pid > 0:
                set_process_priority(st.tracer_pid, background=True)
        self._running.append(st)

    def _stopped(self, st: _Started) -> None:
        with contextlib.suppress(ValueError):
            self._running.remove(st)


_background_lock: RunVar[anyio.Lock] = RunVar("aospec_background_threads")


async def _in_thread(priority: CommandPriority | None, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread. A background command's work in this process
    (mounting, reading what the command changed) goes through one thread at a time per
    event loop: many such threads would take the GIL and the CPU from the foreground
    command's. A sandbox raised to the foreground stops waiting for its turn at once."""
    if priority is None or not priority.background:
        return await anyio.to_thread.run_sync(fn, *args)
    try:
        lock = _background_lock.get()
    except LookupError:
        lock = anyio.Lock()
        _background_lock.set(lock)
    acquired = False
    with anyio.CancelScope() as scope:
        priority._waiting.add(scope)
        try:
            await lock.acquire()
            acquired = True
        finally:
            priority._waiting.discard(scope)
    try:
        return await anyio.to_thread.run_sync(fn, *args)
    finally:
        if acquired:
            lock.release()


def _tree(pid: int) -> set[int]:
    """``pid`` and its descendants, from /proc's children lists."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in found:
            continue
        found.add(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            with contextlib.suppress(OSError), open(f"/proc/{p}/task/{t}/children") as f:
                todo.extend(int(x) for x in f.read().split())
    return found


def _set_tree_priority(st: _Started, *, background: bool) -> None:
    """Set the priority of every process of a running command, until a pass finds no new
    one (a process forked by one not yet set inherits the old priority)."""
    if st.child_pid < 0:
        return
    if st.tracer_pid > 0:
        set_process_priority(st.tracer_pid, background=background)
    done: set[int] = set()
    for _ in range(10):
        in_cgroup = st.cg.pids() if st.cg is not None else set()
        pids = (in_cgroup or _tree(st.child_pid)) - done
        if not pids:
            return
        for pid in pids:
            set_process_priority(pid, background=background)
        done |= pids


def _release(
    st: _Started,
    child: int,
    limits: Limits,
    cgroup_name: str,
    cgroup_parents: Sequence[tuple[str, int | None]],
    priority: CommandPriority | None = None,
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
                        pooled = priority is not None and priority.background and cgroups.pool_exists()
                        st.cg = cgroups.create(rel + cgroup_name, limits, pooled=pooled)
                        st.cg_rel = rel + cgroup_name
                        break
                    except FileNotFoundError:
                        if attempt:
                            raise
                        cgroups._made.clear()  # a parent was removed (gc): make it again
                st.cg.add(child)
                if priority is not None:
                    priority._started(st, child, "/".join(name for name, _ in cgroup_parents) or None)
            except ProcessLookupError:
                raise
            except OSError as exc:
                raise SandboxError(f"cannot put the command in a cgroup ({exc}); see aospec sandbox info") from None
        elif priority is not None:
            priority._started(st, child, None)
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
    priority: CommandPriority | None = None,
    pause: CommandPause | None = None,
    tracer: CommandTrace | EbpfCommandTrace | None = None,
) -> tuple[CommandResult, T]:
    """Run ``argv_for(info_fd, block_fd)`` (a bwrap command line, started in ``cwd``)
    to completion: ``before()`` first and ``after()`` last, both in worker threads;
    ``after`` runs also when the command fails or is cancelled. Returns the result and
    what ``after`` returned. The command's cgroup ``cgroup_name`` nests in
    ``cgroup_parents`` (see :meth:`Cgroups.ensure_group`); ``seccomp`` is a compiled
    filter (:func:`aospec.runtime.seccomp.filter_program`) bwrap loads before the command;
    ``priority`` the sandbox's :class:`CommandPriority`; ``pause`` its
    :class:`~aospec.runtime.pausing.CommandPause` (the command starts frozen when the
    sandbox is paused, and paused time does not count against ``timeout_s``).
    ``priority`` the sandbox's :class:`CommandPriority`; ``tracer`` runs the command under
    strace (:class:`aospec.runtime.readsets.CommandTrace`, at the command's priority).

    bwrap is spawned from the event loop's thread on purpose: ``--die-with-parent``
    ties the sandbox's life to the *thread* that spawned it, and a worker thread may
    exit (idle) while a long command runs. Cancel-safe: when the caller's scope is
    cancelled the whole PID namespace is killed and reaped before ``after`` runs and
    the cancellation propagates.
    """
    out = OutputBuffer(max_output_bytes)
    started_at = time.perf_counter()
    timed_out = False
    limits_hit: list[str] = []
    st: _Started | None = None
    info_r = info_w = block_r = block_w = seccomp_r = -1
    try:
        await _in_thread(priority, before)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        block_r, block_w = os.pipe2(os.O_CLOEXEC)
        argv = argv_for(info_w, block_r)
        if seccomp is not None:
            seccomp_r = program_fd(seccomp)
            argv[argv.index("--") : argv.index("--")] = ["--seccomp", str(seccomp_r)]
        diag = -1
        from aospec.runtime.readsets import CommandTrace

        stracing = isinstance(tracer, CommandTrace)
        if tracer is not None:
            argv = tracer.wrap(argv)
            if stracing:
                diag = os.open(tracer.diag, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            tracer.started_ns = time.time_ns()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if diag < 0 else diag,
                # the markers let recovery and gc find this run's processes, even orphans
                # (the sandbox can read them in /proc/1/environ: no host paths in them)
                env={"PATH": DEFAULT_PATH, MARKER_ENV: cgroup_name, OWNER_ENV: own_owner_token()},
                pass_fds=tuple(fd for fd in (info_w, block_r, seccomp_r) if fd >= 0),
                cwd=cwd,
                umask=0o022,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SandboxUnavailableError("bubblewrap is not installed (apt-get install bubblewrap)") from None
        finally:
            if diag >= 0:
                os.close(diag)
        st = _Started(proc, os.pidfd_open(proc.pid), tracer_pid=proc.pid if stracing else -1)
        if stracing and priority is not None and priority.background:
            set_process_priority(proc.pid, background=True)
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
        st.child_pid = child
        if stracing:
            assert tracer is not None
            tracer.child_pid = child
        elif tracer is not None:
            tracer.attach(child)  # the eBPF tracer follows it from here (it is blocked)
        _release(st, child, limits, cgroup_name, cgroup_parents, priority)
        if pause is not None:
            pause.started(st.cg)  # frozen before it is released, when paused
        os.write(block_w, b"1")
        with pause.deadline(timeout_s) if pause is not None else anyio.move_on_after(timeout_s) as scope:
            await _drain(proc.stdout.fileno(), out)
            await anyio.wait_readable(st.outer_pidfd)
        if scope.cancelled_caught:
            timed_out = True
            limits_hit.append("timeout")
            # the output is what the command wrote before the timeout: take what the pipe
            # holds, then stop collecting, then kill (a shell whose children die first
            # reports them, "Killed", and that is the kill's text, not the command's)
            _drain_ready(proc.stdout.fileno(), out)
            out.freeze()
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
                if priority is not None:
                    priority._stopped(st)
                await _reap(st, cgroup_name)
                if pause is not None:
                    pause.stopped(st.cg)
            for fd in (info_r, info_w, block_r, block_w, seccomp_r):
                if fd >= 0:
                    os.close(fd)
            hits, value = await _in_thread(priority, _cleanup, st, after)
    for what in hits:
        if what not in limits_hit:
            limits_hit.append(what)
    text, truncated = out.text()
    rc = st.proc.returncode if st.proc.returncode is not None else -1
    if rc < 0 and not timed_out:
        # bwrap itself died of a signal: something outside killed the sandbox (the command's
        # own death by a signal is bwrap's exit status 128+N). Not an observation of the
        # command: what it would have printed and left is unknown.
        raise SandboxError(
            f"the sandbox was killed from outside ({_signal_name(-rc)} to its bubblewrap process) while running "
            "the command: no result"
        )
    if tracer is not None:
        tracer.timed_out = timed_out
        tracer.ended_ns = time.time_ns()
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


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


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


def _kill_tree(pidfd: int, cg: CommandCgroup | None) -> None:
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if cg is not None:
        cg.kill_all()


def _drain_ready(fd: int, out: OutputBuffer) -> None:
    """Read what a non-blocking pipe holds now, without waiting."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            return
        out.add(chunk)


async def _drain(fd: int, out: OutputBuffer) -> None:
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
