"""Low-level Linux filesystem helpers: mounts, mountinfo, overlay-aware tree copy, safe
resolution inside a root (openat2 RESOLVE_IN_ROOT) and removal.

Everything here is blocking; async callers go through ``anyio.to_thread``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aospec.runtime._mntns import unescape_mountinfo

__all__ = [
    "OPAQUE_XATTR",
    "DirPath",
    "LinkMap",
    "clear_dir",
    "WalkedDir",
    "copy_entry",
    "copy_entry_at",
    "copy_tree",
    "is_opaque",
    "is_whiteout",
    "make_private",
    "mount",
    "mounts_under",
    "real_path",
    "open_dir_at",
    "open_in_root",
    "remount_readonly",
    "remove_entry_at",
    "remove_tree",
    "sync_tree",
    "umount",
    "unmount_all_under",
    "walk_names",
    "walk_tree",
]

OPAQUE_XATTR = "trusted.overlay.opaque"


def is_opaque(dir_fd: int, name: str | bytes | None = None) -> bool:
    """Whether the directory ``dir_fd`` (or its entry ``name``, a directory) carries
    overlayfs's opaque marker (it hides everything below it in the lower layers)."""
    fd = dir_fd if name is None else os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return os.getxattr(fd, OPAQUE_XATTR) in (b"y", b"x")
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise
    finally:
        if fd != dir_fd:
            os.close(fd)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_MOVE = 8192
MS_PRIVATE = 1 << 18
_PROPAGATION = MS_PRIVATE | 1 << 17 | 1 << 19 | 1 << 20  # private, unbindable, slave, shared
MNT_DETACH = 2
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    """mount(2); raises OSError with the errno and the target path.

    Every mount gets ``nosuid,nodev`` (a remount too: MS_REMOUNT resets the per-mount
    flags it is not given): sandboxes write as host root, and nothing they write may gain
    privilege on the host. A move or a propagation change takes its flags as they are."""
    if not flags & (MS_MOVE | _PROPAGATION):
        flags |= MS_NOSUID | MS_NODEV
    src = source.encode() if source else None
    typ = fstype.encode() if fstype else None
    if _libc.mount(src, target.encode(), typ, flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target}: {os.strerror(err)}")


def make_private(target: str) -> None:
    """Make the mount at ``target`` private: mounts and unmounts below it neither
    propagate to other mount namespaces (the sandboxes' bwrap copies) nor come from them."""
    mount("", target, "", MS_PRIVATE)


