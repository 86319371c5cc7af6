"""Content digests of layers stored on disk, so that reopening a state directory can tell
whether its layers still hold what they held when HEAD named them with a version.

A digest covers every entry of a layer directory, in a fixed order: its relative path,
file type and full mode (setuid bits included), owner, content (xxh3-128), symlink target,
device number (whiteouts are 0/0 character devices) and extended attributes (the overlay
opaque marker, file capabilities, ...; not overlayfs' own bookkeeping). Never times,
inode numbers or link counts. The walk goes directory descriptor by directory descriptor,
so any tree the kernel allows can be digested and no symlink is followed.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

import xxhash
from aospec.runtime._fs import OPAQUE_XATTR

__all__ = ["layer_digest"]

_TAG = b"aospec.layer-digest.v1\0"
_ENTRY = struct.Struct("<IIIII")  # mode, uid, gid, device major, minor
_CHUNK = 1 << 20


def _xattrs(path: str, *, follow: bool) -> bytes:
    try:
        names = os.listxattr(path, follow_symlinks=follow)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return b""
        raise
    out = bytearray()
    for name in sorted(names):
        if name.startswith("trusted.overlay.") and name != OPAQUE_XATTR:
            continue  # overlayfs bookkeeping (origin, impure, ...), not content
        value = os.getxattr(path, name, follow_symlinks=follow)
        raw = name.encode()
        out += struct.pack("<I", len(raw)) + raw + struct.pack("<I", len(value)) + value
    return bytes(out)


def _content(fd: int, h: xxhash.xxh3_128) -> None:
    inner = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while n := f.readinto(buf):
            inner.update(view[:n])
    h.update(inner.digest())


def _entry(st: os.stat_result) -> bytes:
    return _ENTRY.pack(st.st_mode, st.st_uid, st.st_gid, os.major(st.st_rdev), os.minor(st.st_rdev))


def _names(dfd: int) -> list[bytes]:
    """The names in a directory, in reverse order (popped from the end)."""
    return sorted((os.fsencode(n) for n in os.listdir(dfd)), reverse=True)


def layer_digest(root: str | Path) -> str:
    """The content digest of the tree at ``root`` (32 hex digits)."""
    h = xxhash.xxh3_128(_TAG)
    # one directory descriptor at a time (down by name, up by ".."), so that the depth of
    # a tree is bounded by nothing but the kernel; a stored layer does not change under us
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        h.update(_entry(os.fstat(dfd)) + _xattrs(f"/proc/self/fd/{dfd}", follow=True))
        stack: list[tuple[bytes, list[bytes]]] = [(b"", _names(dfd))]  # (relative path, names to visit)
        while stack:
            rel, names = stack[-1]
            if not names:
                stack.pop()
                if stack:
                    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
                    os.close(dfd)
                    dfd = parent
                continue
            name = names.pop()
            path = rel + b"/" + name if rel else name
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            h.update(struct.pack("<I", len(path)) + path + _entry(st))
            fmt = stat.S_IFMT(st.st_mode)
            if fmt == stat.S_IFDIR:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                os.close(dfd)
                dfd = child
                h.update(_xattrs(f"/proc/self/fd/{dfd}", follow=True))
                stack.append((path, _names(dfd)))
            elif fmt == stat.S_IFLNK:
                target = os.readlink(name, dir_fd=dfd)
                h.update(struct.pack("<I", len(target)) + target)
            elif fmt == stat.S_IFREG:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    _content(fd, h)
                    h.update(_xattrs(f"/proc/self/fd/{fd}", follow=True))
                finally:
                    os.close(fd)
            else:  # devices, FIFOs, sockets: never opened; xattrs read through the parent
                h.update(_xattrs(f"/proc/self/fd/{dfd}/{os.fsdecode(name)}", follow=False))
    finally:
        os.close(dfd)
    return h.hexdigest()
