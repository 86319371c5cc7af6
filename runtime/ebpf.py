"""A read-set tracer that does not stop the traced process: bpftrace on the syscall tracepoints.

strace (``aospec.runtime.readsets``) stops the command at every traced system call, two
context switches to the tracer and back each, which multiplies the CPU of commands that
look up many paths (Python's start-up, gcc's ``readlink`` of every path component). This
tracer records the same calls from eBPF programs attached to the kernel's
``syscalls:sys_enter_*`` / ``sys_exit_*`` tracepoints: the process never waits for it.

One bpftrace process per aospec process (:class:`EbpfTracer`, started on first use and
kept until the process exits; it dies with it) serves every traced command. A command is
traced from its sandbox's init on: while the init waits on bubblewrap's block descriptor,
this process *marks* its host pid with a ``setpriority`` call whose ``which`` is a random
number of this tracer's (``EINVAL``: it changes nothing; only calls from this process
count, so a sandboxed command cannot mark anything); the eBPF side keeps a map of marked
threads, and every process or thread a marked one creates (``sched_process_fork``) is
marked with the same trace id. Per marked thread it prints:

- at a traced call's entry, its integer arguments and, for a relative path (or a call on
  a descriptor), the directory it is relative to, walked up from the descriptor's or the
  working directory's dentry to the process's root in the kernel (as strace's ``-y``
  prints it, but at the call, so a later rename cannot change it);
- at its exit, the return value and the path strings, read then because the kernel has
  just copied them itself (at entry a string on a page not yet touched cannot be read
  from eBPF);
- new processes (host pids, so nothing has to be paired as strace's PID-namespace pids
  are), ``exec`` and exits with their status.

Each line starts with a random token of this tracer, so a path holding a newline cannot
forge a line. Lines come from per-CPU buffers: they are ordered by their timestamps, and a
trace is read only after a *flush*: this process makes a marker call on every CPU it may
run on and waits until bpftrace has printed each (a CPU's buffer is in order). The trace is
then converted to strace's records and read by the same code as strace's log
(:func:`aospec.runtime.readsets.read_set`), with every check it makes.

Untracked (the fork falls back to plain JASV), besides strace's reasons: events lost
(bpftrace reports it), a map full, a 32-bit or x32 system call (the tracepoints do not see
them), a path longer than :data:`MAX_PATH` bytes or a name longer than the tracer reads, a
directory whose walk to the root does not end, a call still in progress when its process
ended, an ``exec`` from a thread other than the leader, a call the read set does not
understand that succeeded (``getxattrat`` and other calls newer than strace's table).

Where it works: root (CAP_BPF and CAP_PERFMON), bpftrace 0.17 or later, the kernel's BTF
(``/sys/kernel/btf/vmlinux``) and tracefs mounted (``/sys/kernel/tracing``); the probe
(:func:`ebpf_support`) also checks ``struct mount``'s layout and traces one command.
bpftrace starts in a mount namespace of its own where tracefs's ``available_events`` is a
snapshot (:func:`_launch`: half of its start's CPU was re-reading that generated file).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aospec.protocols import HostMonitor

__all__ = [
    "MAX_PATH",
    "EbpfSupport",
    "EbpfTrace",
    "EbpfTracer",
    "ebpf_support",
    "service_pids",
    "stop_tracer",
    "tracer",
]

#: Paths longer than this (bpftrace's strings hold 199 bytes: one that fills them may be
#: cut) make the command untracked.
MAX_PATH = 198
_STRLEN = 200  # bpftrace's BPFTRACE_STRLEN (its maximum in 0.17): strings of up to 199 bytes
_MAX_DEPTH = 64  # directory components walked
_MAP_KEYS = 1 << 16
#: Events a trace may hold before it is given up (untracked).
MAX_EVENTS = 4_000_000
_START_TIMEOUT_S = 60.0
_FLUSH_TIMEOUT_S = 10.0
AT_FDCWD = -100

# Roles of a call's arguments, in strace's order: "fd" a directory descriptor (or the
# descriptor a call works on), "path" a path string, "int" an integer shown as is,
# "oflags" open flags, "atflags" *at flags, "clone" clone flags, "sock" a socket address,
# "x" not needed (a pointer).
#
# tracepoint name -> (strace's name, roles, which path is relative to which fd: for each
# path role, the index of its fd role or None for the working directory)
_SPECS: dict[str, tuple[str, tuple[str, ...]]] = {
    "open": ("open", ("path", "oflags", "int")),
    "creat": ("creat", ("path", "int")),
    "openat": ("openat", ("fd", "path", "oflags", "int")),
    "openat2": ("openat2", ("fd", "path", "x", "int")),
    "newstat": ("stat", ("path", "x")),
    "newlstat": ("lstat", ("path", "x")),
    "newfstatat": ("newfstatat", ("fd", "path", "x", "atflags")),
    "statx": ("statx", ("fd", "path", "atflags", "int", "x")),
    "access": ("access", ("path", "int")),
    "faccessat": ("faccessat", ("fd", "path", "int")),
    "faccessat2": ("faccessat2", ("fd", "path", "int", "atflags")),
    "readlink": ("readlink", ("path", "x", "int")),
    "readlinkat": ("readlinkat", ("fd", "path", "x", "int")),
    "chdir": ("chdir", ("path",)),
    "fchdir": ("fchdir", ("fd",)),
    "execve": ("execve", ("path", "x", "x")),
    "execveat": ("execveat", ("fd", "path", "x", "x", "atflags")),
    "statfs": ("statfs", ("path", "x")),
    "mkdir": ("mkdir", ("path", "int")),
    "mkdirat": ("mkdirat", ("fd", "path", "int")),
    "mknod": ("mknod", ("path", "int", "int")),
    "mknodat": ("mknodat", ("fd", "path", "int", "int")),
    "unlink": ("unlink", ("path",)),
    "unlinkat": ("unlinkat", ("fd", "path", "atflags")),
    "rmdir": ("rmdir", ("path",)),
    "chmod": ("chmod", ("path", "int")),
    "fchmodat": ("fchmodat", ("fd", "path", "int")),
    "fchmodat2": ("fchmodat2", ("fd", "path", "int", "atflags")),
    "chown": ("chown", ("path", "int", "int")),
    "lchown": ("lchown", ("path", "int", "int")),
    "fchownat": ("fchownat", ("fd", "path", "int", "int", "atflags")),
    "truncate": ("truncate", ("path", "int")),
    "utime": ("utime", ("path", "x")),
    "utimes": ("utimes", ("path", "x")),
    "utimensat": ("utimensat", ("fd", "path", "x", "atflags")),
    "futimesat": ("futimesat", ("fd", "path", "x")),
    "getxattr": ("getxattr", ("path", "x", "x", "int")),
    "lgetxattr": ("lgetxattr", ("path", "x", "x", "int")),
    "listxattr": ("listxattr", ("path", "x", "int")),
    "llistxattr": ("llistxattr", ("path", "x", "int")),
    "setxattr": ("setxattr", ("path", "x", "x", "int", "int")),
    "lsetxattr": ("lsetxattr", ("path", "x", "x", "int", "int")),
    "removexattr": ("removexattr", ("path", "x")),
    "lremovexattr": ("lremovexattr", ("path", "x")),
    "rename": ("rename", ("path", "path")),
    "renameat": ("renameat", ("fd", "path", "fd", "path")),
    "renameat2": ("renameat2", ("fd", "path", "fd", "path", "int")),
    "link": ("link", ("path", "path")),
    "linkat": ("linkat", ("fd", "path", "fd", "path", "atflags")),
    "symlink": ("symlink", ("path", "path")),
    "symlinkat": ("symlinkat", ("path", "fd", "path")),
    "getdents": ("getdents", ("fd", "x", "int")),
    "getdents64": ("getdents64", ("fd", "x", "int")),
    "clone": ("clone", ("clone", "x", "x", "x", "x")),
    "clone3": ("clone3", ("x", "int")),
    "fork": ("fork", ()),
    "vfork": ("vfork", ()),
    "connect": ("connect", ("int", "sock", "int")),
    "bind": ("bind", ("int", "sock", "int")),
}
#: Calls that take a path but that the read set does not model: untracked when they
#: succeed (the read set's own list of calls outside the files, and calls newer than it).
_OPAQUE = (
    ("chroot", "chroot"),
    ("mount", "mount"),
    ("umount", "umount2"),
    ("pivot_root", "pivot_root"),
    ("swapon", "swapon"),
    ("swapoff", "swapoff"),
    ("quotactl", "quotactl"),
    ("acct", "acct"),
    ("uselib", "uselib"),
    ("inotify_add_watch", "inotify_add_watch"),
    ("fanotify_mark", "fanotify_mark"),
    ("name_to_handle_at", "name_to_handle_at"),
    ("open_by_handle_at", "open_by_handle_at"),
    ("open_tree", "open_tree"),
    ("open_tree_attr", "open_tree_attr"),
    ("move_mount", "move_mount"),
    ("fspick", "fspick"),
    ("fsconfig", "fsconfig"),
    ("mount_setattr", "mount_setattr"),
    ("getxattrat", "getxattrat"),
    ("setxattrat", "setxattrat"),
    ("listxattrat", "listxattrat"),
    ("removexattrat", "removexattrat"),
    ("file_getattr", "file_getattr"),
    ("file_setattr", "file_setattr"),
    ("quotactl_fd", "quotactl_fd"),
    # io_uring's opens and stats bypass the system calls (the sandbox's filter refuses it)
    ("io_uring_setup", "io_uring_setup"),
)

_O_FLAGS = ((0o1, "O_WRONLY"), (0o2, "O_RDWR"), (0o100, "O_CREAT"), (0o1000, "O_TRUNC"), (0o2000, "O_APPEND"))
_AT_FLAGS = (
    (0x100, "AT_SYMLINK_NOFOLLOW"),
    (0x200, "AT_REMOVEDIR"),
    (0x400, "AT_SYMLINK_FOLLOW"),
    (0x1000, "AT_EMPTY_PATH"),
)
_CLONE_FLAGS = ((0x200, "CLONE_FS"), (0x400, "CLONE_FILES"), (0x10000, "CLONE_THREAD"), (0x800000, "CLONE_UNTRACED"))
_AF_UNIX = 1


def _names(value: int, table: Sequence[tuple[int, str]]) -> str:
    names = [n for bit, n in table if value & bit]
    return "|".join(names) if names else str(value)


# --------------------------------------------------------------------------- the script


def _walk(*, tok: str, fd: str | None) -> str:
    """bpftrace code printing the path of descriptor ``fd`` (an expression; None: the
    working directory) as components, leaf first (C), then how the walk ended (W): 1 at the
    process's root, 2 no path (a pipe, a socket, outside the root), 3 too deep, 0 no such
    descriptor. The lines carry the call's id (``$ts``, its entry time)."""
    if fd is None:
        start = "$d = $t->fs->pwd.dentry; $m = $t->fs->pwd.mnt; $ok = 4;"
    else:
        start = (
            f"$fd = (int64){fd}; $ok = 0; "
            f"if ($fd == {AT_FDCWD}) {{ $d = $t->fs->pwd.dentry; $m = $t->fs->pwd.mnt; $ok = 4; }} "
            f"else {{ $fdt = $t->files->fdt; "
            f"if ($fd >= 0 && $fd < (int64)$fdt->max_fds) {{ "
            f"$f = (struct file *)*(uint64 *)((uint64)$fdt->fd + 8 * (uint64)$fd); "
            f"if ((uint64)$f != 0) {{ $d = $f->f_path.dentry; $m = $f->f_path.mnt; $ok = 4; }} }} }}"
        )
    return (
        f"$t = curtask; $d = (struct dentry *)0; $m = (struct vfsmount *)0; {start} "
        f"if ($ok == 4) {{ $rd = $t->fs->root.dentry; $rm = $t->fs->root.mnt; $i = 0; $ok = 3; "
        f"while ($i < {_MAX_DEPTH}) {{ "
        f"if ($d == $rd && $m == $rm) {{ $ok = 1; break; }} "
        f"if ($d == $m->mnt_root) {{ "
        f"$mm = (struct mount *)((uint64)$m - MOUNT_OFF); "
        f"if ((uint64)$mm->mnt_parent == (uint64)$mm) {{ $ok = 2; break; }} "
        f"$d = $mm->mnt_mountpoint; $m = (struct vfsmount *)((uint64)$mm->mnt_parent + MOUNT_OFF); }} "
        # a dentry that is its own parent but no mount's root: a pipe's, a socket's (no path)
        f"else {{ if ((uint64)$d == 0 || $d == $d->d_parent) {{ $ok = 2; break; }} "
        f'printf("{tok} %llu %llu %d C %u %s|{tok}\\n", @t[tid], $ts, tid, $d->d_name.len, '
        f"str($d->d_name.name)); $d = $d->d_parent; }} "
        f"$i++; }} }} "
        f'printf("{tok} %llu %llu %d W %d|{tok}\\n", @t[tid], $ts, tid, $ok);'
    )