def remount_readonly(target: str, *, wait_s: float = 10.0) -> None:
    """Remount the filesystem at ``target`` read-only (the whole superblock). A writer
    can hold it for a moment: a process forked by another thread (bwrap being spawned)
    has a copy of every descriptor until it closes them, so EBUSY is retried."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            mount("", target, "", MS_REMOUNT | MS_RDONLY)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                raise
            time.sleep(0.002)


def umount(target: str, *, detach: bool = False) -> None:
    """umount2(2); a target that is not mounted is not an error. A busy mount is
    detached lazily (it goes away when its last user lets go): a process forked by
    another thread holds copies of our descriptors for a moment, and a busy mount must
    never fail a run nor stay mounted."""
    if _libc.umount2(target.encode(), MNT_DETACH if detach else 0) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return
        if err == errno.EBUSY and not detach:
            umount(target, detach=True)
            return
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


_FD_LINK = re.compile(r"(/proc/(?:self|\d+)/fd/\d+)(/.*)?")


def real_path(path: str) -> str:
    """Where ``path`` is now: a ``/proc/PID/fd/N`` name is read off the descriptor (what
    the kernel says it is, never re-resolved by name), any other path by realpath."""
    m = _FD_LINK.fullmatch(path.rstrip("/"))
    if m:
        return os.readlink(m[1]) + (m[2] or "")
    return os.path.realpath(path)


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` (from /proc/self/mountinfo), deepest first,
    named below ``prefix`` as given: a ``/proc/PID/fd/N`` prefix (a directory held by
    descriptor) names them through the descriptor, so that unmounting them can never be
    redirected by whoever renames a directory above it."""
    given = prefix.rstrip("/")
    real = real_path(prefix).rstrip("/")
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            point = unescape_mountinfo(line.split(" ", 5)[4])
            if point == real or point.startswith(real + "/"):
                found.append(given + point[len(real) :])
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_all_under(prefix: str, *, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Lazily unmount every mount at or below ``prefix`` except the mount points in
    ``keep`` (named as :func:`mounts_under` names them); returns what was unmounted."""
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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KEEP_OPEN = 64  # directory descriptors a DirPath keeps open, whatever the depth


class DirPath:
    """The open directories from a root down to the current one, for walking trees of any
    depth without ever naming a path longer than one component (a sandbox can build trees
    whose paths exceed PATH_MAX). Only the deepest ``keep`` stay open; an ancestor closed
    on the way down is reopened through ``..`` of its child on the way back up, and must
    be the same directory. The root descriptor belongs to the caller."""

    __slots__ = ("_fds", "_ids", "_keep", "names")

    def __init__(self, root_fd: int, *, keep: int = _KEEP_OPEN) -> None:
        self._fds: list[int | None] = [root_fd]
        self._ids: list[tuple[int, int] | None] = [None]
        self._keep = keep
        self.names: list[bytes] = []

    @property
    def depth(self) -> int:
        return len(self.names)

    @property
    def fd(self) -> int:
        fd = self._fds[-1]
        assert fd is not None
        return fd

    def push(self, name: bytes) -> int:
        """Open the subdirectory ``name`` of the current directory and make it current."""
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        self._fds.append(fd)
        self._ids.append(None)
        self.names.append(name)
        old = len(self._fds) - 1 - self._keep
        if old >= 1 and self._fds[old] is not None:
            st = os.fstat(self._fds[old])  # type: ignore[arg-type]
            self._ids[old] = (st.st_dev, st.st_ino)
            os.close(self._fds[old])  # type: ignore[arg-type]
            self._fds[old] = None
        return fd

    def pop(self) -> None:
        """Close the current directory; its parent becomes current."""
        fd = self._fds.pop()
        self._ids.pop()
        self.names.pop()
        assert fd is not None
        try:
            if self._fds[-1] is None:
                up = os.open(b"..", _DIR_FLAGS, dir_fd=fd)
                st = os.fstat(up)
                if (st.st_dev, st.st_ino) != self._ids[-1]:
                    os.close(up)
                    raise OSError(errno.ESTALE, "a directory moved while its tree was being read")
                self._fds[-1] = up
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close every descriptor this path opened (not the root)."""
        for fd in self._fds[1:]:
            if fd is not None:
                os.close(fd)
        del self._fds[1:], self._ids[1:], self.names[:]


@dataclass(slots=True)
class WalkedDir:
    """One directory of a :func:`walk_tree`: ``fd`` is open for this step only; remove a
    directory from ``entries`` to keep the walk out of it."""

    rel: bytes
    name: bytes
    depth: int
    fd: int
    st: os.stat_result
    entries: list[os.DirEntry[str]]  # names are str: os.fsencode them


def _entries(fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as it:
        return list(it)


def walk_tree(root_fd: int) -> Iterator[WalkedDir]:
    """Every directory of the tree at ``root_fd`` (the root first, parents before
    children), with its entries; never follows a symlink and works at any depth with a
    bounded number of descriptors. A directory that vanished since it was listed is
    skipped."""
    path = DirPath(root_fd)
    try:
        step = WalkedDir(b"", b"", 0, root_fd, os.fstat(root_fd), _entries(root_fd))
        yield step
        todo = [[os.fsencode(e.name) for e in reversed(step.entries) if e.is_dir(follow_symlinks=False)]]
        rels = [b""]
        while todo:
            if not todo[-1]:
                todo.pop()
                rels.pop()
                if todo:
                    path.pop()
                continue
            name = todo[-1].pop()
            try:
                fd = path.push(name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    continue
                raise
            rel = rels[-1] + b"/" + name if rels[-1] else name
            step = WalkedDir(rel, name, path.depth, fd, os.fstat(fd), _entries(fd))
            yield step
            todo.append([os.fsencode(e.name) for e in reversed(step.entries) if e.is_dir(follow_symlinks=False)])
            rels.append(rel)
    finally:
        path.close()


def open_dir_at(root_fd: int, rel: bytes) -> int:
    """A new descriptor of the directory ``rel`` below ``root_fd``, opened one component
    at a time (never following a symlink)."""
    fd = os.open(b".", _DIR_FLAGS, dir_fd=root_fd)
    for part in rel.split(b"/") if rel else ():
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _copy_xattrs(src: int | bytes, dst: int | bytes) -> None:
    """Copy extended attributes between two descriptors (or /proc/self/fd paths)."""
    try:
        names = os.listxattr(src)
    except OSError:
        return
    for name in names:
        # overlayfs bookkeeping (origin, impure, nlink, ...) describes the old mount, not
        # the content; only the opaque marker carries meaning in a layer.
        if name.startswith("trusted.overlay.") and name != OPAQUE_XATTR:
            continue
        try:
            os.setxattr(dst, name, os.getxattr(src, name))
        except OSError as exc:
            if name == OPAQUE_XATTR:
                raise
            if exc.errno not in (errno.ENOTSUP, errno.EPERM, errno.EOPNOTSUPP):
                raise


def _copy_data(fin: int, fout: int, size: int) -> None:
    remaining = size
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


def _set_meta_fd(src_fd: int | bytes, dst_fd: int, st: os.stat_result) -> None:
    # chown first: it clears set-id bits and file capabilities, which chmod and the
    # xattrs then restore
    os.fchown(dst_fd, st.st_uid, st.st_gid)
    os.fchmod(dst_fd, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src_fd, dst_fd)


def _copy_nondir_at(sfd: int, name: bytes, dfd: int, st: os.stat_result, new: bytes | None = None) -> bool:
    """Copy the non-directory ``name`` of directory ``sfd`` to ``new`` (default: the same
    name) in directory ``dfd``; False for a type that cannot be copied."""
    new = name if new is None else new
    mode = st.st_mode
    times = (st.st_atime_ns, st.st_mtime_ns)
    if stat.S_ISREG(mode):
        fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
        try:
            fout = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                _copy_data(fin, fout, st.st_size)
                _set_meta_fd(fin, fout, st)
                os.utime(fout, ns=times)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        return True
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(name, dir_fd=sfd), new, dir_fd=dfd)
        os.chown(new, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        os.utime(new, ns=times, dir_fd=dfd, follow_symlinks=False)
        return True
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        # a socket inode is part of the version (type, mode, owner) like any other entry;
        # recreated unbound, as the original is once its process is gone
        os.mknod(new, mode, st.st_rdev, dir_fd=dfd)
        os.chown(new, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        os.chmod(new, stat.S_IMODE(mode), dir_fd=dfd)
        if not (stat.S_ISCHR(mode) and st.st_rdev == 0):  # a whiteout carries no attributes
            # no *xattr call takes a directory descriptor: go through O_PATH descriptors
            s = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
            try:
                d = os.open(new, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    _copy_xattrs(b"/proc/self/fd/%d" % s, b"/proc/self/fd/%d" % d)
                finally:
                    os.close(d)
            finally:
                os.close(s)
        os.utime(new, ns=times, dir_fd=dfd, follow_symlinks=False)
        return True
    return False


class LinkMap:
    """The hard-linked inodes already copied into one destination tree (by ``(st_dev,
    st_ino)`` of the source), so that the next name of one becomes a hard link to its
    first copy instead of a second file. Names are relative to the tree's root
    descriptor ``root_fd`` (any depth)."""

    __slots__ = ("first", "root_fd")

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.first: dict[tuple[int, int], bytes] = {}

    def linked(self, st: os.stat_result, dir_fd: int, name: bytes) -> bool:
        """Make ``name`` in ``dir_fd`` a link to the first copy of ``st``'s inode, if any."""
        rel = self.first.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
        if rel is None:
            return False
        parent, _, first = rel.rpartition(b"/")
        pfd = open_dir_at(self.root_fd, parent)
        try:
            os.link(first, name, src_dir_fd=pfd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(pfd)
        return True

    def note(self, st: os.stat_result, rel: bytes) -> None:
        """``rel`` is now a copy of ``st``'s inode."""
        if st.st_nlink > 1:
            self.first.setdefault((st.st_dev, st.st_ino), rel)


def _copy_dir_contents(
    sfd: int, dfd: int, *, merge: bool = False, links: LinkMap | None = None, base: bytes = b""
) -> None:
    """Copy everything inside directory ``sfd`` into directory ``dfd`` (whose own
    metadata is the caller's business), at any depth. With ``merge``, existing
    directories are merged and any other existing entry is replaced. Hard links inside
    it stay links; with ``links`` (``dfd`` being ``base`` below its root) also to what
    was copied into the same tree before."""
    dst = DirPath(dfd)
    times: list[tuple[int, int]] = []  # per open dst level below the root
    if links is None:
        links, base = LinkMap(dfd), b""
    try:
        for step in walk_tree(sfd):
            while dst.depth >= max(step.depth, 1):
                os.utime(dst.fd, ns=times.pop())  # its children are complete
                dst.pop()
            if step.depth:
                dst.push(step.name)
                _set_meta_fd(step.fd, dst.fd, step.st)
                times.append((step.st.st_atime_ns, step.st.st_mtime_ns))
            descend = []
            for entry in step.entries:
                name = os.fsencode(entry.name)
                st = entry.stat(follow_symlinks=False)
                if merge:
                    try:
                        old = os.stat(name, dir_fd=dst.fd, follow_symlinks=False)
                    except FileNotFoundError:
                        pass
                    else:
                        if stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(old.st_mode):
                            descend.append(entry)
                            continue
                        remove_entry_at(dst.fd, name)
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(name, 0o700, dir_fd=dst.fd)
                    descend.append(entry)
                    continue
                if links.linked(st, dst.fd, name):
                    continue
                if _copy_nondir_at(step.fd, name, dst.fd, st):
                    links.note(st, b"/".join(p for p in (base, step.rel, name) if p))
            step.entries[:] = descend
        while dst.depth:
            os.utime(dst.fd, ns=times.pop())
            dst.pop()
    finally:
        dst.close()


def copy_tree(src: str | bytes, dst: str | bytes, *, merge: bool = False) -> None:
    """Copy an overlay layer (or any tree) preserving type, mode, owner, times, symlinks,
    hard links, device nodes (whiteouts included), FIFOs, sockets and the opaque marker;
    never follows symlinks, works at any depth. ``dst`` must not exist unless ``merge``
    (then it must be a directory and entries are overwritten)."""
    src_b, dst_b = os.fsencode(src), os.fsencode(dst)
    sfd = os.open(src_b, _DIR_FLAGS)
    try:
        if not merge or not os.path.isdir(dst_b):
            os.mkdir(dst_b, 0o700)
        dfd = os.open(dst_b, _DIR_FLAGS)
        try:
            st = os.fstat(sfd)
            _set_meta_fd(sfd, dfd, st)
            _copy_dir_contents(sfd, dfd, merge=merge)
            os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def copy_entry_at(
    sfd: int, name: bytes, dfd: int, new: bytes | None = None, *, links: LinkMap | None = None, rel: bytes = b""
) -> None:
    """Copy the entry ``name`` of directory ``sfd`` (a directory with its whole tree) to
    ``new`` (default: the same name) in directory ``dfd``, preserving what copy_tree does.
    With ``links`` (the copy being ``rel`` below its root), hard links to what was copied
    into the same tree before stay links."""
    new = name if new is None else new
    st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        if links is not None and links.linked(st, dfd, new):
            return
        if _copy_nondir_at(sfd, name, dfd, st, new) and links is not None:
            links.note(st, rel)
        return
    os.mkdir(new, 0o700, dir_fd=dfd)
    s = os.open(name, _DIR_FLAGS, dir_fd=sfd)
    try:
        d = os.open(new, _DIR_FLAGS, dir_fd=dfd)
        try:
            _set_meta_fd(s, d, st)
            _copy_dir_contents(s, d, links=links, base=rel)
            os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(d)
    finally:
        os.close(s)


def _split(path: bytes) -> tuple[bytes, bytes]:
    parent, _, name = os.path.abspath(path).rpartition(b"/")
    return parent or b"/", name


def copy_entry(src: str | bytes | os.PathLike[str], dst: str | bytes | os.PathLike[str]) -> None:
    """Copy one entry (a directory with its whole tree) preserving what copy_tree does."""
    (s_parent, s_name), (d_parent, d_name) = _split(os.fsencode(src)), _split(os.fsencode(dst))
    sfd = os.open(s_parent, _DIR_FLAGS)
    try:
        dfd = os.open(d_parent, _DIR_FLAGS)
        try:
            copy_entry_at(sfd, s_name, dfd, d_name)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def sync_tree(path: str | bytes) -> None:
    """fsync every file and directory below ``path`` (for durable layers)."""
    root = os.open(os.fsencode(path), _DIR_FLAGS)
    try:
        for step in walk_tree(root):
            for entry in step.entries:
                if entry.is_file(follow_symlinks=False):
                    fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=step.fd)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            os.fsync(step.fd)
    finally:
        os.close(root)


def _retry_writable(op: Callable[[], object], fd: int, name: bytes | None = None) -> None:
    """Run ``op``; on EACCES (a directory chmod-ed 0 inside a sandbox, when we are not
    all-powerful) make the directory ``name`` of ``fd`` (or ``fd`` itself) 0700 and retry."""
    try:
        op()
    except PermissionError:
        if name is None:
            os.fchmod(fd, 0o700)
        else:
            os.chmod(name, 0o700, dir_fd=fd)
        op()


def clear_dir(root_fd: int) -> None:
    """Remove everything inside the directory ``root_fd``, at any depth (never following
    a symlink)."""
    path = DirPath(root_fd)
    try:
        todo: list[list[bytes]] = []
        while True:
            subdirs = []
            for entry in _entries(path.fd):
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(os.fsencode(entry.name))
                else:
                    _retry_writable(lambda n=entry.name: os.unlink(n, dir_fd=path.fd), path.fd)
            todo.append(subdirs)
            while not todo[-1]:
                todo.pop()
                if not todo:
                    return
                name = path.names[-1]
                path.pop()
                _retry_writable(lambda n=name: os.rmdir(n, dir_fd=path.fd), path.fd)
                todo[-1].pop()
            _retry_writable(lambda n=todo[-1][-1]: path.push(n), path.fd, todo[-1][-1])
    finally:
        path.close()


def remove_entry_at(dfd: int, name: bytes) -> None:
    """Remove the entry ``name`` of directory ``dfd`` (a directory with its whole tree)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    try:
        clear_dir(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def remove_tree(path: str | bytes) -> None:
    """Remove a file or directory tree (any depth); missing is fine. Refuses to delete a
    mount point."""
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
    parent, name = _split(p)
    pfd = os.open(parent, _DIR_FLAGS)
    try:
        remove_entry_at(pfd, name)
    finally:
        os.close(pfd)


_OPENAT2_TRIES = 1000  # EAGAIN retries of one lookup (each is a few microseconds)


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
        # EAGAIN: a rename or mount anywhere on the host raced the RESOLVE_IN_ROOT lookup
        # (the kernel cannot then vouch for ".."): try again, as openat2(2) says; a host
        # busy mounting forks does that often
        for _ in range(_OPENAT2_TRIES):
            fd = _libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
            if fd >= 0:
                return int(fd)
            err = ctypes.get_errno()
            if err != errno.EAGAIN:
                break
        raise OSError(err, os.strerror(err), path)
    finally:
        os.close(dirfd)


def walk_names(root: bytes) -> Iterator[bytes]:
    """Relative paths of every entry below ``root`` (not following symlinks), parents
    first, at any depth."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for step in walk_tree(fd):
            prefix = step.rel + b"/" if step.rel else b""
            for entry in step.entries:
                yield prefix + os.fsencode(entry.name)
    finally:
        os.close(fd)
