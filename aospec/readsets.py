"""Read-set validation: forks that survive unrelated commits (docs/engine.md, "Read sets").

JASV reuses a fork only when its origin version is the committed version. A fork whose
origin is older is still exactly what serial execution would give when nothing the steps
committed since its origin changed is among what its command looked at: its *read set*
(:class:`ReadSet`, recorded by the sandbox while the fork ran) is disjoint from the union of
the committed steps' *write sets* (:class:`WriteSet`, from their layers), and the fork's own
changes touch nothing they changed. Such a fork is *rebased*: its changes are put on top of
the committed state (:class:`aospec.protocols.ReadSetSandbox`).

Paths are relative to the sandbox root, ``/``-separated, without a leading slash (``""`` is
the root), and resolved: no symlink, ``.`` or ``..`` in them (the sandbox resolved them in the
states the command saw). Names that are not UTF-8 are kept with ``os.fsdecode``'s escapes.

The rule (:func:`conflict`), with ``w <= p`` meaning ``w`` is ``p`` or an ancestor of it:

- ``lookups`` (a path resolved, stat'ed for existence, exec'ed, ``access``, ``chdir``, a failed
  lookup): conflict when a changed path ``w <= p`` (its existence, type, mode, owner,
  content or link target, or an ancestor's, moved);
- ``nodes`` (opened, stat'ed: times, link counts and sizes seen too): also when ``p`` was
  touched (a non-directory whose inode the step modified in any way, its times included) or
  is a directory whose entries or times changed;
- ``lists`` (a directory's entries read): a lookup's conflicts, or its entries changed;
- ``trees`` (everything at and below ``p``: a rename's source and target): a lookup's
  conflicts, or anything written at or below ``p``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ReadSet", "ReadSetValidator", "WriteSet", "ancestors", "conflict", "fork_conflict"]


def ancestors(path: str) -> Iterator[str]:
    """``path`` and each of its ancestors, innermost first, the root ``""`` last."""
    yield path
    while path:
        path = path.rpartition("/")[0]
        yield path


def _paths(value: Any, what: str) -> frozenset[str]:
    if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{what}: expected a list of paths")
    return frozenset(value)


@dataclass(frozen=True, slots=True)
class ReadSet:
    """What one command looked at (see the module docstring for each kind)."""

    lookups: frozenset[str] = frozenset()
    nodes: frozenset[str] = frozenset()
    lists: frozenset[str] = frozenset()
    trees: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self.lookups) + len(self.nodes) + len(self.lists) + len(self.trees)

    def to_json(self) -> dict[str, list[str]]:
        return {k: sorted(getattr(self, k)) for k in ("lookups", "nodes", "lists", "trees")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReadSet:
        """The inverse of :meth:`to_json` (ValueError naming the bad key)."""
        unknown = set(data) - {"lookups", "nodes", "lists", "trees"}
        if unknown:
            raise ValueError(f"read set: unknown keys {sorted(unknown)}")
        return cls(**{k: _paths(v, f"read set {k}") for k, v in data.items()})


@dataclass(frozen=True, slots=True)
class WriteSet:
    """What one committed step changed, from its layer.

    ``changed``: paths whose versioned state changed (the layer's records; a deleted
    directory stands for its whole subtree). ``touched``: every non-directory whose inode the
    step created, modified (times included), copied up or deleted. ``entries``: directories
    whose entries (names and types) or own times changed."""

    changed: frozenset[str] = frozenset()
    touched: frozenset[str] = frozenset()
    entries: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.changed or self.touched or self.entries)

    def union(self, other: WriteSet) -> WriteSet:
        if not other:
            return self
        if not self:
            return other
        return WriteSet(self.changed | other.changed, self.touched | other.touched, self.entries | other.entries)

    def to_json(self) -> dict[str, list[str]]:
        return {k: sorted(getattr(self, k)) for k in ("changed", "touched", "entries")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WriteSet:
        """The inverse of :meth:`to_json` (ValueError naming the bad key)."""
        unknown = set(data) - {"changed", "touched", "entries"}
        if unknown:
            raise ValueError(f"write set: unknown keys {sorted(unknown)}")
        return cls(**{k: _paths(v, f"write set {k}") for k, v in data.items()})


class _Index:
    """A write set prepared for many checks: ``below`` holds every written path and all
    their ancestors (a tree read at ``t`` conflicts when ``t`` is in it)."""

    __slots__ = ("below", "writes")

    def __init__(self, writes: WriteSet) -> None:
        self.writes = writes
        below: set[str] = set()
        for p in (*writes.changed, *writes.touched, *writes.entries):
            for a in ancestors(p):
                if a in below:
                    break
                below.add(a)
        self.below = below

    def lookup_conflict(self, path: str) -> bool:
        changed = self.writes.changed
        return any(a in changed for a in ancestors(path)) if changed else False


def _first(paths: Iterable[str], hit: Any) -> str | None:
    for p in sorted(paths):
        if hit(p):
            return p
    return None


def conflict(reads: ReadSet, writes: WriteSet) -> str | None:
    """The first read path ``writes`` invalidates (the module docstring's rule), as
    ``"kind path"``, or None when the read set is disjoint from the write set."""
    if not writes:
        return None
    ix = _Index(writes)
    w = writes
    checks = (
        ("lookup", reads.lookups, ix.lookup_conflict),
        ("node", reads.nodes, lambda p: p in w.touched or p in w.entries or ix.lookup_conflict(p)),
        ("list", reads.lists, lambda p: p in w.entries or ix.lookup_conflict(p)),
        ("tree", reads.trees, lambda p: p in ix.below or ix.lookup_conflict(p)),
    )
    for kind, paths, hit in checks:
        found = _first(paths, hit)
        if found is not None:
            return f"{kind} /{found}"
    return None


def fork_conflict(fork_writes: WriteSet, writes: WriteSet) -> str | None:
    """Whether a fork's own changes can be put on top of ``writes``: none of the paths it
    wrote (or copied up) may lie at or below a path ``writes`` changed, and no file it
    touched may have been touched there too (its copy would hide theirs). Directories
    both changed entries of merge. Returns ``"write path"`` or None."""
    if not writes:
        return None
    ix = _Index(writes)
    found = _first(
        (*fork_writes.changed, *fork_writes.touched, *fork_writes.entries),
        lambda p: ix.lookup_conflict(p) or p in writes.touched,
    )
    return None if found is None else f"write /{found}"


class ReadSetValidator:
    """The committed steps' write sets, by the version each step started from: whether a
    fork from an older origin is still valid (:meth:`check`).

    :meth:`committed` is called for every committed step, read-only ones included (a step
    that only touched times keeps the version but still has a write set), with ``writes``
    None when the step's write set is unknown: no fork from before it can be validated.
    """

    __slots__ = ("_chain", "_since")

    def __init__(self, version: str) -> None:
        self._chain: list[WriteSet | None] = []
        # version -> index in _chain of the first step committed from it
        self._since: dict[str, int] = {version: 0}

    def committed(self, before: str, after: str, writes: WriteSet | None) -> None:
        """Step ``before -> after`` was committed with write set ``writes``."""
        if writes is not None and not writes and before == after:
            return
        self._since.setdefault(before, len(self._chain))
        self._chain.append(writes)
        self._since.setdefault(after, len(self._chain))

    def reset(self, version: str) -> None:
        """Forget every step: no fork from before ``version`` is of interest any more."""
        self._chain.clear()
        self._since = {version: 0}

    def writes_since(self, origin: str) -> WriteSet | None:
        """The union of the write sets committed since ``origin`` was the committed version
        (from the first time it was, to be safe), or None when unknown."""
        start = self._since.get(origin)
        if start is None:
            return None
        out = WriteSet()
        for ws in self._chain[start:]:
            if ws is None:
                return None
            out = out.union(ws)
        return out

    def check(self, origin: str, reads: ReadSet | None, fork_writes: WriteSet | None) -> str | None:
        """Why a fork from ``origin`` with ``reads`` and its own ``fork_writes`` is not
        valid at the committed version, or None when it is."""
        if reads is None or fork_writes is None:
            return "its reads were not tracked"
        writes = self.writes_since(origin)
        if writes is None:
            return "a write set since its origin is unknown"
        return conflict(reads, writes) or fork_conflict(fork_writes, writes)