def script(token: str, magic: int, owner: int, mount_off: int, available: dict[str, list[str]]) -> str:
    """The bpftrace program: ``token`` starts and ends every line, ``magic`` is the
    ``which`` of this tracer's marker calls (only from process ``owner``), ``mount_off`` the
    offset of ``struct mount``'s ``mnt``; ``available`` the syscall tracepoints this kernel
    has, with their argument names (:func:`syscall_fields`).

    Lines: ``TOKEN ID TS TID KIND ...|TOKEN``. A call is one line at its exit (R: its entry
    time as TS, exit time, code, return value, integer arguments, and its first path as the
    rest), its directory walk at entry (C, W), a second path at exit (P); processes: K (a
    new one), X (exec), D (exit status); problems: Z (a 32-bit call), F (a full map)."""
    tok = token
    out: list[str] = []
    # marks: setpriority(magic, pid, id) marks pid with trace id (only from the owner)
    out.append(
        f"tracepoint:syscalls:sys_enter_setpriority /pid == {owner} && args->which == {magic}/ "
        f"{{ @t[args->who] = (uint64)args->niceval; "
        f'if (@t[args->who] != (uint64)args->niceval) {{ printf("{tok} %llu %llu %d F|{tok}\\n", '
        f"(uint64)args->niceval, nsecs, args->who); }} }}"
    )
    out.append(
        f"tracepoint:sched:sched_process_fork /@t[args->parent_pid]/ "
        f"{{ $id = @t[args->parent_pid]; @t[args->child_pid] = $id; "
        f'if (@t[args->child_pid] != $id) {{ printf("{tok} %llu %llu %d F|{tok}\\n", $id, nsecs, args->child_pid); }} '
        f'printf("{tok} %llu %llu %d K %d|{tok}\\n", $id, nsecs, args->parent_pid, args->child_pid); }}'
    )
    out.append(
        # a thread other than the leader that runs exec takes the leader's pid (whose mark
        # went with the leader's exit): the mark follows it, and the X line says so
        f"tracepoint:sched:sched_process_exec /@t[args->old_pid] || @t[tid]/ "
        f"{{ $id = @t[args->old_pid]; if ($id == 0) {{ $id = @t[tid]; }} @t[tid] = $id; "
        f"if (args->old_pid != tid) {{ delete(@t[args->old_pid]); }} "
        f'printf("{tok} %llu %llu %d X %d|{tok}\\n", $id, nsecs, tid, args->old_pid); }}'
    )
    used = {len(_kept(roles)) for tp, (_, roles) in _SPECS.items() if tp in available} - {0}
    maps = "".join(
        f"delete(@{m}[tid]); " for m in ("ts", "sc", "p0", "p1", "rel", "xfd", *(f"n{k}" for k in sorted(used)))
    )
    out.append(
        f"tracepoint:sched:sched_process_exit /@t[tid]/ "
        f'{{ printf("{tok} %llu %llu %d D %d|{tok}\\n", @t[tid], nsecs, tid, curtask->exit_code); '
        f"delete(@t[tid]); {maps}}}"
    )
    # 32-bit and x32 calls: the syscalls:* tracepoints do not fire for them
    out.append(
        f"tracepoint:raw_syscalls:sys_enter /@t[tid] && (args->id >= 0x40000000 || "
        f"(curtask->thread_info.status & 2))/ "
        f'{{ printf("{tok} %llu %llu %d Z %d|{tok}\\n", @t[tid], nsecs, tid, args->id); }}'
    )
    for code, (tp, (_name, roles)) in enumerate(_SPECS.items()):
        if tp not in available:
            continue
        fields = available[tp]
        if len(fields) != len(roles):
            raise RuntimeError(f"sys_enter_{tp} has arguments {fields}, the tracer expects {len(roles)}")
        out.extend(_probes(tok, code, tp, roles, fields))
    base = len(_SPECS)
    for i, (tp, _name) in enumerate(_OPAQUE):
        if tp not in available:
            continue
        code = base + i
        out.append(f"tracepoint:syscalls:sys_enter_{tp} /@t[tid]/ {{ @ts[tid] = nsecs; @sc[tid] = {code + 1}; }}")
        out.append(
            f"tracepoint:syscalls:sys_exit_{tp} /@t[tid] && @sc[tid] == {code + 1}/ "
            f'{{ printf("{tok} %llu %llu %d R %llu {code} %lld 0|{tok}\\n", @t[tid], @ts[tid], tid, nsecs, args->ret); }}'
        )
    # last, so that once its markers come back every probe above is attached; it pads the
    # output past bpftrace's buffer so that the markers are written at once
    pad = "".join(f'printf("{tok} 0 0 0 _ {"." * (_STRLEN - 1)}|{tok}\\n"); ' for _ in range(_FLUSH_PAD_LINES))
    out.append(
        f"tracepoint:syscalls:sys_enter_setpriority /pid == {owner} && args->which == {magic + 1}/ "
        f'{{ printf("{tok} 0 %llu %d B %d %d|{tok}\\n", nsecs, tid, args->who, cpu); {pad}}}'
    )
    return "\n".join(out).replace("MOUNT_OFF", str(mount_off)) + "\n"


