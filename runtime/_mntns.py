"""bpftrace's start in a mount namespace of its own (runtime/ebpf.py, ``_launch``).

Run as ``python -I -S _mntns.py EVENTS TARGET... -- PROGRAM ARGS...`` inside ``unshare
--mount --propagation private``: it writes the text ``EVENTS`` (the ``available_events``
lines the program's probes name) to a file on a tmpfs of the namespace's own and binds that
file over each ``TARGET`` (tracefs's ``available_events``), then drops from the namespace
every mount the program does not need, moves to ``/`` and execs ``PROGRAM ARGS...``. No file
of the host is read or bound: nothing a sandbox can write (a file under a shared temporary
directory swapped for a link or a FIFO) can reach the namespace, and nothing is left behind
when the process is killed.

Why the drop: a new mount namespace is a copy of its parent's, so it holds a second mount
of every filesystem mounted here when it was made, for as long as it lives (bpftrace lives
as long as the aospec process). A sandbox's tmpfs upper and its overlay, copied there,
stay alive after aospec unmounts them: overlayfs keeps writing on its upper, so remounting
that tmpfs read-only (an overlay commit: runtime/overlay_store.py) fails with EBUSY, and a
sandbox's memory is held until its mount points are removed. So the copy keeps only
``/proc``, ``/sys``, ``/dev`` and the mounts that hold the program and the system's files
(``/``, ``/usr``, ...); every other mount (every sandbox, layer and store of any aospec
process, and the host's other filesystems) is lazily unmounted before the program runs, and
the program runs in ``/`` (a working directory inside a dropped mount would keep it alive,
unseen in mountinfo). Where one cannot be dropped, the program does not run (exit status
:data:`EXIT_SETUP`, a line on stderr): the caller starts it plainly instead.

Standard library only: it runs with ``-I -S`` (no site-packages, no environment).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["EXIT_SETUP", "KEEP_TREES", "NEEDED", "main", "parse_mountinfo", "to_drop", "unescape_mountinfo"]

#: Mount trees the program keeps whole (tracefs, debugfs, BTF and bpffs live under /sys).
KEEP_TREES = ("/proc", "/sys", "/dev")
#: Paths whose mounts (and those mounts' parents) the program keeps, where they exist:
#: its libraries, the kernel's headers and modules, configuration, a temporary directory.
NEEDED = (
    "/",
    "/usr",
    "/usr/lib",
    "/usr/local",
    "/lib",
    "/lib64",
    "/lib/modules",
    "/usr/src",
    "/usr/include",
    "/etc",
    "/tmp",
)
#: Exit status when the namespace could not be set up (nothing was run).
EXIT_SETUP = 97

_MS_BIND = 4096
_MNT_DETACH = 2
_EINVAL, _ENOENT = 22, 2


def unescape_mountinfo(field: str) -> str:
    """A field of ``/proc/PID/mountinfo`` with its octal escapes (``\\040``: a space) undone."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and i + 3 < len(field):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[tuple[int, int, str]]:
    """(mount id, parent id, mount point) of each line of a ``/proc/PID/mountinfo``, in
    its order (a mount stacked on another comes after it)."""
    out = []
    for line in text.splitlines():
        f = line.split(" ")
        if len(f) > 4:
            out.append((int(f[0]), int(f[1]), unescape_mountinfo(f[4])))
    return out


def _under(path: str, top: str) -> bool:
    return top == "/" or path == top or path.startswith(top.rstrip("/") + "/")


