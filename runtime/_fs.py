"""Low-level Linux filesystem helpers: mounts, mountinfo, overlay-aware tree copy, safe
resolution inside a root (openat2 RESOLVE_IN_ROOT) and removal.

Everything here is blocking; async callers go through ``anyio.to_thread``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from collections.abc import Iterator

__all__ = [
    "OPAQUE_XATTR",
    "copy_entry",
    "copy_tree",
    "is_whiteout",
    "mount",
    "mounts_under",
    "open_in_root",
    "remove_tree",
    "sync_tree",
    "umount",
    "unmount_all_under",
]

OPAQUE_XATTR = "trusted.overlay.opaque"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_MOVE = 8192
MNT_DETACH = 2
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    """mount(2); raises OSError with the errno and the target path."""
    src = source.encode() if source else None
    typ = fstype.encode() if fstype else None
    if _libc.mount(src, target.encode(), typ, flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def umount(target: str, *, detach: bool = False) -> None:
    """umount2(2); a target that is not mounted is not an error."""
    if _libc.umount2(target.encode(), MNT_DETACH if detach else 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _unescape_mountinfo(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    prefix = os.path.realpath(prefix).rstrip("/")
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = _unescape_mountinfo(line.split(" ", 5)[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_all_under(prefix: str, *, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Lazily unmount every mount at or below ``prefix`` except the mount points in
    ``keep``; returns what was unmounted."""
    done = []
    for _ in range(8):  # stacked mounts on one point need several passes
        points = [p for p in mounts_under(prefix) if p not in keep]
        if not points:
            break
        for point in points:
            umount(point, detach=True)
            done.append(point)
    return done


def is_whiteout(st: os.stat_result) -> bool:
    """An overlayfs whiteout: a character device with device number 0/0."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _copy_xattrs(src: bytes, dst: bytes, *, is_link: bool) -> None:
    if is_link:
        return
    try:
        names = os.listxattr(src, follow_symlinks=False)
    except OSError:
        return
    for name in names:
        # overlayfs bookkeeping (origin, impure, nlink, ...) describes the old mount, not
        # the content; only the opaque marker carries meaning in a layer.
        if name.startswith("trusted.overlay.") and name != OPAQUE_XATTR:
            continue
        try:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
        except OSError as exc:
            if name == OPAQUE_XATTR:
                raise
            if exc.errno not in (errno.ENOTSUP, errno.EPERM, errno.EOPNOTSUPP):
                raise


def _copy_file(src: bytes, dst: bytes, st: os.stat_result) -> None:
    fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            remaining = st.st_size
            while remaining > 0:
                try:
                    n = os.copy_file_range(fin, fout, min(remaining, 1 << 30))
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    n = os.sendfile(fout, fin, None, min(remaining, 1 << 30))
                if n == 0:
                    break
                remaining -= n
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def copy_tree(src: str | bytes, dst: str | bytes, *, merge: bool = False) -> None:
    """Copy an overlay layer (or any tree) preserving type, mode, owner, times, symlinks,
    hard links, device nodes (whiteouts included) and the opaque marker; never follows
    symlinks. ``dst`` must not exist unless ``merge`` (then it must be a directory and
    entries are overwritten)."""
    src_b, dst_b = os.fsencode(src), os.fsencode(dst)
    links: dict[tuple[int, int], bytes] = {}
    dir_times: list[tuple[bytes, os.stat_result]] = []
    st = os.lstat(src_b)
    if not merge or not os.path.isdir(dst_b):
        os.mkdir(dst_b, 0o700)
    _copy_meta(src_b, dst_b, st)
    dir_times.append((dst_b, st))
    _copy_children(src_b, dst_b, links, dir_times, merge)
    for path, dst_st in reversed(dir_times):
        os.utime(path, ns=(dst_st.st_atime_ns, dst_st.st_mtime_ns), follow_symlinks=False)


def _copy_meta(src: bytes, dst: bytes, st: os.stat_result) -> None:
    is_link = stat.S_ISLNK(st.st_mode)
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not is_link:
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src, dst, is_link=is_link)


def _copy_children(
    src: bytes,
    dst: bytes,
    links: dict[tuple[int, int], bytes],
    dir_times: list[tuple[bytes, os.stat_result]],
    merge: bool,
) -> None:
    with os.scandir(src) as it:
        entries = list(it)
    for entry in entries:
        s = entry.path
        d = os.path.join(dst, entry.name)
        st = entry.stat(follow_symlinks=False)
        if merge and os.path.lexists(d):
            if stat.S_ISDIR(st.st_mode) and os.path.isdir(d) and not os.path.islink(d):
                _copy_meta(s, d, st)
                dir_times.append((d, st))
                _copy_children(s, d, links, dir_times, merge)
                continue
            remove_tree(d)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(d, 0o700)
            _copy_meta(s, d, st)
            dir_times.append((d, st))
            _copy_children(s, d, links, dir_times, merge)
            continue
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in links:
            os.link(links[key], d, follow_symlinks=False)
            continue
        if _copy_nondir(s, d, st) and st.st_nlink > 1:
            links[key] = d


def _copy_nondir(s: bytes, d: bytes, st: os.stat_result) -> bool:
    mode = st.st_mode
    if stat.S_ISREG(mode):
        _copy_file(s, d, st)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(s), d)
    elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
        os.mknod(d, mode, st.st_rdev)
    else:
        return False  # sockets are not state
    _copy_meta(s, d, st)
    os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    return True


def copy_entry(src: str | bytes | os.PathLike[str], dst: str | bytes | os.PathLike[str]) -> None:
    """Copy one entry (a directory with its whole tree) preserving what copy_tree does."""
    s, d = os.fsencode(src), os.fsencode(dst)
    st = os.lstat(s)
    if stat.S_ISDIR(st.st_mode):
        copy_tree(s, d)
    else:
        _copy_nondir(s, d, st)


def sync_tree(path: str | bytes) -> None:
    """fsync every file and directory below ``path`` (for durable layers)."""
    p = os.fsencode(path)
    for root, dirs, files in os.walk(p):
        for name in files:
            full = os.path.join(root, name)
            if os.path.isfile(full) and not os.path.islink(full):
                fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        del dirs


def remove_tree(path: str | bytes) -> None:
    """Remove a file or directory tree; missing is fine. Refuses to cross into mounts."""
    p = os.fsencode(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(p)
        return
    if os.path.ismount(p):
        raise OSError(errno.EBUSY, f"refusing to delete a mounted directory: {os.fsdecode(p)}")
    # make read-only dirs (chmod 0 inside a sandbox) removable
    for root, dirs, _files in os.walk(p):
        for d in dirs:
            full = os.path.join(root, d)
            with contextlib.suppress(OSError):
                if not os.path.islink(full):
                    os.chmod(full, 0o700)
    shutil.rmtree(p)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_root(root: str, path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` as if ``root`` were ``/``: absolute symlinks and ``..`` never leave
    ``root`` (openat2 with RESOLVE_IN_ROOT). Returns a file descriptor."""
    dirfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(
            flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS
        )
        fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(fd)
    finally:
        os.close(dirfd)


def walk_names(root: bytes) -> Iterator[bytes]:
    """Relative paths of every entry below ``root`` (not following symlinks), parents first."""
    stack = [b""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                child = rel + b"/" + entry.name if rel else entry.name
                yield child
                if entry.is_dir(follow_symlinks=False):
                    stack.append(child)