#: Lines of padding after a flush marker: more than bpftrace's output buffer (8 KiB).
_FLUSH_PAD_LINES = 48
#: Calls whose path is read at entry (their exit is in a new address space) and whose
#: directory is walked at exit (an exec does not change the working directory).
_EXEC = ("execve", "execveat")
#: Paths a call does not resolve (a symlink's target): no directory is walked for them.
_UNRESOLVED = {("symlink", 0), ("symlinkat", 0)}
#: The flag that makes an empty path name the descriptor itself.
_AT_EMPTY_PATH = 0x1000
#: stat calls that also stat an open descriptor (fstat): those are left out.
_FSTAT = ("newfstatat", "statx")


def _kept(roles: tuple[str, ...]) -> list[int]:
    """The integer arguments the read set needs (descriptors and flags, a socket
    address's length), by position; the others are not kept (a program's stack is small)."""
    return [
        i
        for i, r in enumerate(roles)
        if r in ("fd", "oflags", "atflags", "clone") or (r == "int" and i > 0 and roles[i - 1] == "sock")
    ]


def _probes(tok: str, code: int, tp: str, roles: tuple[str, ...], fields: Sequence[str]) -> list[str]:
    """The probes of one call: at entry, its arguments kept by thread and the directory of
    a relative path walked; at exit, one R line (and a P line for a second path)."""
    ints = _kept(roles)
    load = "$ts = nsecs; " + "".join(
        f"$a{i} = (int64){'(int32)' if roles[i] == 'fd' else ''}args->{fields[i]}; " for i in range(len(roles))
    )
    paths = [i for i, r in enumerate(roles) if r in ("path", "sock")]
    # which call the thread is in: a call the sandbox's seccomp filter refuses has an exit
    # but no entry (the kernel skips the entry tracepoint), and must not pass as the last one
    enter = [load, f"@ts[tid] = $ts; @sc[tid] = {code + 1}; "]
    enter += [f"@p{slot}[tid] = (uint64)$a{i}; " for slot, i in enumerate(paths)]
    if len(ints) == 1:
        enter.append(f"@n1[tid] = $a{ints[0]}; ")
    elif ints:
        enter.append(f"@n{len(ints)}[tid] = ({', '.join(f'$a{i}' for i in ints)}); ")
    # the one directory walked: the descriptor of a descriptor-only call, or the directory
    # of the first relative path (a second path's only when relative to the same directory:
    # the read set finds a second walk missing and leaves the command untracked)
    walk = ""
    fd_roles = [i for i, r in enumerate(roles) if r == "fd"]
    if not paths and fd_roles:
        walk = _walk(tok=tok, fd=f"$a{fd_roles[0]}")
    else:
        conds = []
        dirfd = None
        for i in paths:
            if roles[i] != "path" or (tp, i) in _UNRESOLVED:
                continue
            d = _dirfd_of(roles, i)
            if conds and d != dirfd and not (d is not None and dirfd is not None):
                break
            if conds and d is not None and dirfd is not None:
                conds.append(f"($a{d} == $a{dirfd} && *(uint8 *)uptr($a{i}) != 47)")
                continue
            dirfd = d
            conds.append(f"*(uint8 *)uptr($a{i}) != 47")
        if conds:
            rel = " || ".join(f"({c})" for c in conds)
            if tp in _FSTAT:
                rel = f"({rel}) && !(*(uint8 *)uptr($a1) == 0 && ($a{roles.index('atflags')} & {_AT_EMPTY_PATH:#x}) && $a0 >= 0)"
            walk = f"if ({rel}) {{ {_walk(tok=tok, fd=None if dirfd is None else f'$a{dirfd}')} }} "
    probes = []
    walk_exit = ""
    if tp in _EXEC:
        # the path now (gone with the old address space at exit); its directory walked at
        # exit (an exec keeps the working directory; a descriptor closed on exec has none)
        i = paths[0]
        d = _dirfd_of(roles, i)
        enter.append(f"@rel[tid] = *(uint8 *)uptr($a{i}) != 47; ")
        if d is not None:
            enter.append(f"@xfd[tid] = $a{d}; ")
        enter.append(f'printf("{tok} %llu %llu %d P 0 %s|{tok}\\n", @t[tid], $ts, tid, str(uptr($a{i}))); ')
        walk_exit = f"if (@rel[tid]) {{ $ts = @ts[tid]; {_walk(tok=tok, fd=None if d is None else '@xfd[tid]')} }} "
        probes.append(f"tracepoint:syscalls:sys_enter_{tp} /@t[tid]/ {{ {''.join(enter)}}}")
    else:
        probes.append(f"tracepoint:syscalls:sys_enter_{tp} /@t[tid]/ {{ {''.join(enter)}{walk}}}")
    # exit: R line, the integers, then the first path read now
    n = len(ints)
    vals = "" if n == 0 else (", @n1[tid]" if n == 1 else "".join(f", $v.{k}" for k in range(n)))
    get = f"$v = @n{n}[tid]; " if n > 1 else ""
    fmt = "".join(" %lld" for _ in range(n))
    first_path = paths[0] if paths and roles[paths[0]] == "path" and tp not in _EXEC else None
    if first_path is not None:
        # "R TS_EXIT CODE RET NULL INTS... PATH": NULL 1 for a NULL path pointer
        line = (
            f"$s = @p0[tid]; "
            f'printf("{tok} %llu %llu %d R %llu {code} %lld %d{fmt} %s|{tok}\\n", @t[tid], @ts[tid], tid, '
            f"nsecs, args->ret, $s == 0{vals}, str(uptr($s))); "
        )
    else:
        line = (
            f'printf("{tok} %llu %llu %d R %llu {code} %lld 0{fmt}|{tok}\\n", @t[tid], @ts[tid], tid, '
            f"nsecs, args->ret{vals}); "
        )
    exit_body = get + line + walk_exit
    if tp in _FSTAT:
        # fstat(fd) (an empty path with AT_EMPTY_PATH): the file was opened by a traced
        # call (or is not a file), its path is in the read set already: no line (a third of
        # Python's calls). Decided at exit, when the string has been read by the kernel.
        flags = ints.index(roles.index("atflags"))
        exit_body = f"{get}if (!(*(uint8 *)uptr(@p0[tid]) == 0 && ($v.{flags} & {_AT_EMPTY_PATH:#x}) && $v.0 >= 0)) {{ {line} }} "
    only = f"/@t[tid] && @sc[tid] == {code + 1}/"
    probes.append(f"tracepoint:syscalls:sys_exit_{tp} {only} {{ {exit_body}}}")
    for slot, i in enumerate(paths):
        if (slot == 0 and roles[i] == "path") or tp in _EXEC:
            continue
        p = f"@p{slot}[tid]"
        if roles[i] == "sock":
            # sa_family and the first byte of sun_path, then sun_path unless abstract
            body = (
                f"$s = {p}; "
                f"if (*(uint16 *)uptr($s) == {_AF_UNIX} && *(uint8 *)uptr($s + 2) != 0) {{ "
                f'printf("{tok} %llu %llu %d P {slot} %s|{tok}\\n", @t[tid], @ts[tid], tid, str(uptr($s + 2))); }} '
                f'else {{ printf("{tok} %llu %llu %d A {slot} %d %d|{tok}\\n", @t[tid], @ts[tid], tid, '
                f"*(uint16 *)uptr($s), *(uint8 *)uptr($s + 2)); }} "
            )
        else:
            body = (
                f"$s = {p}; if ($s != 0) {{ "
                f'printf("{tok} %llu %llu %d P {slot} %s|{tok}\\n", @t[tid], @ts[tid], tid, str(uptr($s))); }} '
            )
        probes.append(f"tracepoint:syscalls:sys_exit_{tp} {only} {{ {body}}}")
    return probes


