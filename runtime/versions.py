"""Filesystem versions: ``version = H(parent_version, H(layer))`` with xxh3-128.

A *layer* is what one command changed, as a canonical set of records
``(path, state-after | deleted)``: a path is recorded when its state before and after
differ, where a state covers the entry's type, permission bits, uid/gid and its content
(xxh3-128 of a file), symlink target or device number; never mtimes, inode numbers or
link counts. Records below a path that was deleted or became a non-directory are
dropped (the subtree went with it), so the layer is a function of the two states only.

Backends observe changes through an overlayfs upper directory (``UpperTracker``):
whiteouts (char device 0/0) are deletions, an opaque directory (``trusted.overlay.opaque``)
hides everything below it in the lower view, and a copy-up that changed nothing (``touch``,
a parent directory copied up for a new child) records nothing. The same parent state
plus the same changes gives the same version on every backend, and the cost is
proportional to what changed (the upper), not to the filesystem.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash
from aospec.runtime._fs import is_opaque, is_whiteout, walk_tree

__all__ = [
    "EMPTY_LAYER",
    "Layer",
    "UpperTracker",
    "base_version",
    "chain_version",
    "hash_file",
    "tree_layer",
]

_CHUNK = 1 << 20
_SMALL = 1 << 16
_VERSION_TAG = b"aospec.version.v1\0"
_BASE_TAG = b"aospec.base.v1\0"
_HEAD = struct.Struct("<cIII")

_KIND = {
    stat.S_IFREG: b"f",
    stat.S_IFDIR: b"d",
    stat.S_IFLNK: b"l",
    stat.S_IFCHR: b"c",
    stat.S_IFBLK: b"b",
    stat.S_IFIFO: b"p",
    stat.S_IFSOCK: b"s",
}

_buffer = bytearray(_CHUNK)


def hash_fd(fd: int, size_hint: int = -1) -> bytes:
    """xxh3-128 digest of everything readable from ``fd``."""
    if 0 <= size_hint < _SMALL:
        data = os.read(fd, _SMALL + 1)
        if len(data) <= _SMALL:
            rest = os.read(fd, _CHUNK) if len(data) == _SMALL + 1 else b""
            if not rest:
                return xxhash.xxh3_128_digest(data)
            h = xxhash.xxh3_128(data)
            h.update(rest)
            return _hash_rest(fd, h)
        return _hash_rest(fd, xxhash.xxh3_128(data))
    return _hash_rest(fd, xxhash.xxh3_128())


def _hash_rest(fd: int, h: xxhash.xxh3_128) -> bytes:
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.digest()


def hash_file(path: str | bytes) -> bytes:
    """xxh3-128 digest of a file's content (never follows a final symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return hash_fd(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _header(st: os.stat_result) -> bytes:
    return _HEAD.pack(_KIND.get(stat.S_IFMT(st.st_mode), b"?"), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)


def _state(dirfd: int, name: bytes, st: os.stat_result) -> bytes:
    """The canonical state of one entry (never None: callers handle absence/whiteouts)."""
    head = _header(st)
    fmt = stat.S_IFMT(st.st_mode)
    if fmt == stat.S_IFREG:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            return head + hash_fd(fd, st.st_size)
        finally:
            os.close(fd)
    if fmt == stat.S_IFLNK:
        return head + os.readlink(name, dir_fd=dirfd)
    if fmt in (stat.S_IFCHR, stat.S_IFBLK):
        return head + struct.pack("<II", os.major(st.st_rdev), os.minor(st.st_rdev))
    return head


