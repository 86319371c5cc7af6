"""What a speculative command read and wrote: strace around bubblewrap, and the layers.

The engine's read-set validation (:mod:`aospec.readsets`, docs/engine.md "Read sets")
needs, for each speculative fork, every path its command looked at. The overlay backend
gets it by running the fork's command under ``strace -f --seccomp-bpf`` (:class:`CommandTrace`):
strace starts bubblewrap, follows every process into the sandbox's namespaces, and stops
only at the traced system calls (every call that takes a path, directory listings,
``fchdir``, process creation, ``connect``/``bind``): the seccomp filter strace installs
returns TRACE for those and ALLOW for the rest, stacked under the sandbox's own filter,
whose refusals (EPERM/ENOSYS) take precedence, so a refused call never reaches strace and
has no effect to track. ``-y`` prints each descriptor's path and the caller's working
directory (``AT_FDCWD</dir>``) as the kernel resolved them. A clone inside the sandbox
returns the new process's pid in the sandbox's PID namespace; :func:`_link` pairs those with
the host pids the log's lines carry (``--decode-pids=pidns`` would print them, at the cost of
a scan of the host's ``/proc`` for every new process).

:func:`read_set` turns the log into an :class:`aospec.readsets.ReadSet`: the records of the
command's processes (the descendants of bubblewrap's child in the sandbox's PID namespace)
give what each call named, made absolute with the call's directory descriptor or the
process's working directory; each path is then resolved component by component, symlinks
followed, in the fork's origin state (its lower view) and in its final state (its merged
root), and everything met on the way is recorded. The kernel also reads an executable's
``#!`` interpreter and ELF loader without a system call: those are added from the file.
``/proc`` (kernel and process state), ``/dev`` and read-only binds are not filesystem state;
a writable bind is, and is not versioned: reading one makes the command *untracked*.

Untracked (None: the fork is then reused by plain JASV only, never rebased): a tracer
failure or a record it cannot parse, a process still running when the command ended or
killed by a signal (SIGPIPE excepted for a process that wrote nothing), a timeout,
processes the log cannot pair with the clones that made them (or threads made at the same
time in two processes), a relative path in a process made at the same time as another
before the trace names its directory, a successful ``mount``/``chroot``/``inotify_add_watch``
or other call that observes or changes state outside the files, a path through another
process's ``/proc`` entries, a writable bind, or network use in a sandbox that has network
access.

:func:`write_set` gives a command's :class:`aospec.readsets.WriteSet` from its layer and
upper directory; :func:`shift_times` moves a rebased fork's own modification times after
the commits it is rebased onto, so that mtime order is the serial order.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aospec.runtime.config import Bind
from aospec.runtime.versions import Layer, UpperTracker, _TreeReader

from aospec.readsets import ReadSet, WriteSet

if TYPE_CHECKING:
    from aospec.runtime.ebpf import EbpfSupport, EbpfTrace, EbpfTracer

__all__ = [
    "TRACED_SYSCALLS",
    "CommandTrace",
    "TracerSupport",
    "read_set",
    "shift_times",
    "tracer_support",
    "write_set",
]

#: What strace stops at: every call taking a path, listings, fchdir, process creation and
#: the socket calls that name a path.
TRACED_SYSCALLS = "%file,getdents,getdents64,fchdir,clone,fork,vfork,connect,bind,io_uring_setup"
_FLAGS = (
    "-f",
    "--seccomp-bpf",
    "-y",
    "-xx",
    "-s",
    "4096",
    "-q",
    "-e",
    "signal=none",
    "-e",
    "verbose=connect,bind",
    "-e",
    f"trace={TRACED_SYSCALLS}",
)
#: A trace log larger than this is not parsed (the command is untracked).
MAX_LOG_BYTES = 256 << 20
_MAX_LINKS = 40


@dataclass(frozen=True, slots=True)
class TracerSupport:
    """Whether read sets can be recorded on this host: ``ok``, and ``detail`` (the tracer
    and its version, or why not, with the fix); ``kind`` is ``ebpf`` (bpftrace on the
    syscall tracepoints, :mod:`aospec.runtime.ebpf`: the command never stops for it) or
    ``strace``."""

    ok: bool
    detail: str
    strace: str | None = None
    kind: str = "strace"
    ebpf: EbpfSupport | None = None


_support: TracerSupport | None = None
_support_lock = threading.Lock()


def tracer_support() -> TracerSupport:
    """Probe strace once per process: present, new enough for ``--seccomp-bpf`` and the
    working directory in ``-y``, and able to trace (ptrace allowed here)."""
    global _support
    with _support_lock:
        if _support is None:
            _support = _probe()
        return _support


def _probe() -> TracerSupport:
    """The eBPF tracer where it works (``AOSPEC_READ_SETS=strace``: strace only), else
    strace."""
    choice = os.environ.get("AOSPEC_READ_SETS", "").lower()
    if choice in ("0", "off", "no", "false"):
        return TracerSupport(False, "off: AOSPEC_READ_SETS=off")
    strace = _probe_strace()
    if choice != "strace":
        from aospec.runtime.ebpf import ebpf_support

        eb = ebpf_support()
        if eb.ok:
            return TracerSupport(True, eb.detail, strace.strace, "ebpf", eb)
        if not strace.ok:
            return TracerSupport(False, f"{strace.detail}; {eb.detail.removeprefix('off: ')}")
        return TracerSupport(True, f"{strace.detail} (eBPF {eb.detail})", strace.strace, "strace", eb)
    return strace


def new_trace(directory: Path) -> CommandTrace | EbpfCommandTrace:
    """A tracer for one command, of the kind :func:`tracer_support` chose: eBPF (the
    process's bpftrace; while it starts, in the background, a command is untracked: it is
    not held up for it; where it cannot start, strace) or strace logging into
    ``directory``."""
    support = tracer_support()
    if support.kind == "ebpf" and support.ebpf is not None:
        from aospec.runtime.ebpf import ready_tracer

        try:
            return EbpfCommandTrace(ready_tracer(support.ebpf))
        except RuntimeError:
            if support.strace is None:
                return EbpfCommandTrace(None)
    return CommandTrace(directory, support.strace or "strace")


def wait_for_tracer() -> None:
    """Start the process's eBPF tracer (where it is the tracer) and wait until it runs; a
    ConfigError naming why when it cannot start and strace is not there either."""
    support = tracer_support()
    if support.kind == "ebpf" and support.ebpf is not None:
        from aospec.runtime.ebpf import tracer

        try:
            tracer(support.ebpf)
        except RuntimeError as exc:
            if support.strace is None:
                from aospec.errors import ConfigError

                raise ConfigError(f"read sets: {exc}") from None


def _probe_strace() -> TracerSupport:
    path = shutil.which("strace")
    if path is None:
        return TracerSupport(False, "off: strace is not installed (apt-get install strace)")
    try:
        version = subprocess.run([path, "-V"], capture_output=True, text=True, timeout=10).stdout.split("\n")[0]
        with tempfile.TemporaryDirectory(prefix="aospec-strace-") as tmp:
            log = os.path.join(tmp, "log")
            probe = subprocess.run(
                [path, *_FLAGS, "-o", log, "--", "/bin/sh", "-c", "test -e /nonexistent-aospec-probe; exit 0"],
                capture_output=True,
                text=True,
                timeout=30,
                cwd=tmp,
            )
            text = Path(log).read_text(errors="replace") if os.path.exists(log) else ""
    except (OSError, subprocess.SubprocessError) as exc:
        return TracerSupport(False, f"off: strace could not be run ({exc})")
    m = re.search(r"version (\d+)\.(\d+)", version)
    if m is None or (int(m.group(1)), int(m.group(2))) < (5, 10):
        return TracerSupport(False, f"off: {version or 'strace'} is too old (5.10 or later is needed)")
    if probe.returncode != 0 or probe.stderr.strip():
        why = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        return TracerSupport(False, f"off: strace cannot trace here ({why})")
    if "AT_FDCWD<" not in text:
        return TracerSupport(False, f"off: {version} does not print working directories with -y")
    return TracerSupport(True, f"on: {version.replace('strace -- version', 'strace').strip()}, --seccomp-bpf", path)


class CommandTrace:
    """One command run under strace: ``wrap`` its bubblewrap command line (strace's own
    messages go to ``diag``, bubblewrap's stderr stays the command's output), then
    ``child_pid`` is set to bubblewrap's child (the sandbox's init, host pid) and
    ``timed_out`` by the runner."""

    def __init__(self, directory: Path, strace: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "trace.log"
        self.diag = directory / "trace.err"
        self.strace = strace
        self.child_pid = -1
        self.timed_out = False
        self.started_ns = self.ended_ns = 0  # wall clock (time.time_ns) around the command

    def wrap(self, argv: Sequence[str]) -> list[str]:
        # sh moves bubblewrap's stderr onto its stdout (the command's output pipe) so that
        # strace's stderr, a file, holds strace's own messages only
        return [self.strace, *_FLAGS, "-o", str(self.log), "--", "/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]

    def remove(self) -> None:
        for p in (self.log, self.diag):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


class Untracked(Exception):
    """The command did something the read set cannot account for (the message says what)."""


# ---------------------------------------------------------------------------------- the log

_LINE = re.compile(r"^(\d+) +(.*)$")
_HEX = re.compile(rb"\\x([0-9a-f]{2})")
_RESUMED = re.compile(r"^<\.\.\. ([\w]+) resumed>(.*)$")
_RET = re.compile(r"^(-?\d+|\?)(?:<(.*)>)?(?: (E[A-Z0-9]+) .*)?")


_ALL_HEX = re.compile(r"(?:\\x[0-9a-f]{2})*")


def _unhex(text: str) -> bytes:
    if _ALL_HEX.fullmatch(text) is not None:  # -xx: every byte is \xNN
        return bytes.fromhex(text.replace("\\x", ""))
    return _HEX.sub(lambda m: bytes((int(m.group(1), 16),)), text.encode("ascii", "surrogateescape"))


@dataclass(slots=True)
class _Record:
    pid: int
    name: str
    args: list[str]
    ret: int | None  # None: "?" (the process died in the call)
    ret_path: bytes | None  # the descriptor's path a call returned (-y)
    ret_pid: int | None  # a new process's host pid (clone; set by _link)
    errno: str | None
    start: int = 0  # the log lines of the call's start and end
    end: int = 0


_ARG_MARK = re.compile(r'["<()\[\]{},]|/\*')
#: where a span that may hold any character ends, by its first character (``/``: ``/*``)
_ARG_SPANS = {'"': '"', "<": ">", "/": "*/"}


def _split_args(text: str) -> tuple[list[str], str] | None:
    """The top-level arguments of ``name(ARGS) = RET`` and the rest after ``) = ``."""
    depth = 0
    start = 0
    out: list[str] = []
    i = 0
    search = _ARG_MARK.search
    while (m := search(text, i)) is not None:
        i = m.start()
        c = text[i]
        close = _ARG_SPANS.get(c)
        if close is not None:  # a string, a decoded path or a comment: skipped whole
            j = text.find(close, i + (2 if c == "/" else 1))
            if j < 0:
                return None
            i = j + len(close)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                if c != ")":
                    return None
                arg = text[start:i].strip()
                if arg:
                    out.append(arg)
                rest = text[i + 1 :].lstrip()
                if not rest.startswith("="):
                    return None
                return out, rest[1:].strip()
            depth -= 1
        elif depth == 0:  # ","
            out.append(text[start:i].strip())
            start = i + 1
        i += 1
    return None


def _parse_ret(text: str) -> tuple[int | None, bytes | None, int | None, str | None] | None:
    m = _RET.match(text)
    if m is None:
        return None
    ret = None if m.group(1) == "?" else int(m.group(1))
    path = _unhex(m.group(2)) if m.group(2) is not None else None
    return ret, path, None, m.group(3)


@dataclass(slots=True)
class _Log:
    records: list[_Record] = field(default_factory=list)
    exits: dict[int, str] = field(default_factory=dict)  # pid -> "exited N" / "killed SIGX"
    children: dict[int, list[int]] = field(default_factory=dict)  # filled by _link
    clones: list[_Record] = field(default_factory=list)  # successful clone, fork, vfork
    pids: set[int] = field(default_factory=set)  # every pid with a line in the log
    first: dict[int, int] = field(default_factory=dict)  # pid -> the index of its first line
    unsure: set[int] = field(default_factory=set)  # new processes whose parent may be another's
    problems: list[str] = field(default_factory=list)


def _read_log(lines: Iterable[str]) -> _Log:
    log = _Log()
    pending: dict[int, tuple[str, int]] = {}
    for n, raw in enumerate(lines):
        line = raw.rstrip("\n")
        m = _LINE.match(line)
        if m is None:
            if line.strip():
                log.problems.append(f"a trace line without a pid: {line[:80]!r}")
            continue
        pid, body = int(m.group(1)), m.group(2)
        if pid not in log.pids:
            log.pids.add(pid)
            log.first[pid] = n
        start = n
        if body.startswith("+++ "):
            what = body[4:].rstrip(" +")
            log.exits[pid] = what
            pending.pop(pid, None)
            continue
        if body.startswith("--- "):
            continue
        if body.endswith(" <unfinished ...>"):
            pending[pid] = (body[: -len(" <unfinished ...>")], n)
            continue
        if body.endswith(" <detached ...>"):
            # strace let the process go in the middle of a call (the sandbox was killed
            # under it): it was still running, and the call's record ends there
            pending.pop(pid, None)
            log.exits[pid] = ""
            continue
        r = _RESUMED.match(body)
        if r is not None:
            started = pending.pop(pid, None)
            if started is None:
                log.problems.append(f"a resumed call without its start: {line[:80]!r}")
                continue
            body, start = started[0] + r.group(2), started[1]
        paren = body.find("(")
        if paren <= 0:
            log.problems.append(f"an unreadable trace line: {line[:80]!r}")
            continue
        name = body[:paren]
        split = _split_args(body[paren + 1 :])
        ret = _parse_ret(split[1]) if split is not None else None
        if split is None or ret is None:
            log.problems.append(f"an unreadable {name} record: {line[:80]!r}")
            continue
        rec = _Record(pid, name, split[0], *ret, start, n)
        log.records.append(rec)
        if name in ("clone", "fork", "vfork", "clone3") and rec.ret is not None and rec.ret > 0:
            log.clones.append(rec)
    for pid in pending:
        log.exits.setdefault(pid, "")
    return log


def _link(log: _Log, init: int) -> None:
    """Set each clone record's ``ret_pid`` to its new process's host pid and fill
    ``log.children``; Untracked when the log does not determine them.

    bwrap, outside the sandbox, gets ``init``'s host pid from its clone; every other process
    of the log is in the sandbox's PID namespace, where a clone returns the namespace's pid.
    The kernel gives a new process its pid in each namespace in one allocation, namespace
    after namespace, and pids grow until they wrap around: allocations that do not run at
    the same time are in the same order in both namespaces, so the i-th smallest namespace
    pid is the i-th smallest host pid. Checked: one new process per clone, no host pid
    below init's (the host's pids wrapped), no new process with a line before its clone
    started, and no clone that strace does not follow (CLONE_UNTRACED). Two clones whose
    calls overlap in the log (an allocation runs between the call's start and end, and the
    kernel may allocate a process's pids namespace by namespace, sleeping in between) may
    have swapped their new processes, whoever made them: those new processes start in
    ``unsure``, their working directory unknown until the trace names it (a relative path
    before that is untracked), and threads sharing one are untracked. (No pair is exempt:
    which process descends from which is itself read off this pairing.)
    """
    outer = [c for c in log.clones if c.ret == init and c.pid != init]
    bwrap = outer[0].pid if len(outer) == 1 else -1
    if bwrap < 0 or bwrap not in log.pids or init not in log.pids:
        raise Untracked("the trace does not show bwrap starting the sandbox")
    inner = sorted((c for c in log.clones if c.pid != bwrap), key=lambda c: c.ret or 0)
    if len(inner) != len(log.clones) - 1:
        raise Untracked("bwrap started a process outside the sandbox")
    hosts = sorted(log.pids - {bwrap, init})
    if len(hosts) < len(inner):
        raise Untracked("a process the trace shows started never ran in it (still running when the command ended)")
    if len(hosts) > len(inner) or len({c.ret for c in inner}) != len(inner):
        raise Untracked("the trace's processes do not match its clone calls")
    if hosts and hosts[0] < init:
        raise Untracked("the host's process ids wrapped around during the command")
    if any("CLONE_UNTRACED" in x for c in log.clones for x in c.args):
        raise Untracked("a process was started that the tracer does not follow (CLONE_UNTRACED)")
    outer[0].ret_pid = init
    log.children = {bwrap: [init]}
    for c, host in zip(inner, hosts, strict=True):
        if log.first.get(host, -1) < c.start:
            raise Untracked("the trace's processes do not match its clone calls (one ran before it was made)")
        c.ret_pid = host
        log.children.setdefault(c.pid, []).append(host)
    by_start = sorted(inner, key=lambda c: c.start)
    for i, a in enumerate(by_start):
        for b in by_start[i + 1 :]:
            if b.start > a.end:
                break
            if b.pid == a.pid:
                continue  # one process's clones never run at the same time
            if any("CLONE_FS" in x for c in (a, b) for x in c.args):
                raise Untracked("two processes started threads at the same time")
            assert a.ret_pid is not None and b.ret_pid is not None
            log.unsure.update((a.ret_pid, b.ret_pid))


def _descendants(children: dict[int, list[int]], root: int) -> set[int]:
    out: set[int] = set()
    todo = list(children.get(root, ()))
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, ()))
    return out


# ---------------------------------------------------------------------------------- accesses

_STR = re.compile(r'^"((?:\\x[0-9a-f]{2})*)"(\.\.\.)?$')
_FD = re.compile(r"^(-?\d+|AT_FDCWD)(?:<(.*)>)?$")

# name -> (kind, dirfd arg or None, path arg); kinds: lookup, node, list (rmdir), tree
_PATH_CALLS: dict[str, tuple[str, int | None, int]] = {
    "open": ("node", None, 0),
    "creat": ("node", None, 0),
    "openat": ("node", 0, 1),
    "openat2": ("node", 0, 1),
    "stat": ("node", None, 0),
    "lstat": ("node", None, 0),
    "stat64": ("node", None, 0),
    "lstat64": ("node", None, 0),
    "oldstat": ("node", None, 0),
    "oldlstat": ("node", None, 0),
    "newfstatat": ("node", 0, 1),
    "fstatat64": ("node", 0, 1),
    "statx": ("node", 0, 1),
    "access": ("lookup", None, 0),
    "faccessat": ("lookup", 0, 1),
    "faccessat2": ("lookup", 0, 1),
    "readlink": ("lookup", None, 0),
    "readlinkat": ("lookup", 0, 1),
    "chdir": ("lookup", None, 0),
    "execve": ("exec", None, 0),
    "execveat": ("exec", 0, 1),
    "statfs": ("lookup", None, 0),
    "statfs64": ("lookup", None, 0),
    "mkdir": ("lookup", None, 0),
    "mkdirat": ("lookup", 0, 1),
    "mknod": ("lookup", None, 0),
    "mknodat": ("lookup", 0, 1),
    "unlink": ("lookup", None, 0),
    "unlinkat": ("lookup", 0, 1),
    "rmdir": ("list", None, 0),
    "chmod": ("node", None, 0),
    "fchmodat": ("node", 0, 1),
    "fchmodat2": ("node", 0, 1),
    "chown": ("node", None, 0),
    "lchown": ("node", None, 0),
    "fchownat": ("node", 0, 1),
    "truncate": ("node", None, 0),
    "truncate64": ("node", None, 0),
    "utime": ("node", None, 0),
    "utimes": ("node", None, 0),
    "utimensat": ("node", 0, 1),
    "futimesat": ("node", 0, 1),
    "getxattr": ("node", None, 0),
    "lgetxattr": ("node", None, 0),
    "listxattr": ("node", None, 0),
    "llistxattr": ("node", None, 0),
    "setxattr": ("node", None, 0),
    "lsetxattr": ("node", None, 0),
    "removexattr": ("node", None, 0),
    "lremovexattr": ("node", None, 0),
}
# (kind, dirfd, path) per path argument
_TWO_PATH_CALLS: dict[str, tuple[tuple[str, int | None, int], ...]] = {
    "rename": (("tree", None, 0), ("tree", None, 1)),
    "renameat": (("tree", 0, 1), ("tree", 2, 3)),
    "renameat2": (("tree", 0, 1), ("tree", 2, 3)),
    "link": (("node", None, 0), ("lookup", None, 1)),
    "linkat": (("node", 0, 1), ("lookup", 2, 3)),
}
#: Calls that observe or change state outside the sandbox's files: untracked when they succeed.
_UNTRACKED_CALLS = frozenset(
    {
        "chroot",
        "mount",
        "umount",
        "umount2",
        "pivot_root",
        "swapon",
        "swapoff",
        "quotactl",
        "acct",
        "uselib",
        "inotify_add_watch",
        "fanotify_mark",
        "name_to_handle_at",
        "open_tree",
        "move_mount",
        "fspick",
        "fsconfig",
        "mount_setattr",
        "io_uring_setup",  # its opens and stats are no system calls
    }
)
_HARMLESS_CALLS = frozenset({"getcwd", "clone", "clone3", "fork", "vfork", "fchdir"})
#: Calls that change files (a process killed by SIGPIPE after one is untracked).
_WRITING_CALLS = frozenset(
    {
        "creat",
        "mkdir",
        "mkdirat",
        "mknod",
        "mknodat",
        "unlink",
        "unlinkat",
        "rmdir",
        "rename",
        "renameat",
        "renameat2",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "chmod",
        "fchmodat",
        "fchmodat2",
        "chown",
        "lchown",
        "fchownat",
        "truncate",
        "truncate64",
        "utime",
        "utimes",
        "utimensat",
        "futimesat",
        "setxattr",
        "lsetxattr",
        "removexattr",
        "lremovexattr",
        "bind",
    }
)
_WRITE_OPEN = re.compile(r"O_(WRONLY|RDWR|CREAT|TRUNC|APPEND)")


@dataclass(slots=True)
class _Cwd:
    path: bytes | None


@dataclass(frozen=True, slots=True)
class _Access:
    kind: str  # lookup, node, list, tree, exec, symlink (target relative to the link's directory)
    path: bytes  # absolute, unresolved
    base: bytes = b""  # symlink: the directory the target is relative to


def _string(arg: str) -> bytes | None:
    """A path argument's bytes; None for NULL or a pointer; Untracked when cut short."""
    m = _STR.match(arg)
    if m is None:
        return None
    if m.group(2):
        raise Untracked("a path longer than the tracer records")
    return _unhex(m.group(1))


@functools.lru_cache(maxsize=4096)  # the same few directories, over and over
def _fd_path(arg: str) -> tuple[bool, bytes | None]:
    """(is AT_FDCWD, the descriptor's path or None)."""
    m = _FD.match(arg)
    if m is None:
        return False, None
    path = _unhex(m.group(2)) if m.group(2) is not None else None
    if path is not None:
        path = path.removesuffix(b" (deleted)")
        if not path.startswith(b"/"):
            path = None  # a pipe, socket or other object without a path
    return m.group(1) == "AT_FDCWD", path


def _absolute(path: bytes, dirfd_arg: str | None, cwd: _Cwd) -> bytes:
    if path.startswith(b"/"):
        return path
    base: bytes | None
    if dirfd_arg is None:
        base = cwd.path
    else:
        at_cwd, base = _fd_path(dirfd_arg)
        if at_cwd and base is not None:
            cwd.path = base
        elif at_cwd:
            base = cwd.path
    if base is None:
        raise Untracked("a relative path whose directory the trace does not name")
    return base.rstrip(b"/") + b"/" + path if path else base


def _accesses(log: _Log, command_pids: set[int], cwd0: bytes, network: bool) -> list[_Access]:
    """Every path access of the command's processes, in log order."""
    cwds: dict[int, _Cwd] = {}
    # child -> (parent, whether it shares the parent's working directory: CLONE_FS)
    parents = {
        c.ret_pid: (c.pid, c.name == "clone" and any("CLONE_FS" in a for a in c.args))
        for c in log.clones
        if c.ret_pid is not None
    }

    def cwd_of(pid: int) -> _Cwd:
        # a process's first call before its parent's clone returned (in the log): the
        # parent is still in the clone, its directory is the child's
        chain = []
        while pid not in cwds and pid in command_pids and pid not in chain:
            chain.append(pid)
            pid = parents.get(pid, (-1, False))[0]
        cwd = cwds.get(pid, _Cwd(cwd0))
        for p in reversed(chain):
            shared = parents.get(p, (-1, False))[1]
            cwd = cwds[p] = cwd if shared else _Cwd(None if p in log.unsure else cwd.path)
        return cwd

    out: list[_Access] = []
    for rec in log.records:
        if rec.pid not in command_pids:
            continue
        cwd = cwds.get(rec.pid) or cwd_of(rec.pid)
        name, args = rec.name, rec.args
        ok = rec.ret is not None and rec.ret >= 0
        for a in args:
            if a.startswith("AT_FDCWD<"):
                known = _fd_path(a)[1]
                if known is not None:
                    cwd.path = known
        if name in ("clone", "fork", "vfork"):
            child = rec.ret_pid
            if child is not None and child not in cwds:
                shared = name == "clone" and any("CLONE_FS" in a for a in args)
                cwds[child] = cwd if shared else _Cwd(None if child in log.unsure else cwd.path)
            continue
        if name == "fchdir":
            if ok:
                # a directory the trace does not name: unknown, so a relative path is untracked
                cwd.path = _fd_path(args[0])[1] if args else None
            continue
        if name in _UNTRACKED_CALLS:
            if ok:
                raise Untracked(f"{name} succeeded")
            continue
        if name in ("getdents", "getdents64"):
            path = _fd_path(args[0])[1] if args else None
            if path is None:
                raise Untracked(f"{name} of a descriptor whose path the trace does not name")
            out.append(_Access("list", path))
            continue
        if name in ("connect", "bind"):
            out.extend(_socket(name, args, ok, network))
            continue
        if name in ("symlink", "symlinkat"):
            target = _string(args[0]) if args else None
            link_dir = args[1] if name == "symlinkat" and len(args) > 2 else None
            link = _string(args[2] if name == "symlinkat" else args[1]) if len(args) > 1 else None
            if target is None or link is None:
                raise Untracked(f"an unreadable {name} record")
            where = _absolute(link, link_dir, cwd)
            out.append(_Access("lookup", where))
            if ok:
                out.append(_Access("symlink", target, where.rpartition(b"/")[0] or b"/"))
            continue
        specs = _TWO_PATH_CALLS.get(name)
        if specs is None:
            spec = _PATH_CALLS.get(name)
            if spec is None:
                if name in _HARMLESS_CALLS:
                    continue
                if ok:
                    raise Untracked(f"{name} is not one the read set understands")
                continue
            specs = (spec,)
        for kind, dirfd_i, path_i in specs:
            if path_i >= len(args):
                raise Untracked(f"an unreadable {name} record")
            path = _string(args[path_i])
            dirfd_arg = args[dirfd_i] if dirfd_i is not None and dirfd_i < len(args) else None
            if path is None:
                # NULL or "" with AT_EMPTY_PATH: the call works on the descriptor itself
                fd_path = _fd_path(dirfd_arg)[1] if dirfd_arg is not None else None
                if fd_path is None:
                    if dirfd_arg is None or _fd_path(dirfd_arg)[0]:
                        raise Untracked(f"an unreadable {name} record")
                    continue  # a descriptor without a path (a pipe): not a file
                out.append(_Access(kind if kind != "exec" else "lookup", fd_path))
                continue
            if path == b"" and dirfd_arg is not None and not _fd_path(dirfd_arg)[0]:
                fd_path = _fd_path(dirfd_arg)[1]
                if fd_path is not None:
                    out.append(_Access(kind if kind != "exec" else "lookup", fd_path))
                continue
            absolute = _absolute(path, dirfd_arg, cwd)
            out.append(_Access(kind, absolute))
            if name == "unlinkat" and ok and any("AT_REMOVEDIR" in a for a in args):
                out.append(_Access("list", absolute))
            if name == "rmdir":
                out.append(_Access("lookup", absolute))
        if name in ("open", "openat", "openat2", "creat") and ok and rec.ret_path is not None:
            out.append(_Access("node", rec.ret_path))
        if name == "chdir" and ok:
            cwd.path = out[-1].path
    return out


_SUN_PATH = re.compile(r'sun_path="((?:\\x[0-9a-f]{2})*)"')


def _socket(name: str, args: list[str], ok: bool, network: bool) -> list[_Access]:
    address = args[1] if len(args) > 1 else ""
    if "AF_UNIX" in address or "AF_LOCAL" in address:
        m = _SUN_PATH.search(address)
        if m is None:
            return []  # abstract or unnamed: inside the sandbox's own network namespace
        path = _unhex(m.group(1))
        if not path.startswith(b"/"):
            raise Untracked(f"{name} to a relative socket path")
        return [_Access("node" if name == "connect" else "lookup", path)]
    if network and name == "connect" and ok:
        raise Untracked("a network connection (the sandbox has network access)")
    return []


def _writers(log: _Log, pids: set[int]) -> set[int]:
    """The processes that made a call changing files."""
    out = set()
    for rec in log.records:
        if rec.pid not in pids or rec.pid in out:
            continue
        opens_to_write = rec.name in ("open", "openat", "openat2") and any(_WRITE_OPEN.search(a) for a in rec.args[1:3])
        if rec.name in _WRITING_CALLS or opens_to_write:
            out.add(rec.pid)
    return out


# ---------------------------------------------------------------------------------- resolution


class _Reads:
    def __init__(self) -> None:
        self.sets: dict[str, set[str]] = {"lookups": set(), "nodes": set(), "lists": set(), "trees": set()}

    def add(self, kind: str, parts: Sequence[bytes]) -> None:
        self.sets[kind + "s"].add(os.fsdecode(b"/".join(parts)))

    def read_set(self) -> ReadSet:
        s = self.sets
        return ReadSet(frozenset(s["lookups"]), frozenset(s["nodes"]), frozenset(s["lists"]), frozenset(s["trees"]))


class _View:
    """One state of the sandbox's tree (a directory on the host), read without following
    symlinks out of it; entries looked up are cached."""

    def __init__(self, root: str) -> None:
        self.reader = _TreeReader(os.fsencode(root))
        self._cache: dict[bytes, tuple[str, bytes] | None] = {}

    def close(self) -> None:
        self.reader.close()

    def entry(self, rel: bytes) -> tuple[str, bytes] | None:
        """("d"|"l"|"f", symlink target) of the entry at ``rel``, None when absent."""
        if rel in self._cache:
            return self._cache[rel]
        found = self.reader.lstat(rel)
        out: tuple[str, bytes] | None = None
        if found is not None:
            pfd, name, st = found
            if stat.S_ISLNK(st.st_mode):
                out = ("l", os.readlink(name, dir_fd=pfd))
            else:
                out = ("d" if stat.S_ISDIR(st.st_mode) else "f", b"")
        self._cache[rel] = out
        return out

    def head(self, rel: bytes, n: int = 4096) -> bytes:
        """The first ``n`` bytes of the regular file at ``rel`` (b"" when unreadable)."""
        found = self.reader.lstat(rel)
        if found is None or not stat.S_ISREG(found[2].st_mode):
            return b""
        try:
            fd = os.open(found[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=found[0])
        except OSError:
            return b""
        try:
            return os.pread(fd, n, 0)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class _Mounts:
    """What is mounted over the sandbox's tree, by path components: ``proc``, ``dev``,
    ``ro`` (a read-only bind) or ``rw`` (a writable bind)."""

    points: dict[tuple[bytes, ...], str]

    @classmethod
    def of(cls, binds: Sequence[Bind], network: bool) -> _Mounts:
        points: dict[tuple[bytes, ...], str] = {(b"proc",): "proc", (b"dev",): "dev"}
        if network:
            points[(b"etc", b"resolv.conf")] = "ro"
        for b in binds:
            parts = tuple(p for p in os.fsencode(b.target).split(b"/") if p and p != b".")
            if parts:
                points[parts] = "rw" if b.writable else "ro"
        return cls(points)


def _resolve(
    view: _View, mounts: _Mounts, path: bytes, kind: str, reads: _Reads, cwd: bytes | None = None, depth: int = 0
) -> tuple[bytes, ...] | None:
    """Resolve the absolute ``path`` in ``view`` as the kernel would, recording each symlink
    met (a lookup), each directory left by ``..`` (a lookup), and the final entry (``kind``)
    or the first missing one (a lookup). Returns the final entry's components, or None
    when it is missing or not in the tree (``/proc``, ``/dev``, a read-only bind)."""
    stack = [p for p in reversed(path.split(b"/")) if p not in (b"", b".")]
    cur: list[bytes] = []
    links = 0
    while stack:
        c = stack.pop()
        if c == b"..":
            if cur:
                reads.add("lookup", cur)
                cur.pop()
            continue
        cand = (*cur, c)
        where = mounts.points.get(cand)
        if where is not None:
            return _mounted(where, cand, [*reversed(stack)], view, mounts, kind, reads, depth)
        rel = b"/".join(cand)
        entry = view.entry(rel)
        if entry is None:
            reads.add("lookup", cand)
            return None
        if entry[0] == "l":
            reads.add("lookup" if stack else kind, cand)
            links += 1
            if links > _MAX_LINKS:
                return None
            target = entry[1]
            if target.startswith(b"/"):
                cur = []
            stack.extend(p for p in reversed(target.split(b"/")) if p not in (b"", b"."))
            continue
        if stack and entry[0] != "d":
            reads.add("lookup", cand)
            return None
        cur = list(cand)
    reads.add(kind, cur)
    return tuple(cur)


def _mounted(
    where: str,
    point: tuple[bytes, ...],
    rest: list[bytes],
    view: _View,
    mounts: _Mounts,
    kind: str,
    reads: _Reads,
    depth: int,
) -> None:
    if where == "rw":
        raise Untracked(f"it used the writable bind /{os.fsdecode(b'/'.join(point))}")
    if where == "dev" and rest and (rest[0] == b"fd" or rest[0] in (b"stdin", b"stdout", b"stderr")):
        # /dev/fd/N, /dev/std*: bubblewrap's links to /proc/self/fd
        where, rest = "proc", [b"self", b"fd", *rest[1:]] if rest[0] == b"fd" else [b"self", b"fd", b"0"]
    if where != "proc" or len(rest) < 2:
        return None  # /dev, a read-only bind, kernel state in /proc: not the sandbox's files
    who, sub = rest[0], rest[1:]
    if who in (b"self", b"thread-self") or who.isdigit():
        if sub[:1] == [b"task"]:
            sub = sub[2:]
        if not sub or sub[0] in (b"exe", b"map_files") or (sub[0] == b"fd" and len(sub) <= 2):
            return None  # the executable and open files were recorded when exec'd or opened
        if sub[0] in (b"cwd", b"root", b"fd"):
            raise Untracked(f"a path through /proc/{os.fsdecode(who)}/{os.fsdecode(sub[0])}")
    return None


def _interpreter(view: _View, parts: tuple[bytes, ...]) -> bytes | None:
    """The interpreter the kernel runs for the executable at ``parts``: its ``#!`` line's
    or its ELF ``PT_INTERP``."""
    head = view.head(b"/".join(parts))
    if head.startswith(b"#!"):
        line = head[2:].split(b"\n", 1)[0].strip()
        return line.split()[0] if line else None
    if head[:4] != b"\x7fELF" or len(head) < 64 or head[4] != 2:  # 64-bit only
        return None
    endian = "<" if head[5] == 1 else ">"
    (phoff,) = struct.unpack_from(endian + "Q", head, 32)
    phentsize, phnum = struct.unpack_from(endian + "HH", head, 54)
    for i in range(min(phnum, 64)):
        off = phoff + i * phentsize
        if off + 56 > len(head):
            return None
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(endian + "IIQQQQ", head, off)
        if p_type == 3 and p_offset + p_filesz <= len(head):  # PT_INTERP
            return head[p_offset : p_offset + p_filesz].rstrip(b"\0")
    return None


def _resolve_access(view: _View, mounts: _Mounts, access: _Access, reads: _Reads) -> None:
    if access.kind == "symlink":
        # a link the command made: what it points to may have been read through it, even if
        # the link is gone by the end, so the whole target counts
        target = access.path if access.path.startswith(b"/") else access.base + b"/" + access.path
        _resolve(view, mounts, target, "tree", reads)
        return
    if access.kind != "exec":
        _resolve(view, mounts, access.path, access.kind, reads)
        return
    parts = _resolve(view, mounts, access.path, "lookup", reads)
    for _ in range(4):  # an interpreter's own #! line, at most a few deep
        if parts is None:
            return
        interp = _interpreter(view, parts)
        if interp is None or not interp.startswith(b"/"):
            return
        parts = _resolve(view, mounts, interp, "lookup", reads)


def read_set(
    trace: CommandTrace | EbpfCommandTrace,
    *,
    views: Sequence[str],
    cwd: str,
    binds: Sequence[Bind] = (),
    network: bool = False,
) -> ReadSet | None:
    """The read set of the command ``trace`` recorded, resolved in each of ``views`` (the
    fork's origin and final trees on the host), or None when it is untracked (module
    docstring). ``cwd`` is the command's working directory in the sandbox."""
    try:
        return _read_set(trace, views, cwd, binds, network)
    except Untracked:
        return None


def untracked_reason(
    trace: CommandTrace | EbpfCommandTrace,
    *,
    views: Sequence[str],
    cwd: str,
    binds: Sequence[Bind] = (),
    network: bool = False,
) -> str | None:
    """Why :func:`read_set` gives None for ``trace`` (None when it gives a read set)."""
    try:
        _read_set(trace, views, cwd, binds, network)
    except Untracked as exc:
        return str(exc)
    return None


def _read_set(
    trace: CommandTrace | EbpfCommandTrace, views: Sequence[str], cwd: str, binds: Sequence[Bind], network: bool
) -> ReadSet:
    if trace.timed_out:
        raise Untracked("the command timed out")
    if trace.child_pid < 0:
        raise Untracked("the sandbox never started")
    if isinstance(trace, EbpfCommandTrace):
        lines, why = trace.events()
        if why is not None:
            raise Untracked(why)
        log = _ebpf_log(lines, trace.child_pid)
        if log.problems:
            raise Untracked(log.problems[0])
    else:
        log = _strace_log(trace)
    return _resolved(log, trace.child_pid, views, cwd, binds, network)


def _strace_log(trace: CommandTrace) -> _Log:
    with contextlib.suppress(FileNotFoundError):
        diag = trace.diag.read_text(errors="replace").strip()
        if diag:
            raise Untracked(f"the tracer reported: {diag.splitlines()[-1][:200]}")
    try:
        size = trace.log.stat().st_size
    except FileNotFoundError:
        raise Untracked("the tracer wrote no log") from None
    if size > MAX_LOG_BYTES:
        raise Untracked(f"the trace is larger than {MAX_LOG_BYTES >> 20} MiB")
    with open(trace.log, encoding="ascii", errors="surrogateescape") as f:
        log = _read_log(f)
    if log.problems:
        raise Untracked(log.problems[0])
    _link(log, trace.child_pid)
    return log


def _resolved(log: _Log, init: int, views: Sequence[str], cwd: str, binds: Sequence[Bind], network: bool) -> ReadSet:
    pids = _descendants(log.children, init)
    if not pids:
        raise Untracked("the trace holds no process of the command")
    writers: set[int] | None = None
    for pid in sorted(pids):
        how = log.exits.get(pid)
        if how is None or not how:
            raise Untracked("a process was still running when the command ended")
        if how.startswith("killed by SIGPIPE"):
            writers = _writers(log, pids) if writers is None else writers
            if pid in writers:
                raise Untracked("a process that changed files was killed by SIGPIPE")
        elif not how.startswith("exited with"):
            raise Untracked(f"a process was {how}")
    accesses = _accesses(log, pids, os.fsencode(cwd), network)
    mounts = _Mounts.of(binds, network)
    reads = _Reads()
    unique = list(dict.fromkeys(accesses))
    for root in dict.fromkeys(views):
        view = _View(root)
        try:
            for access in unique:
                _resolve_access(view, mounts, access, reads)
        finally:
            view.close()
    return reads.read_set()


# ---------------------------------------------------------------------------------- writes


def write_set(tracker: UpperTracker, layer: Layer, lower: str | None) -> WriteSet:
    """What the command whose upper ``tracker`` last read (with ``layer``, its changes)
    wrote, against ``lower`` (the tree under the upper; None: empty)."""
    reader = _TreeReader(os.fsencode(lower) if lower is not None else None)
    try:
        changed = {os.fsdecode(p) for p, _ in layer.records}
        entries: set[str] = set()
        for p, after in layer.records:
            parent = p.rpartition(b"/")[0]
            if after is None:
                entries.add(os.fsdecode(parent))
                continue
            found = reader.lstat(p)
            if found is None or _kind(found[2]) != after[:1]:
                entries.add(os.fsdecode(parent))
        touched: set[str] = set()
        for p, seen in tracker._seen.items():
            if not seen.is_dir:
                touched.add(os.fsdecode(p))
                continue
            found = reader.lstat(p)
            if found is None or not seen.fp or found[2].st_mtime_ns != seen.fp[4]:
                entries.add(os.fsdecode(p))  # made, or its own times changed
        return WriteSet(frozenset(changed), frozenset(touched), frozenset(entries))
    finally:
        reader.close()


def _kind(st: os.stat_result) -> bytes:
    fmt = stat.S_IFMT(st.st_mode)
    return {stat.S_IFREG: b"f", stat.S_IFDIR: b"d", stat.S_IFLNK: b"l"}.get(fmt, b"?")


_TIME_SLACK_NS = 20_000_000  # file times come from a coarse clock, a tick behind


def shift_times(
    upper: str, *, started_ns: int, ended_ns: int, after_ns: int, now_ns: int, lower: str | None, new_lower: str | None
) -> int:
    """Move the modification times a rebased fork's command set while it ran
    (``started_ns``..``ended_ns``, wall clock) into ``after_ns``..``now_ns`` (after the
    commits it is rebased onto), keeping their order; give a directory the fork only copied
    up (its time is its ``lower``'s) the time it has in ``new_lower``. Returns how many
    entries changed. Times set explicitly to the past are left alone."""
    span = max(ended_ns - started_ns, 1)
    room = max(now_ns - after_ns - 1, 0)
    shift = after_ns >= started_ns - _TIME_SLACK_NS
    old = _TreeReader(os.fsencode(lower) if lower is not None else None)
    new = _TreeReader(os.fsencode(new_lower) if new_lower is not None else None)
    n = 0
    try:
        for rel, dir_fd, name, st in _upper_entries(upper):
            mtime = st.st_mtime_ns
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                continue  # a whiteout
            target = None
            if shift and mtime >= started_ns - _TIME_SLACK_NS:
                t = min(max(mtime, started_ns), ended_ns)
                target = after_ns + 1 + (t - started_ns) * room // span
            elif stat.S_ISDIR(st.st_mode):
                before, after = old.lstat(rel), new.lstat(rel)
                copied_up = before is not None and before[2].st_mtime_ns == mtime
                if copied_up and after is not None and after[2].st_mtime_ns != mtime:
                    target = after[2].st_mtime_ns
            if target is not None and target != mtime:
                os.utime(name, ns=(st.st_atime_ns, target), dir_fd=dir_fd, follow_symlinks=False)
                n += 1
    finally:
        old.close()
        new.close()
    return n


def _upper_entries(upper: str) -> Iterator[tuple[bytes, int, bytes, os.stat_result]]:
    """(relative path, parent fd, name, lstat) of every entry below ``upper``, children
    before their directory (so a directory's time is set after its entries')."""
    from aospec.runtime._fs import walk_tree

    root = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dirs: list[tuple[bytes, int, bytes, os.stat_result]] = []
        for step in walk_tree(root):
            prefix = step.rel + b"/" if step.rel else b""
            for entry in step.entries:
                name = os.fsencode(entry.name)
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    dirs.append((prefix + name, os.dup(step.fd), name, st))
                else:
                    yield prefix + name, step.fd, name, st
        for rel, fd, name, st in reversed(dirs):
            try:
                yield rel, fd, name, st
            finally:
                os.close(fd)
    finally:
        os.close(root)


# ---------------------------------------------------------------------------------- eBPF


class EbpfCommandTrace:
    """One command traced by the process's eBPF tracer (:mod:`aospec.runtime.ebpf`): the
    same interface as :class:`CommandTrace`, but nothing wraps the command: the runner
    calls :meth:`attach` with the sandbox's init while it waits on its block descriptor,
    and :func:`read_set` collects the events."""

    def __init__(self, tracer: EbpfTracer | None) -> None:
        self.tracer = tracer
        self.child_pid = -1
        self.timed_out = False
        self.started_ns = self.ended_ns = 0
        self._trace: EbpfTrace | None = None
        self._events: tuple[list[bytes], str | None] | None = None
        self._lock = threading.Lock()

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def attach(self, pid: int) -> None:
        """Trace ``pid`` (bubblewrap's child, blocked) and what it starts."""
        self.child_pid = pid
        try:
            self._trace = self.tracer.mark(pid) if self.tracer is not None else None
        except RuntimeError:
            self._trace = None

    def events(self) -> tuple[list[bytes], str | None]:
        """The command's events and why they are incomplete (None: complete)."""
        with self._lock:
            if self._events is None:
                if self._trace is None or self.tracer is None:
                    self._events = ([], "the tracer was not running when the command started")
                else:
                    self._events = self.tracer.collect(self._trace)
                    self._trace = None
            return self._events

    def remove(self) -> None:
        with self._lock:
            if self._trace is not None and self.tracer is not None:
                self.tracer.forget(self._trace)
                self._trace = None
            self._events = ([], "removed")


def _signal_text(code: int) -> str:
    sig = code & 0x7F
    if sig == 0:
        return f"exited with {(code >> 8) & 0xFF}"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    return f"killed by {name}" + (" (core dumped)" if code & 0x80 else "")


@dataclass(slots=True)
class _Call:
    code: int = -1
    ints: list[int] = field(default_factory=list)
    start: int = 0
    walk: list[bytes] = field(default_factory=list)
    walk_end: int | None = None
    ret: int | None = None
    end: int | None = None
    null: bool = False
    strings: dict[int, bytes] = field(default_factory=dict)
    sock: dict[int, tuple[int, int]] = field(default_factory=dict)
    child: int | None = None


_CLONES = ("clone", "clone3", "fork", "vfork")


def _ebpf_log(lines: Sequence[bytes], root: int) -> _Log:
    """strace's records (:class:`_Log`) of an eBPF trace's events (module
    :mod:`aospec.runtime.ebpf`, ``script``), with ``children`` from the tracer's fork events
    (host pids: nothing to pair); problems the trace shows are in ``log.problems``."""
    from aospec.runtime import ebpf

    specs = list(ebpf._SPECS.values())
    opaque = [name for _, name in ebpf._OPAQUE]
    kept = [len(ebpf._kept(roles)) for _, roles in specs]
    at_exit = [_first_path_at_exit(spec) for spec in specs]
    log = _Log()
    calls: dict[tuple[int, int], _Call] = {}
    forks: list[tuple[int, int, int]] = []  # (time, parent, child)

    def problem(text: str) -> None:
        if not log.problems:
            log.problems.append(text)

    for rec in lines:
        head = rec.split(b" ", 4)
        if len(head) < 4:
            problem(f"an unreadable tracer line: {rec[:80]!r}")
            break
        try:
            ts, tid, kind, rest = int(head[1]), int(head[2]), head[3], head[4] if len(head) > 4 else b""
            if kind == b"R":
                f = rest.split(b" ", 4)
                code = int(f[1])
                n = kept[code] if code < len(specs) else 0
                with_path = code < len(specs) and at_exit[code]
                f = rest.split(b" ", 4 + n) if (n or with_path) else rest.split(b" ")
                if ts == 0:
                    if code < len(specs) and specs[code][0] in _CLONES:
                        continue  # a new process's own return from the clone that made it
                    if tid == root:
                        continue  # bwrap's init setting up, in a call from before it was marked
                    problem("a call's end without its start")
                    break
                call = calls.setdefault((tid, ts), _Call(start=ts))
                if call.end is not None:
                    problem("two ends of one call")
                    break
                call.code, call.end, call.ret = code, int(f[0]), int(f[2])
                call.null = f[3] == b"1"
                call.ints = [int(x) for x in f[4 : 4 + n]]
                if with_path:
                    call.strings[0] = f[4 + n] if len(f) > 4 + n else b""
            elif kind == b"C":
                length, name = rest.split(b" ", 1)
                if len(name) != int(length):
                    problem("a file name longer than the tracer reads")
                    break
                calls.setdefault((tid, ts), _Call(start=ts)).walk.append(name)
            elif kind == b"W":
                calls.setdefault((tid, ts), _Call(start=ts)).walk_end = int(rest)
            elif kind == b"P":
                slot, _, text = rest.partition(b" ")
                calls.setdefault((tid, ts), _Call(start=ts)).strings[int(slot)] = text
            elif kind == b"A":
                slot, family, first = rest.split()
                calls.setdefault((tid, ts), _Call(start=ts)).sock[int(slot)] = (int(family), int(first))
            elif kind == b"K":
                child = int(rest)
                log.children.setdefault(tid, []).append(child)
                forks.append((ts, tid, child))
            elif kind == b"X":
                if int(rest) != tid:
                    problem("a thread other than the leader ran exec")
                    break
            elif kind == b"D":
                log.exits[tid] = _signal_text(int(rest))
            elif kind == b"Z":
                problem("a 32-bit or x32 system call (the tracer does not see those)")
                break
            elif kind == b"F":
                problem("the tracer's table of processes is full")
                break
            else:
                problem(f"an unknown tracer event {kind!r}")
                break
        except (ValueError, IndexError):
            problem(f"an unreadable tracer line: {rec[:80]!r}")
            break
    if log.problems:
        return log
    # each new process came from the clone its parent was in at the time
    clones = {}
    for (tid, _), call in calls.items():
        if call.end is not None and 0 <= call.code < len(specs) and specs[call.code][0] in _CLONES:
            clones.setdefault(tid, []).append(call)
    for ts, parent, child in forks:
        match = [c for c in clones.get(parent, ()) if c.start <= ts <= (c.end or 0)]
        if len(match) != 1 or match[0].child is not None:
            problem("a process started outside a clone call")
            return log
        match[0].child = child
    # a call without an end was cut short by its process's end (its result never used)
    for (tid, _), call in sorted(calls.items(), key=lambda kv: kv[1].end or 0):
        if call.end is None:
            continue
        rec = _ebpf_record(call, tid, specs, opaque, problem)
        if log.problems:
            return log
        if rec is None:
            continue
        log.records.append(rec)
        if rec.name in _CLONES and rec.ret is not None and rec.ret > 0:
            log.clones.append(rec)
    log.pids = {root, *log.exits, *(c for cs in log.children.values() for c in cs)}
    return log


def _first_path_at_exit(spec: tuple[str, tuple[str, ...]]) -> bool:
    """Whether a call's R line ends with its first path (read at exit; an exec's is read
    at entry)."""
    from aospec.runtime import ebpf

    name, roles = spec
    paths = [r for r in roles if r in ("path", "sock")]
    return bool(paths) and paths[0] == "path" and name not in ebpf._EXEC


def _walk_text(call: _Call, problem: Callable[[str], None]) -> str | None:
    """``<path>`` (strace's ``-y`` notation, hex) of the directory walked for the call, ""
    when the walk found no path (a pipe, a socket, a closed descriptor), None when there
    was no walk."""
    if call.walk_end is None:
        return None
    if call.walk_end == 3:
        problem("a directory deeper than the tracer walks")
        return None
    if call.walk_end != 1:
        return ""
    return "<" + _hex_bytes(b"/" + b"/".join(reversed(call.walk))) + ">"


def _hex_bytes(b: bytes) -> str:
    """strace's ``-xx`` notation of ``b`` (``\\xNN`` per byte; hex digits hold no x)."""
    return "\\x" + b.hex("x").replace("x", "\\x") if b else ""


def _ebpf_record(
    call: _Call, tid: int, specs: list[tuple[str, tuple[str, ...]]], opaque: list[str], problem: Callable[[str], None]
) -> _Record | None:
    from aospec.runtime import ebpf

    if call.code >= len(specs):
        name = opaque[call.code - len(specs)]
        return _Record(tid, name, [], call.ret, None, None, None, call.start, call.end or 0)
    name, roles = specs[call.code]
    if name == "openat2" and call.ret is not None and call.ret >= 0:
        problem("openat2 succeeded (its flags are not read)")
        return None
    kept = ebpf._kept(roles)
    if len(call.ints) != len(kept):
        problem(f"an unreadable {name} record")
        return None
    values: dict[int, int] = dict(zip(kept, call.ints, strict=True))
    paths = [i for i, r in enumerate(roles) if r in ("path", "sock")]
    slot_of = {i: s for s, i in enumerate(paths)}
    # which fd the walk is the path of: the descriptor of a descriptor-only call, else the
    # directory of the relative paths (one walk per call)
    walk = _walk_text(call, problem)
    args: list[str] = []
    extra: list[str] = []
    walked_fd: int | None = None
    if not paths and "fd" in roles:
        walked_fd = roles.index("fd")
    for i, r in enumerate(roles):
        if r == "path":
            text = call.strings.get(slot_of[i])
            if slot_of[i] == 0 and call.null:
                args.append("NULL")
                continue
            if text is None:
                problem(f"a {name} path the tracer did not print")
                return None
            if len(text) > ebpf.MAX_PATH:
                problem("a path longer than the tracer reads")
                return None
            if not text and not (
                values.get(roles.index("atflags"), 0) & ebpf._AT_EMPTY_PATH if "atflags" in roles else False
            ):
                # empty without AT_EMPTY_PATH: a path the tracer could not read (a page
                # reclaimed since the kernel read it) looks the same as a real ""
                problem(f"an empty {name} path")
                return None
            args.append('"' + _hex_bytes(text) + '"')
            if (name, i) in ebpf._UNRESOLVED:
                continue  # a symlink's target: not resolved by the call
            if not text.startswith(b"/"):
                d = ebpf._dirfd_of(roles, i)
                if walk is None:
                    problem("a relative path whose directory the tracer did not read")
                    return None
                if d is None:
                    if walk == "":
                        problem("a working directory outside the sandbox's root")
                        return None
                    extra.append("AT_FDCWD" + walk)
                elif walked_fd is None:
                    walked_fd = d
                elif values.get(d) != values.get(walked_fd):
                    problem("two relative paths of one call in different directories")
                    return None
        elif r == "sock":
            slot = slot_of[i]
            if slot in call.strings:
                addrlen = values.get(i + 1, 0)
                sun = call.strings[slot][: max(0, addrlen - 2)]
                args.append('{sa_family=AF_UNIX, sun_path="' + _hex_bytes(sun) + '"}')
            else:
                family, _first = call.sock.get(slot, (-1, 0))
                if family <= 0:
                    problem(f"a {name} address the tracer could not read")
                    return None
                args.append("{sa_family=AF_UNIX}" if family == ebpf._AF_UNIX else f"{{sa_family={family}}}")
        elif r == "fd":
            v = values[i]
            base = "AT_FDCWD" if v == ebpf.AT_FDCWD else str(v)
            args.append(base)  # its path is added below, once the walked descriptor is known
        elif r == "oflags":
            args.append(ebpf._names(values[i], ebpf._O_FLAGS))
        elif r == "atflags":
            args.append(ebpf._names(values[i], ebpf._AT_FLAGS))
        elif r == "clone":
            args.append("flags=" + ebpf._names(values[i], ebpf._CLONE_FLAGS))
        elif r == "int":
            args.append(str(values.get(i, 0)))
        else:
            args.append("0x0")
    if walked_fd is not None and walk == "" and values[walked_fd] == ebpf.AT_FDCWD:
        problem("a working directory outside the sandbox's root")
        return None
    if walked_fd is not None and walk:
        args[walked_fd] += walk
        # another descriptor argument with the same value names the same directory
        for i, r in enumerate(roles):
            if r == "fd" and i != walked_fd and values[i] == values[walked_fd]:
                args[i] += walk
    return _Record(tid, name, args + extra, call.ret, None, call.child, None, call.start, call.end or 0)