def _dirfd_of(roles: tuple[str, ...], i: int) -> int | None:
    """The fd role a path role is relative to: the fd argument right before it (the
    *at calls), else None (the working directory)."""
    if i > 0 and roles[i - 1] == "fd":
        return i - 1
    return None


_FIELD = re.compile(r"^\s*field:([^;]*?)\s+\**(\w+)(?:\[\d*\])?;\s*offset:(\d+);")


def syscall_fields(tracefs: str) -> dict[str, list[str]]:
    """tracepoint name -> its argument names in order, for the syscalls this tracer
    uses that have tracepoints under ``tracefs``."""
    out: dict[str, list[str]] = {}
    for tp in [*_SPECS, *(t for t, _ in _OPAQUE)]:
        try:
            with open(os.path.join(tracefs, "events", "syscalls", f"sys_enter_{tp}", "format")) as f:
                text = f.read()
        except OSError:
            continue
        names = [m.group(2) for line in text.splitlines() if (m := _FIELD.match(line))]
        out[tp] = names[names.index("__syscall_nr") + 1 :] if "__syscall_nr" in names else []
    return out


# ------------------------------------------------------------------ bpftrace's start

#: bpftrace 0.17 reads tracefs's ``available_events`` again for every probe in every pass
#: (5,800 reads of 62 KB for this script), a file the kernel generates on each read: half
#: of its start's CPU. It starts in a mount namespace of its own where that file is a
#: snapshot of the lines its probes name (a regular file on a tmpfs of that namespace's
#: own: :func:`_launch`).
_EVENTS = "available_events"
#: Sets that namespace up (binds the snapshot, drops every mount bpftrace does not need: a
#: copied sandbox mount would stay alive there) and execs bpftrace; stdlib only, run with
#: ``-I -S``.
_NS_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mntns.py")
_PROBE = re.compile(r"^tracepoint:([^:\s]+):([^\s/{]+)", re.M)
_namespaced: str | None = None  # "" where they work, else why not