def to_drop(mounts: list[tuple[int, int, str]], needed: list[str]) -> tuple[list[str], list[str]]:
    """The mounts of ``mounts`` to unmount: all but those under :data:`KEEP_TREES`, the
    topmost mount holding each path of ``needed``, and the parents of any of these.
    Returns (their mount points deepest first, a point twice where two to drop are stacked
    on it; the points of those that cannot be reached: under a kept mount stacked on the
    same point)."""
    parent = {mid: pid for mid, pid, _ in mounts}
    keep: set[int] = set()
    for mid, _, point in mounts:
        if any(_under(point, t) and t != "/" for t in KEEP_TREES):
            keep.add(mid)
    for path in needed:
        best: tuple[int, int] | None = None  # (depth, index) of the holding mount
        for i, (_, _, point) in enumerate(mounts):
            if _under(path, point):
                key = (len(point.rstrip("/")), i)
                if best is None or key > best:
                    best = key
        if best is not None:
            keep.add(mounts[best[1]][0])
    for mid in list(keep):
        seen = set()
        while mid in parent and mid not in seen:
            seen.add(mid)
            keep.add(mid)
            mid = parent[mid]
    top = {point: mid for mid, _, point in mounts}  # the mount stacked last on each point
    drop, stuck = [], []
    for i, (mid, _, point) in enumerate(mounts):
        if mid not in keep:
            (stuck if top[point] in keep else drop).append((i, point))
    # deepest first; on one point the mount stacked last first
    drop.sort(key=lambda ip: (-ip[1].rstrip("/").count("/"), -ip[0]))
    return [point for _, point in drop], [point for _, point in stuck]


def _needed(program: str) -> list[str]:
    paths = [p for p in NEEDED if os.path.exists(p)]
    real = os.path.realpath(program)
    return [*paths, real, os.path.dirname(real)]


def _mountinfo() -> list[tuple[int, int, str]]:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


def _bind_events(libc: ctypes.CDLL, events: str, targets: list[str]) -> bool:
    """Write ``events`` to a file on a tmpfs mounted over ``/tmp`` in this namespace, bind
    it over each target, then detach that tmpfs (the binds hold it; ``/tmp`` is the host's
    again). A target whose bind fails keeps tracefs's own file (a slower start, the same
    probes); False where no file could be made."""
    scratch = "/tmp"
    if libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", 0, b"size=1m,mode=0700") != 0:
        print(
            f"aospec: cannot mount a tmpfs in bpftrace's namespace: {os.strerror(ctypes.get_errno())}", file=sys.stderr
        )
        return False
    path = os.path.join(scratch, "available_events")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(events)
        for target in targets:
            if libc.mount(path.encode(), os.fsencode(target), None, _MS_BIND, None) != 0:
                err = os.strerror(ctypes.get_errno())
                print(f"aospec: {target} is read from tracefs ({err})", file=sys.stderr)
    finally:
        libc.umount2(scratch.encode(), _MNT_DETACH)
    return True


def main(argv: list[str]) -> int:
    """Set the namespace up and exec the program (never returns then); the exit status
    :data:`EXIT_SETUP` with a line on stderr where the namespace could not be set up."""
    if "--" not in argv or len(argv) < 3:
        print("usage: _mntns.py EVENTS TARGET... -- PROGRAM ARGS...", file=sys.stderr)
        return EXIT_SETUP
    cut = argv.index("--")
    events, targets, program = argv[0], argv[1:cut], argv[cut + 1 :]
    if not program:
        print("aospec: no program to run", file=sys.stderr)
        return EXIT_SETUP
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if targets and not _bind_events(libc, events, targets):
        return EXIT_SETUP
    os.chdir("/")
    needed = _needed(program[0])
    for _ in range(16):  # a pass per level of stacking
        drop, _stuck = to_drop(_mountinfo(), needed)
        progress = False
        for point in drop:
            if libc.umount2(os.fsencode(point), _MNT_DETACH) == 0:
                progress = True
            elif ctypes.get_errno() not in (_EINVAL, _ENOENT):  # EINVAL: gone with its parent
                err = os.strerror(ctypes.get_errno())
                print(f"aospec: cannot unmount {point} in bpftrace's namespace: {err}", file=sys.stderr)
                return EXIT_SETUP
        if not progress:
            break
    drop, stuck = to_drop(_mountinfo(), needed)
    if drop or stuck:
        left = [*drop, *stuck]
        print(f"aospec: {len(left)} mounts left in bpftrace's namespace (first: {left[0]})", file=sys.stderr)
        return EXIT_SETUP
    try:
        os.execv(program[0], program)
    except OSError as exc:
        print(f"aospec: cannot run {program[0]}: {exc}", file=sys.stderr)
    return EXIT_SETUP


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
