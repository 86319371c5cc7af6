"""Sandbox processes on the host: the marker every bubblewrap process carries in its
environment (its store and run) and the hashed identity of the session that owns it, so
that recovery and ``aospec sandbox gc`` find orphans, even ones left mid-setup."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import xxhash
from aospec.runtime.cgroups import thaw_process

__all__ = [
    "MARKER_ENV",
    "OWNER_ENV",
    "kill_all_marked",
    "kill_marked",
    "live_owner_tokens",
    "marked_processes",
    "own_owner_token",
    "owner_token",
    "process_environments",
    "process_identity",
    "set_process_priority",
]

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


def own_owner_token() -> str:
    """The :func:`owner_token` of this process (what its sandbox processes carry)."""
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
    their session was killed mid-setup, or while their sandbox was paused: a frozen
    process is thawed after the signal, so that it dies)."""
    killed = []
    for pid in marked_processes(prefix, exact=exact):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            thaw_process(pid)
    return killed


def kill_all_marked(prefix: str, *, timeout: float = 2.0) -> list[int]:
    """:func:`kill_marked` until no marked process is left (one that forked between the
    scan and its signal, or is still dying), for at most ``timeout`` seconds. Returns every
    pid signalled, once."""
    killed: dict[int, None] = {}
    deadline = time.monotonic() + timeout
    while True:
        killed.update(dict.fromkeys(kill_marked(prefix)))
        if not marked_processes(prefix) or time.monotonic() >= deadline:
            return list(killed)
        time.sleep(0.01)


# ioprio_set(2): no libc wrapper; the syscall number per architecture
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_IDLE = 3 << 13  # IOPRIO_CLASS_IDLE
_IOPRIO_BEST_EFFORT = (2 << 13) | 4  # IOPRIO_CLASS_BE, the default level
_libc = ctypes.CDLL(None, use_errno=True)


def set_process_priority(pid: int, *, background: bool) -> None:
    """Run ``pid`` at background priority (SCHED_IDLE, idle IO class) or back at the normal
    one (SCHED_OTHER, best-effort IO). Children started later inherit it. Best effort: a
    process that is gone or a policy the host refuses is skipped."""
    with contextlib.suppress(OSError):
        policy = os.SCHED_IDLE if background else os.SCHED_OTHER
        os.sched_setscheduler(pid, policy, os.sched_param(0))
    if _IOPRIO_SET is not None:
        _libc.syscall(_IOPRIO_SET, _IOPRIO_WHO_PROCESS, pid, _IOPRIO_IDLE if background else _IOPRIO_BEST_EFFORT)