def events_snapshot(text: str, tracefs: str) -> bytes:
    """The lines of ``tracefs``'s ``available_events`` that the bpftrace program ``text``
    attaches to (a probe the kernel lacks stays missing: bpftrace fails on it as before)."""
    named = {f"{cat}:{name}" for cat, name in _PROBE.findall(text)}
    with open(os.path.join(tracefs, _EVENTS), "rb") as f:
        lines = f.read().splitlines()
    return b"".join(line + b"\n" for line in lines if line.decode(errors="replace") in named)


def _helper(*args: str) -> list[str]:
    """The command line that runs the namespace helper (runtime/_mntns.py) with ``args``
    in a mount namespace of its own."""
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "--", sys.executable, "-I", "-S", _NS_HELPER, *args]


def namespace_problem() -> str:
    """Why bpftrace cannot start in a mount namespace of its own here ("" where it can):
    util-linux's ``unshare`` and the helper are run once per process, the helper dropping
    every mount bpftrace does not need before running ``true``."""
    global _namespaced
    if _namespaced is None:
        true = shutil.which("true")
        if not shutil.which("unshare") or not true or not sys.executable or not os.path.isfile(_NS_HELPER):
            _namespaced = "no unshare (util-linux), true or Python executable here"
        else:
            try:
                out = subprocess.run(_helper("", "--", true), stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
                why = out.stderr.decode(errors="replace").strip().splitlines()
                _namespaced = "" if out.returncode == 0 else (why[-1] if why else f"exit status {out.returncode}")
            except (OSError, subprocess.SubprocessError) as exc:
                _namespaced = str(exc)
    return _namespaced


def _namespaces_work() -> bool:
    return not namespace_problem()


def _launch(bpftrace: str, args: Sequence[str], events: str | None) -> list[str]:
    """The command line that runs bpftrace with ``args``: in a private mount namespace
    where every tracefs ``available_events`` is a file holding ``events`` and no mount is
    left but those bpftrace needs (``/``, ``/usr``, ``/proc``, ``/sys``, ``/dev``, ...:
    runtime/_mntns.py; the same process: unshare and the helper exec into bpftrace), or
    plainly (``events`` None). The namespace holds no copy of a sandbox's mounts: a copy
    would keep them alive after they are unmounted here (an overlay commit's remount of its
    upper would fail)."""
    if events is None:
        return [bpftrace, *args]
    targets = [p for t in _TRACEFS if os.path.exists(p := os.path.join(t, _EVENTS))]
    return _helper(events, *targets, "--", bpftrace, *args)


# --------------------------------------------------------------------------- the tracer

_libc = ctypes.CDLL(None, use_errno=True)
_LOST = re.compile(rb"\nLost \d+ events")


def _setpriority(which: int, who: int, value: int) -> None:
    _libc.setpriority(ctypes.c_int(which), ctypes.c_uint(who), ctypes.c_int(value))


@dataclass
class EbpfTrace:
    """One traced command (from its sandbox's init, host pid ``root``): its id in the
    tracer's lines, where its lines may start in the tracer's output (``start``, a chunk
    index), and ``problem`` when it cannot be complete (events lost, the tracer gone)."""

    id: int
    root: int
    start: int
    lost_mark: int = 0
    problem: str | None = None


#: Output the tracer keeps for traces not collected yet before giving them up.
MAX_BUFFERED_BYTES = 512 << 20


class EbpfTracer:
    """The process's bpftrace (module docstring). :meth:`start` runs it and waits until
    its probes are attached; :meth:`mark` starts a trace at a (blocked) process,
    :meth:`collect` flushes and hands over its lines, :meth:`forget` drops one.

    The reader thread only keeps bpftrace's output (complete lines, in chunks) while a
    trace may need it, and watches it for flush markers and lost events; a trace's lines
    are picked out when it is collected (in the fork's task, off the committed path)."""

    def __init__(self, bpftrace: str, tracefs: str, mount_off: int, *, snapshot: bool = True) -> None:
        self.bpftrace = bpftrace
        self.snapshot = snapshot  # start on an available_events snapshot where it can
        self.tracefs = tracefs
        self.mount_off = mount_off
        self.token = secrets.token_hex(8)
        self._tok = self.token.encode() + b" "
        self._end = b"|" + self.token.encode() + b"\n"
        self.magic = 0x10000000 + secrets.randbelow(0x40000000)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._traces: dict[int, EbpfTrace] = {}
        self._next_id = 1
        self._chunks: list[bytes] = []
        self._base = 0  # the index of _chunks[0] in all chunks read
        self._buffered = 0
        self._flushes: dict[int, set[int]] = {}
        self._flush_seq = 0
        self._lost = 0  # times bpftrace reported lost events
        self._proc: subprocess.Popen[bytes] | None = None
        #: bpftrace was started in a namespace where available_events is a snapshot
        self.snapshotted = False
        self._dead: str | None = None
        self._stderr: list[str] = []

    # -------------------------------------------------------------- running bpftrace

    def start(self) -> None:
        fields = syscall_fields(self.tracefs)
        text = script(self.token, self.magic, os.getpid(), self.mount_off, fields)
        env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "BPFTRACE_STRLEN": str(_STRLEN),
            "BPFTRACE_MAP_KEYS_MAX": str(_MAP_KEYS),
            "BPFTRACE_PERF_RB_PAGES": "1024",
            "BPFTRACE_NO_USER_SYMBOLS": "1",
            # newer bpftrace marks a cut string with "..": the length checks need it bare
            "BPFTRACE_STR_TRUNC_TRAILER": "",
        }
        ready = threading.Event()
        failed: list[BaseException] = []
        events = self._snapshot(text)
        argv = _launch(self.bpftrace, ["-B", "full", "-e", text], events)
        self.snapshotted = events is not None

        def run() -> None:
            # bpftrace dies with this thread (PR_SET_PDEATHSIG), which lives as long as
            # the process: it reads bpftrace's output
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            except OSError as exc:
                failed.append(exc)
                ready.set()
                return
            with _launched_lock:
                _launched.append(self._proc)
            threading.Thread(target=self._read_stderr, name="aospec-bpftrace-err", daemon=True).start()
            ready.set()
            self._read_stdout()

        threading.Thread(target=run, name="aospec-bpftrace", daemon=True).start()
        ready.wait()
        if failed:
            raise failed[0]
        atexit.register(self.stop)
        # attached once a flush marker comes back (its probe is the script's last)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                self.flush(timeout_s=0.5)
                return
            except TimeoutError:
                if self._dead is not None or time.monotonic() > deadline:
                    self.stop()
                    why = self._dead or f"no output within {_START_TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"bpftrace did not start: {why}") from None

    def _snapshot(self, text: str) -> str | None:
        """The ``available_events`` lines ``text`` names, or None where bpftrace must read
        tracefs's own (no mount namespaces here, or tracefs unreadable)."""
        if not self.snapshot or not _namespaces_work():
            return None
        try:
            return events_snapshot(text, self.tracefs).decode(errors="replace")
        except OSError:
            return None

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for raw in self._proc.stderr:
            line = raw.decode(errors="replace").strip()
            if "Lost" in line and "events" in line:
                with self._cond:
                    self._lost += 1
            elif line.startswith(("ERROR", "error")) and "RLIMIT_MEMLOCK" not in line:
                with self._cond:
                    self._stderr.append(line)
                    del self._stderr[:-20]

    def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        out = self._proc.stdout
        end = self._end
        pending = b""
        while True:
            chunk = out.read1(1 << 20)
            if not chunk:
                break
            data = pending + chunk
            cut = data.rfind(end)
            if cut < 0:
                pending = data
                continue
            done, pending = data[: cut + len(end)], data[cut + len(end) :]
            with self._cond:
                if b"Lost " in done and _LOST.search(b"\n" + done):
                    # bpftrace's own line between records (or a path that looks like one:
                    # then this is only too careful)
                    self._lost += 1
                self._markers(done)
                if self._traces:
                    self._chunks.append(done)
                    self._buffered += len(done)
                    if self._buffered > MAX_BUFFERED_BYTES:
                        for t in self._traces.values():
                            t.problem = t.problem or "the tracer's output outgrew its buffer"
                        self._drop(self._base + len(self._chunks))
                else:
                    self._base += 1  # nobody needs it
        with self._cond:
            code = self._proc.wait()
            self._dead = f"bpftrace exited ({code}): {'; '.join(self._stderr[-3:])}"
            for t in self._traces.values():
                t.problem = t.problem or "the tracer stopped"
            self._cond.notify_all()

    def _markers(self, data: bytes) -> None:
        """Note the flush markers in ``data`` ("TOKEN 0 TS TID B SEQ CPU|TOKEN")."""
        needle = self._tok + b"0 "
        at = data.find(needle)
        while at >= 0:
            stop = data.find(self._end, at)
            f = data[at + len(needle) : stop].split()
            if len(f) == 5 and f[2] == b"B":
                seen = self._flushes.get(int(f[3]))
                if seen is not None:
                    seen.add(int(f[4]))
                    self._cond.notify_all()
            at = data.find(needle, stop)

    def _drop(self, upto: int) -> None:
        """Forget the chunks before index ``upto``."""
        n = min(len(self._chunks), max(0, upto - self._base))
        self._buffered -= sum(len(c) for c in self._chunks[:n])
        del self._chunks[:n]
        self._base += n

    # -------------------------------------------------------------- traces

    def mark(self, pid: int) -> EbpfTrace:
        """Trace ``pid`` (stopped, e.g. bubblewrap's init on its block descriptor) and
        everything it starts from now on."""
        with self._cond:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            ident = self._next_id
            self._next_id = ident + 1 if ident + 1 < 1 << 31 else 1
            t = self._traces[ident] = EbpfTrace(ident, pid, self._base + len(self._chunks), self._lost)
        _setpriority(self.magic, pid, ident)
        return t

    def flush(self, timeout_s: float = _FLUSH_TIMEOUT_S) -> None:
        """Return once bpftrace printed every event made before this call: a marker from
        each CPU this thread may run on (each CPU's buffer is in order; the marker's padding
        pushes it out of bpftrace's own buffer). TimeoutError when it does not come."""
        with self._cond:
            self._flush_seq += 1
            seq = self._flush_seq
            self._flushes[seq] = set()
        cpus = sorted(_online_cpus())
        saved = os.sched_getaffinity(0)
        try:
            for cpu in cpus:
                try:
                    os.sched_setaffinity(0, {cpu})
                except OSError:
                    continue
                _setpriority(self.magic + 1, seq, 0)
        finally:
            os.sched_setaffinity(0, saved)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            try:
                while not set(cpus) <= self._flushes[seq]:
                    if self._dead is not None:
                        raise TimeoutError(self._dead)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("bpftrace did not print the flush markers")
                    self._cond.wait(left)
            finally:
                del self._flushes[seq]

    def collect(self, trace: EbpfTrace) -> tuple[list[bytes], str | None]:
        """The lines of ``trace`` (its command has ended: "ID TS TID KIND ...", without the
        token) and why they are incomplete (None: complete); the trace is forgotten."""
        try:
            self.flush()
        except TimeoutError as exc:
            self.forget(trace)
            return [], f"the tracer did not flush ({exc})"
        return self._take(trace)

    def _take(self, trace: EbpfTrace) -> tuple[list[bytes], str | None]:
        """:meth:`collect` once the output is flushed."""
        with self._cond:
            chunks = self._chunks[max(0, trace.start - self._base) :]
            problem = trace.problem
            if problem is None and self._lost != trace.lost_mark:
                problem = "the tracer lost events"
            self._forget(trace)
        if problem is not None:
            return [], problem
        prefix = self._tok + str(trace.id).encode() + b" "
        lines = []
        for chunk in chunks:
            for rec in chunk.split(self._end):
                at = rec.find(prefix)
                if at == 0 or (at > 0 and rec[at - 1 : at] == b"\n"):
                    lines.append(rec[at + len(self._tok) :])
        if len(lines) > MAX_EVENTS:
            return [], f"more than {MAX_EVENTS} events"
        return lines, None

    def forget(self, trace: EbpfTrace) -> None:
        with self._cond:
            self._forget(trace)

    def _forget(self, trace: EbpfTrace) -> None:
        self._traces.pop(trace.id, None)
        self._drop(min((t.start for t in self._traces.values()), default=self._base + len(self._chunks)))


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _online_cpus() -> set[int]:
    try:
        text = Path("/sys/devices/system/cpu/online").read_text().strip()
    except OSError:
        return set(os.sched_getaffinity(0))
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