def chain_version(parent: str, layer_digest: bytes) -> str:
    """``H(parent_version, H(layer))`` as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(_VERSION_TAG + bytes.fromhex(parent) + layer_digest)


def base_version(tree_digest: bytes) -> str:
    """The version of a base filesystem whose whole tree hashes to ``tree_digest``."""
    return xxhash.xxh3_128_hexdigest(_BASE_TAG + tree_digest)


def _sort_key(path: bytes) -> list[bytes]:
    return path.split(b"/")


@dataclass(frozen=True, slots=True)
class Layer:
    """What one command changed: sorted ``(path, state)`` records, ``state`` None for a
    deletion. Paths are relative to the sandbox root, as bytes."""

    records: tuple[tuple[bytes, bytes | None], ...]

    @property
    def digest(self) -> bytes:
        h = xxhash.xxh3_128()
        for path, state in self.records:
            h.update(struct.pack("<I", len(path)) + path)
            h.update(b"-" if state is None else b"+" + struct.pack("<I", len(state)) + state)
        return h.digest()

    def __bool__(self) -> bool:
        return bool(self.records)

    @classmethod
    def between(cls, before: Mapping[bytes, bytes], after: Mapping[bytes, bytes]) -> Layer:
        """The layer that turns full-tree records ``before`` into ``after`` (path -> state,
        as :func:`tree_layer` gives them). O(tree): the reference that the incremental
        trackers are checked against; a deleted or replaced non-directory hides its subtree."""
        records: list[tuple[bytes, bytes | None]] = []
        gone: set[bytes] = set()
        memo: dict[bytes, bool] = {}
        for p in sorted(set(before) | set(after), key=_sort_key):
            if _below_gone(gone, memo, p):
                continue
            state = after.get(p)
            if before.get(p) != state:
                records.append((p, state))
                if state is None or state[:1] != b"d":
                    gone.add(p)
        return cls(tuple(records))

    def apply_to(self, version: str) -> str:
        """The version after this layer on top of ``version`` (unchanged when empty)."""
        return chain_version(version, self.digest) if self.records else version

    def describe(self) -> list[tuple[str, str]]:
        """``("/path", kind)`` per record, kind one of deleted, file, dir, symlink, ..."""
        names = {
            b"f": "file",
            b"d": "dir",
            b"l": "symlink",
            b"c": "chardev",
            b"b": "blockdev",
            b"p": "fifo",
            b"s": "socket",
        }
        return [("/" + os.fsdecode(p), "deleted" if s is None else names.get(s[:1], "other")) for p, s in self.records]


EMPTY_LAYER = Layer(())


_MAX_OPEN_DIRS = 128  # directory descriptors a _TreeReader keeps (the rest reopen on demand)


class _TreeReader:
    """Reads a directory tree by relative path without ever following a symlink out of it
    (each component is opened O_NOFOLLOW relative to its parent), at any depth: no path
    longer than one component reaches the kernel, and at most ``_MAX_OPEN_DIRS``
    directories stay open (least recently used ones are closed)."""

    def __init__(self, root: bytes | None) -> None:
        self._root = None if root is None else os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._open: OrderedDict[bytes, int] = OrderedDict()
        self._absent: set[bytes] = set()  # directories known not to exist

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()
        if self._root is not None:
            os.close(self._root)
            self._root = None

    def dir_fd(self, rel: bytes) -> int | None:
        """A descriptor of directory ``rel`` (valid until the next call), None if absent."""
        if not rel:
            return self._root
        fd = self._open.get(rel)
        if fd is not None:
            self._open.move_to_end(rel)
            return fd
        if rel in self._absent:
            return None
        # the deepest ancestor already known, then one component at a time from there
        cut = len(rel)
        while True:
            cut = rel.rfind(b"/", 0, cut)
            if cut < 0:
                fd, done = self._root, 0
                break
            if rel[:cut] in self._absent:
                self._absent.add(rel)
                return None
            fd = self._open.get(rel[:cut])
            if fd is not None:
                done = cut + 1
                break
        while fd is not None:
            end = rel.find(b"/", done)
            end = len(rel) if end < 0 else end
            prefix = rel[:end]
            try:
                fd = os.open(rel[done:end], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES):
                    raise
                self._absent.add(prefix)
                fd = None
                break
            self._open[prefix] = fd
            if len(self._open) > _MAX_OPEN_DIRS:  # never the one just opened
                os.close(self._open.popitem(last=False)[1])
            if end == len(rel):
                break
            done = end + 1
        if fd is None:
            self._absent.add(rel)
        return fd

    def lstat(self, rel: bytes) -> tuple[int, bytes, os.stat_result] | None:
        """(parent dir fd, name, stat) or None when absent (whiteouts count as absent)."""
        parent, _, name = rel.rpartition(b"/")
        pfd = self.dir_fd(parent)
        if pfd is None:
            return None
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return None
            raise
        if is_whiteout(st):
            return None
        return pfd, name, st

    def state(self, rel: bytes) -> bytes | None:
        found = self.lstat(rel)
        return None if found is None else _state(found[0], found[1], found[2])

    def children(self, rel: bytes) -> list[bytes]:
        fd = self.dir_fd(rel)
        if fd is None:
            return []
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            return [os.fsencode(n) for n in os.listdir(dfd)]
        finally:
            os.close(dfd)


@dataclass(slots=True)
class _Seen:
    fp: tuple[int, ...]
    state: bytes | None  # None: a whiteout (the path is deleted)
    is_dir: bool
    opaque: bool


def _fingerprint(st: os.stat_result, opaque: bool) -> tuple[int, ...]:
    return (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_rdev, opaque)


class _Hiding:
    """Whether the upper entries in ``seen`` hide the lower view at a path (a whiteout,
    a non-directory or an opaque directory at it or above it), memoised per directory
    so that deep paths cost O(length), not O(depth x length)."""

    def __init__(self, seen: Mapping[bytes, _Seen]) -> None:
        self._seen = seen
        self._memo: dict[bytes, bool] = {b"": False}

    def at_or_above(self, path: bytes) -> bool:
        memo = self._memo
        if path in memo:
            return memo[path]
        todo = []
        while path not in memo:
            todo.append(path)
            path = path.rpartition(b"/")[0]
        hidden = memo[path]
        for p in reversed(todo):
            if not hidden:
                entry = self._seen.get(p)
                hidden = entry is not None and (entry.state is None or not entry.is_dir or entry.opaque)
            memo[p] = hidden
        return hidden

    def above(self, path: bytes) -> bool:
        return self.at_or_above(path.rpartition(b"/")[0])


def _below_gone(gone: set[bytes], memo: dict[bytes, bool], path: bytes) -> bool:
    """Whether a strict ancestor of ``path`` is in ``gone``, for paths visited parents
    first (``memo[d]``: d or an ancestor of d is in ``gone``; stable once computed, since
    a directory is visited, and added to ``gone`` or not, before anything below it)."""
    d = path.rpartition(b"/")[0]
    todo = []
    while d and d not in memo:
        todo.append(d)
        d = d.rpartition(b"/")[0]
    found = memo[d] if d else False
    for p in reversed(todo):
        found = found or p in gone
        memo[p] = found
    return found


class UpperTracker:
    """Turns the changes one command made to an overlayfs upper directory into a Layer.

    The upper may be fresh (the overlay backend freezes it into a layer when it forks or
    commits) or cumulative (a Docker container's layer): the tracker remembers each upper
    entry's fingerprint and state, so each ``diff()`` covers only what the last command
    changed. ``lower`` returns the read-only lower view (a directory whose tree is the
    filesystem under the upper), or None for an empty one.
    """

    def __init__(self, upper: str | bytes, lower: Callable[[], str | bytes | None]) -> None:
        self.upper = os.fsencode(upper)
        self._lower = lower
        self._seen: dict[bytes, _Seen] = {}

    def reset(self) -> None:
        """Forget everything: the upper is empty again (after a freeze)."""
        self._seen = {}

    def _scan(
        self, old: Mapping[bytes, _Seen], known: Mapping[bytes, bytes | None] | None = None
    ) -> tuple[dict[bytes, tuple[os.stat_result, bool]], dict[bytes, _Seen]]:
        """Every upper entry's (lstat, opaque), and a fresh _Seen for each entry whose
        fingerprint differs from ``old`` (its state read now, through its directory's
        descriptor: any depth works). ``known`` gives states already computed for some
        non-directories (a copied upper)."""
        now: dict[bytes, tuple[os.stat_result, bool]] = {}
        new: dict[bytes, _Seen] = {}
        known = known or {}
        root = os.open(self.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for step in walk_tree(root):
                if step.depth:
                    op = is_opaque(step.fd)
                    now[step.rel] = (step.st, op)
                    fp = _fingerprint(step.st, op)
                    seen = old.get(step.rel)
                    if seen is None or seen.fp != fp:
                        new[step.rel] = _Seen(fp, _header(step.st), True, op)
                prefix = step.rel + b"/" if step.rel else b""
                for entry in step.entries:
                    if entry.is_dir(follow_symlinks=False):
                        continue  # recorded at its own step, with its opaque marker
                    st = entry.stat(follow_symlinks=False)
                    name = os.fsencode(entry.name)
                    p = prefix + name
                    now[p] = (st, False)
                    fp = _fingerprint(st, False)
                    seen = old.get(p)
                    if seen is None or seen.fp != fp:
                        if is_whiteout(st):
                            state = None
                        elif known.get(p) is not None:
                            state = known[p]
                        else:
                            state = _state(step.fd, name, st)
                        new[p] = _Seen(fp, state, False, False)
        finally:
            os.close(root)
        return now, new

    def adopt(self, known: Mapping[bytes, bytes | None] | None = None) -> None:
        """Take the upper's current content as the starting state (nothing recorded).
        ``known`` gives states already computed for some paths (a copied upper)."""
        known = {p: s for p, s in (known or {}).items() if s is not None and s[:1] != b"d"}
        self._seen = self._scan({}, known)[1]

    def states(self) -> dict[bytes, bytes | None]:
        """The state of every upper entry as last seen (None for a whiteout)."""
        return {p: s.state for p, s in self._seen.items()}

    def snapshot(self) -> dict[str, list[Any]]:
        """A JSON-able copy of what the tracker knows, for ``restore`` after a restart."""
        return {
            os.fsdecode(p): [None if s.state is None else s.state.hex(), s.is_dir, s.opaque]
            for p, s in self._seen.items()
        }

    def restore(self, snapshot: Mapping[str, list[Any]]) -> None:
        """Believe ``snapshot`` describes the upper; the next ``diff`` re-examines every
        entry (fingerprints are not kept) and records only real differences."""
        self._seen = {
            os.fsencode(p): _Seen((), None if v[0] is None else bytes.fromhex(v[0]), bool(v[1]), bool(v[2]))
            for p, v in snapshot.items()
        }

    def diff(self) -> Layer:
        """The Layer of changes since the last ``diff``/``adopt``/``reset``."""
        old = self._seen
        now, new = self._scan(old)
        removed = [p for p in old if p not in now]
        if not new and not removed:
            return EMPTY_LAYER
        lower_root = self._lower()
        lower = _TreeReader(os.fsencode(lower_root) if lower_root is not None else None)
        try:
            seen_now = {p: new.get(p) or old[p] for p in now}
            candidates = set(new) | set(removed)
            # A directory that now hides the lower view (opaque) while it did not before:
            # everything below it in the lower view may have vanished.
            hidden_before = _Hiding(old)
            for p, entry in new.items():
                if entry.is_dir and entry.opaque and not hidden_before.at_or_above(p):
                    self._lower_subtree(lower, p, seen_now, candidates)
            records = self._records(sorted(candidates, key=_sort_key), old, seen_now, now, lower)
            self._seen = seen_now
            return Layer(records)
        finally:
            lower.close()

    @staticmethod
    def _lower_subtree(lower: _TreeReader, top: bytes, seen_now: dict[bytes, _Seen], out: set[bytes]) -> None:
        stack = [top]
        while stack:
            d = stack.pop()
            for name in lower.children(d):
                child = d + b"/" + name
                out.add(child)
                after = seen_now.get(child)
                if after is not None and after.is_dir and after.state is not None:
                    stack.append(child)

    @staticmethod
    def _records(
        paths: Iterable[bytes],
        old: dict[bytes, _Seen],
        seen_now: dict[bytes, _Seen],
        now: dict[bytes, tuple[os.stat_result, bool]],
        lower: _TreeReader,
    ) -> tuple[tuple[bytes, bytes | None], ...]:
        records: list[tuple[bytes, bytes | None]] = []
        gone: set[bytes] = set()  # recorded paths whose subtree went with them
        gone_memo: dict[bytes, bool] = {}
        hidden_now, hidden_before = _Hiding(seen_now), _Hiding(old)
        for p in paths:
            if _below_gone(gone, gone_memo, p):
                continue
            # state after
            if p in seen_now:
                after = seen_now[p].state
                after_st = now[p][0]
            elif hidden_now.above(p):
                after, after_st = None, None
            else:
                found = lower.lstat(p)
                after = None if found is None else _state(*found)
                after_st = None if found is None else found[2]
            # state before, compared lazily: hashing a lower file only when its metadata
            # and size match the new one
            if p in old:
                differs = old[p].state != after
            elif hidden_before.above(p):
                differs = after is not None
            else:
                found = lower.lstat(p)
                if found is None or after is None:
                    differs = (found is None) != (after is None)
                else:
                    st0 = found[2]
                    size_differs = (
                        stat.S_ISREG(st0.st_mode) and after_st is not None and st0.st_size != after_st.st_size
                    )
                    differs = _header(st0) != after[: _HEAD.size] or size_differs or _state(*found) != after
            if differs:
                records.append((p, after))
                if after is None or after[:1] != b"d":
                    gone.add(p)
        return tuple(records)


def tree_layer(root: str | bytes) -> Layer:
    """Every entry of the tree at ``root`` as added to an empty filesystem (used to give a
    base filesystem its version)."""
    tracker = UpperTracker(root, lambda: None)
    return tracker.diff()