# --------------------------------------------------------------------------- support


@dataclass(frozen=True, slots=True)
class EbpfSupport:
    """Whether this tracer can run here: ``ok``, ``detail`` (what runs, or why not with
    the fix), and what it needs to start."""

    ok: bool
    detail: str
    bpftrace: str | None = None
    tracefs: str | None = None
    mount_off: int = -1


_BTF = "/sys/kernel/btf/vmlinux"
_TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def ebpf_support() -> EbpfSupport:
    """What the eBPF tracer needs, checked without starting it: root, bpftrace 0.17 or
    later, the kernel's BTF with ``struct mount``, and tracefs with the syscall
    tracepoints."""
    path = shutil.which("bpftrace")
    if path is None:
        return EbpfSupport(False, "off: bpftrace is not installed (apt-get install bpftrace)")
    if os.geteuid() != 0:
        return EbpfSupport(False, "off: the eBPF tracer needs root")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return EbpfSupport(False, f"off: bpftrace could not be run ({exc})")
    m = re.search(r"v?(\d+)\.(\d+)", out)
    if m is None or (int(m.group(1)), int(m.group(2))) < (0, 17):
        return EbpfSupport(False, f"off: {out or 'bpftrace'} is too old (0.17 or later is needed)")
    tracefs = next((t for t in _TRACEFS if os.path.isdir(os.path.join(t, "events", "syscalls"))), None)
    if tracefs is None:
        return EbpfSupport(False, "off: tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)")
    fields = syscall_fields(tracefs)
    missing = [t for t in ("openat", "newfstatat", "execve", "clone", "getdents64") if t not in fields]
    if missing:
        return EbpfSupport(False, f"off: the kernel has no syscall tracepoints for {', '.join(missing)}")
    try:
        off = btf_member_offset(_BTF, "mount", "mnt")
    except (OSError, ValueError) as exc:
        return EbpfSupport(False, f"off: the kernel's BTF cannot be read ({exc})")
    why = namespace_problem()
    start = (
        f"starts on tracefs's available_events, twice the start's CPU: no mount namespace of its own ({why})"
        if why
        else "starts on an available_events snapshot in a mount namespace of its own"
    )
    return EbpfSupport(True, f"on: {out} (eBPF on the syscall tracepoints; {start})", path, tracefs, off)


def btf_member_offset(path: str, struct_name: str, member: str) -> int:
    """The byte offset of ``member`` in ``struct struct_name`` from a BTF file (the
    kernel's ``/sys/kernel/btf/vmlinux``)."""
    import struct as _struct

    data = Path(path).read_bytes()
    magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _struct.unpack_from("<HBBIIIII", data, 0)
    if magic != 0xEB9F:
        raise ValueError("not a BTF file")
    types = memoryview(data)[hdr_len + type_off : hdr_len + type_off + type_len]
    strings = data[hdr_len + str_off : hdr_len + str_off + str_len]

    def name(off: int) -> bytes:
        return strings[off : strings.index(b"\0", off)]

    want, want_member = struct_name.encode(), member.encode()
    i = 0
    n = len(types)
    # kind -> bytes after the 12-byte header: fixed, or per member (vlen)
    fixed = {1: 4, 3: 12, 14: 4, 17: 4}
    per = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}
    while i + 12 <= n:
        name_off, info, _size = _struct.unpack_from("<III", types, i)
        kind = (info >> 24) & 0x1F
        vlen = info & 0xFFFF
        i += 12
        if kind == 4 and name(name_off) == want:
            kflag = info >> 31
            for k in range(vlen):
                m_name, _m_type, m_off = _struct.unpack_from("<III", types, i + 12 * k)
                if name(m_name) == want_member:
                    bits = m_off & 0xFFFFFF if kflag else m_off
                    if bits % 8:
                        raise ValueError(f"{struct_name}.{member} is a bit field")
                    return bits // 8
            raise ValueError(f"struct {struct_name} has no member {member}")
        i += fixed.get(kind, 0) + per.get(kind, 0) * vlen
    raise ValueError(f"no struct {struct_name} in the BTF")


_tracer: EbpfTracer | None = None
#: every bpftrace this process started that may still run (:func:`service_pids`)
_launched: list[subprocess.Popen[bytes]] = []
_launched_lock = threading.Lock()  # not _tracer_lock: a start holds that while bpftrace starts
_tracer_error: str | None = None
_tracer_lock = threading.Lock()
_starting: threading.Thread | None = None
_generation = 0  # stop_tracer() moves it on: a start waiting for a quiet host is dropped

#: A start asked for by a fork (:func:`ready_tracer`) waits until the host has had this
#: many cores free in every sample over START_QUIET_S: bpftrace's start takes about 3 s of
#: one core (docs/engine.md, "Read sets"), which a busy host's other work would pay for.
START_FREE_CORES = 1.0
START_QUIET_S = 1.0
START_SAMPLE_S = 0.25


def wait_for_quiet_host(
    monitor: HostMonitor,
    *,
    free_cores: float = START_FREE_CORES,
    quiet_s: float = START_QUIET_S,
    sample_s: float = START_SAMPLE_S,
    give_up: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait until ``monitor`` has shown ``free_cores`` free in every sample (one each
    ``sample_s``) for ``quiet_s`` in a row: True then; False as soon as ``give_up()``."""
    need = max(1, math.ceil(quiet_s / sample_s))
    run = 0
    while run < need:
        if give_up():
            return False
        sleep(sample_s)
        run = run + 1 if monitor.snapshot().free_cores >= free_cores else 0
    return not give_up()


def ready_tracer(support: EbpfSupport, *, monitor: HostMonitor | None = None) -> EbpfTracer | None:
    """The process's tracer if it is running; else None, and it is being started in the
    background (a command is not held up for it, it runs untraced) once the host has a core
    to spare (:func:`wait_for_quiet_host` on ``monitor``, by default this host's /proc).
    RuntimeError when it cannot start."""
    global _starting
    with _tracer_lock:
        if _tracer is not None and _tracer._dead is None:
            return _tracer
        if _tracer_error is not None:
            raise RuntimeError(_tracer_error)
        if _starting is None or not _starting.is_alive():
            generation = _generation

            def start() -> None:
                from aospec.host import ProcHostMonitor

                host = monitor if monitor is not None else ProcHostMonitor(window_s=START_SAMPLE_S * 0.8)
                if wait_for_quiet_host(host, give_up=lambda: _generation != generation):
                    with contextlib.suppress(RuntimeError):
                        tracer(support)

            _starting = threading.Thread(target=start, name="aospec-bpftrace-start", daemon=True)
            _starting.start()
    return None


def tracer(support: EbpfSupport, *, snapshot: bool = True) -> EbpfTracer:
    """The process's tracer, started on first use and waited for (RuntimeError when it
    cannot start; the reason is kept: later calls fail at once). ``snapshot=False`` starts
    bpftrace on tracefs's own ``available_events`` (slower: :func:`_launch`)."""
    global _tracer, _tracer_error, _namespaced
    with _tracer_lock:
        if _tracer is not None and _tracer._dead is None:
            return _tracer
        if _tracer_error is not None:
            raise RuntimeError(_tracer_error)
        if not support.ok or support.bpftrace is None or support.tracefs is None:
            raise RuntimeError(support.detail)
        t = EbpfTracer(support.bpftrace, support.tracefs, support.mount_off, snapshot=snapshot)
        try:
            t.start()
        except (OSError, RuntimeError) as exc:
            if not t.snapshotted:
                _tracer_error = f"the eBPF tracer did not start: {exc}"
                raise RuntimeError(_tracer_error) from None
            # its namespace could not be set up (or bpftrace failed in it): start it plainly,
            # now and from now on in this process (namespace_problem() says why)
            _namespaced = f"a start in one failed: {exc}"
            t = EbpfTracer(support.bpftrace, support.tracefs, support.mount_off, snapshot=False)
            try:
                t.start()
            except (OSError, RuntimeError) as exc2:
                _tracer_error = f"the eBPF tracer did not start: {exc2} (on a snapshot: {exc})"
                raise RuntimeError(_tracer_error) from None
        _tracer = t
        return t


def stop_tracer() -> bool:
    """Stop the process's bpftrace if it runs (True then): its probes cost every system call
    on the host a little while they are attached (docs/engine.md, "Read sets"). Traces not
    collected yet are lost (their forks are untracked); the next fork asked to be traced
    starts it again (``ready_tracer``), which takes seconds of CPU."""
    global _tracer, _generation
    with _tracer_lock:
        t, _tracer = _tracer, None
        _generation += 1
    if t is None:
        return False
    t.stop()
    return True


def service_pids() -> set[int]:
    """The pids of this process's bpftrace processes while they run (a service it keeps on
    purpose: leak checks leave it out): the tracer in use, one still starting (in a fork's
    background start), one still detaching its probes after :func:`stop_tracer`."""
    with _launched_lock:
        _launched[:] = [p for p in _launched if p.poll() is None]
        return {p.pid for p in _launched}
