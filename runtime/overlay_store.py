"""The overlay backend's store: one state directory of layers, HEAD and the live
sandboxes' mounts (``aospec.runtime.overlay`` holds the sandboxes that run on it).


State directory (one per session, ``SandboxConfig.state_dir``; mode 0700, like the state
root above private ones, and every mount below it is nosuid,nodev)::

    HEAD        the committed state: {"version", "layers" (top first), "base",
                "digests" (content digest of each disk layer, checked on reopen), ...};
                replaced atomically (write + rename): the only source of truth
    lock        flock held by the owning process
    ID          the store id (names its cgroups)
    l/<id>/     immutable layers on disk (overlayfs upper format: whiteouts, opaque dirs)
    ml/         a tmpfs of mount points: ml/m<id>/ is an immutable *memory layer*, the
                read-only tmpfs that was a sandbox's upper (moved here, never copied)
    s/          a tmpfs holding one directory per live sandbox: rw/ (a tmpfs of
                ``disk_bytes``) with u/ (upper) and w/ (work), m/ (the merged root),
                lv/ (read-only view of its lower stack)
    u/<id>/     upper and work of a sandbox when ``disk_bytes`` is None (on disk)
    trash/      disk layers and uppers no longer used, deleted in batches

A command runs in ``m/``. Afterwards the upper's changes become a Layer and the version
moves on (``aospec.runtime.versions``). Freezing an upper (the committed root does it after
every command that wrote anything, a fork when it is forked again or committed) moves
its tmpfs under ``ml/`` and remounts it read-only: O(1), so commits cost a few mounts and
one HEAD write. Memory layers are merged into a disk layer (compaction, which keeps the
version) when the stack gets deep, when they hold more than ``memory_layers_bytes``, and
when a persistent state directory is closed. Every write of HEAD names complete,
immutable layers, so a crash at any instant leaves the committed state intact; memory
layers survive the crash of the process (not a reboot: use ``durable=True``, which keeps
the committed state on disk and fsyncs it). Opening a state directory recovers it: every
mount below it but HEAD's memory layers is detached, every sandbox directory,
unreferenced layer and stale cgroup removed; a persistent one is then verified: HEAD's
disk layers must still hash to the digests HEAD recorded (``verify_state_dir`` does the
same without opening it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aospec.runtime import _fs
from aospec.runtime._integrity import layer_digest
from aospec.runtime._session import SandboxSession
from aospec.runtime._state import (
    RecoveryReport,
    StateDir,
    new_id,
    store_identity,
    unregister_store,
    write_atomic,
)
from aospec.runtime.bases import BaseFS
from aospec.runtime.cgroups import POOL
from aospec.runtime.config import SandboxConfig
from aospec.runtime.host import host_support
from aospec.runtime.processes import kill_all_marked
from aospec.runtime.versions import base_version, tree_layer

from aospec.errors import SandboxError

__all__ = ["MOUNT_OPTS", "OverlayStore", "StateCheck", "fd_names", "verify_state_dir"]

#: a sandbox's mount. ``index=on``: a copy-up of one name of a hard-linked file keeps its
#: other names on the same inode while the mount lives (overlayfs's inode index; the
#: sandbox then copies those names up too before its upper becomes a layer,
#: :meth:`aospec.runtime.overlay.OverlaySandbox._keep_hard_links`), as a plain filesystem
#: would. Where the layers' filesystems cannot encode file handles the kernel falls back
#: to ``index=off`` by itself (links then break on copy-up, as before).
MOUNT_OPTS = "redirect_dir=off,metacopy=off,index=on,xino=off"
_HEAD_SCHEMA = 1
_MAX_LOWERDIR = 3000  # the whole mount option string must fit in one 4 KiB page
_MAX_GRAVES = 8  # committed forks whose teardown may wait


def _is_memory(lid: str) -> bool:
    return lid.startswith("m")


class OverlayStore:
    """A state directory: layers, HEAD, live sandboxes' mounts. Owned by one process."""

    def __init__(self, path: Path, base: BaseFS, config: SandboxConfig, *, ephemeral: bool) -> None:
        self.path = path
        self.base = base
        self.config = config
        self.ephemeral = ephemeral
        self.id = ""
        self.recovery = RecoveryReport()
        self.dir = path  # the held directory's /proc/PID/fd/N name once open (StateDir.dir)
        self._state: StateDir | None = None
        # content digests of disk layers (aospec.runtime._integrity), kept in HEAD so that a
        # reopened persistent state is checked against what its version was made from
        self.digests: dict[str, str] = {}
        self._refs: dict[str, int] = {}
        self.mem_bytes: dict[str, int] = {}
        self.head_version = base.version
        self.head_layers: tuple[str, ...] = ()
        self.shell = "/bin/bash" if os.path.lexists(base.path / "bin/bash") else "/bin/sh"
        self._cg_counter = 0
        self.seccomp_program: bytes | None = None  # compiled by open_overlay
        self.compactions = 0
        self.index_off_mounts = 0  # sandbox mounts made with index=off (OverlaySandbox._mount_overlay)
        self._head_written = False  # HEAD is on disk (a private state dir writes it once)
        # Open sandboxes by id (aospec.runtime.overlay.OverlaySandbox; typed by the base class so
        # this file does not import the sandbox file that imports it).
        self.live: dict[str, SandboxSession] = {}
        # read-only views of layer stacks, shared by the sandboxes on the same stack
        # (sibling forks); used from worker threads, hence the lock
        self._views: dict[tuple[str, ...], list[Any]] = {}
        self._views_lock = threading.Lock()
        # teardowns of committed forks, done off the commit (bury_later / bury)
        self._graves: list[Callable[[], None]] = []
        self._graves_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Check, lock, recover and load (blocking). A directory that is neither new,
        empty nor an overlay state is refused before anything in it changes."""
        self._state = StateDir(self.path, backend="overlay")
        self.dir = self._state.dir
        try:
            self.id = store_identity(self._state, ephemeral=self.ephemeral)
            for d in ("l", "s", "u", "trash", "ml"):
                try:
                    (self.dir / d).mkdir(exist_ok=True)
                except FileExistsError:
                    raise SandboxError(f"{self.path}/{d} is not a directory; the state directory is damaged") from None
            b = self.dir / "b"
            if os.path.lexists(b) and not b.is_symlink():
                raise SandboxError(
                    f"{self.path}/b is not the symlink to the base aospec makes; the state directory is damaged"
                )
            b.unlink(missing_ok=True)
            os.symlink(self.base.path, b)
            self._load_head()
            self.recovery = self._recover()
            if not self.ephemeral:
                self.verify()
            # sandbox directories live on a tmpfs: creating and deleting them (and their
            # mount points) must not touch the disk
            _fs.mount("tmpfs", str(self.dir / "s"), "tmpfs", 0, "size=16m,mode=0700")
            _fs.make_private(str(self.dir / "s"))
        except BaseException:
            self.close()
            raise

    def _load_head(self) -> None:
        head = self.dir / "HEAD"
        if not head.exists():
            self.write_head(self.base.version, ())
            return
        try:
            data = json.loads(head.read_text())
            version, layers, base_version = data["version"], tuple(data["layers"]), data["base_version"]
            self.digests = {str(k): str(v) for k, v in data.get("digests", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SandboxError(f"{head}: unreadable HEAD ({exc}); the state directory is damaged") from None
        if base_version != self.base.version:
            raise SandboxError(
                f"state directory {self.path} was created from a base with version {base_version}, "
                f"not {self.base.version} ({self.base.path}); open it with the same base or use a new state dir"
            )
        missing = [lid for lid in layers if not _is_memory(lid) and not (self.dir / "l" / lid).is_dir()]
        if missing:
            raise SandboxError(f"{head}: layers {missing} are missing; the state directory is damaged")
        self.head_version, self.head_layers = version, layers

    def verify(self) -> None:
        """Check that HEAD's disk layers still hold what they held when HEAD named them
        (their content digests); raise SandboxError naming what differs and the fix."""
        problems = _layer_problems(self.dir, self.head_layers, self.digests, memory_ok=True)
        if problems:
            raise SandboxError(
                f"state directory {self.path} no longer holds the state its version {self.head_version} names: "
                + "; ".join(problems)
                + ". Its content cannot be trusted: restore the directory from a backup or use a new state dir "
                "(`aospec sandbox verify` checks it without opening it)"
            )

    def _recover(self) -> RecoveryReport:
        ml = str(self.dir / "ml")
        keep = {ml} | {f"{ml}/{lid}" for lid in self.head_layers if _is_memory(lid)}
        sandboxes = [d.name for d in (self.dir / "s").iterdir()] + [d.name for d in (self.dir / "u").iterdir()]
        # a session killed while bwrap was setting up can leave its sandbox init blocked
        # forever (its parent died before releasing it): find them by their marker
        orphans = kill_all_marked(f"aospec-{self.id}-")
        unmounted = _fs.unmount_all_under(str(self.dir), keep=keep)
        if ml not in _fs.mounts_under(ml):
            _fs.mount("tmpfs", ml, "tmpfs", 0, "size=4m,mode=0700")
            _fs.make_private(ml)
        mounted = set(_fs.mounts_under(ml))
        lost = [lid for lid in self.head_layers if _is_memory(lid) and f"{ml}/{lid}" not in mounted]
        if lost:
            raise SandboxError(
                f"{self.path}/HEAD names in-memory layers {lost} that no longer exist (the machine restarted?); "
                "the committed state is lost: use a new state dir (durable=True keeps it on disk)"
            )
        for lid in self.head_layers:
            if _is_memory(lid):
                self.mem_bytes[lid] = _tmpfs_used(self.dir / "ml" / lid)
        cgs = self._reset_cgroups()
        layers = []
        for d in (self.dir / "ml").iterdir():
            if d.name not in self.head_layers:
                d.rmdir()
                layers.append(d.name)
        for d in (self.dir / "s").iterdir():
            _fs.remove_tree(d)
        for d in (self.dir / "u").iterdir():
            self.trash(d)
        for d in (self.dir / "l").iterdir():
            if d.name not in self.head_layers:
                self.trash(d)
                layers.append(d.name)
        for name in ("HEAD.tmp", "ID.tmp"):  # only what aospec writes (write_atomic)
            (self.dir / name).unlink(missing_ok=True)
        self.purge_trash()
        unmounted = [self.shown(p) for p in unmounted]
        return RecoveryReport(tuple(unmounted), tuple(sandboxes), tuple(layers), tuple(cgs), processes=tuple(orphans))

    def shown(self, path: str) -> str:
        """``path`` below :attr:`dir` named below the state directory's own name."""
        return str(self.path) + path[len(str(self.dir)) :] if path.startswith(str(self.dir)) else path

    def bury_later(self, teardown: Callable[[], None]) -> None:
        """Keep a committed fork's teardown for :meth:`bury` (at most a few: past them a
        commit buries them itself)."""
        with self._graves_lock:
            self._graves.append(teardown)
            due = len(self._graves) > _MAX_GRAVES
        if due:
            self.bury()

    def bury(self) -> None:
        """Tear down the committed forks :meth:`bury_later` kept (blocking)."""
        with self._graves_lock:
            graves, self._graves = self._graves, []
        for teardown in graves:
            teardown()

    def trash(self, path: Path) -> None:
        """Move ``path`` out of the way now; it is deleted by ``purge_trash`` (deleting on
        a disk can cost milliseconds per directory)."""
        os.rename(path, self.dir / "trash" / f"{path.name}-{new_id()}")

    def purge_trash(self, *, above: int = 0) -> None:
        entries = list((self.dir / "trash").iterdir())
        if len(entries) > above:
            for d in entries:
                _fs.remove_tree(d)

    def spill_head(self) -> None:
        """Move HEAD's memory layers into a disk layer (before closing a persistent store)."""
        mem = [i for i, lid in enumerate(self.head_layers) if _is_memory(lid)]
        if not mem:
            return
        k = mem[-1] + 1
        merged = self.compact(self.head_layers, k)
        old = self.head_layers
        self.write_head(self.head_version, (merged, *old[k:]))
        self._refs.pop(merged, None)

    def close(self) -> None:
        """Detach every mount, drop the lock; delete everything when ephemeral."""
        state = self._state
        if state is None:
            return
        try:
            _fs.unmount_all_under(str(self.dir))
            if self.ephemeral:
                state.remove()
            else:
                for d in (self.dir / "u").iterdir() if (self.dir / "u").exists() else ():
                    self.trash(d)
                for d in (self.dir / "ml").iterdir() if (self.dir / "ml").exists() else ():
                    d.rmdir()
                self._gc_layers()
                self.purge_trash()
        finally:
            try:
                if self.id:
                    _, cgroups = host_support()
                    if cgroups is not None:
                        cgroups.remove(self.cgroup)
            finally:
                if self.id:
                    unregister_store(self.id)
                state.close()
                self._state = None

    # -- layers ---------------------------------------------------------------------------------

    def layer_ids(self) -> list[str]:
        """Every layer present in the state directory (disk and memory), sorted."""
        return sorted([d.name for d in (self.dir / "l").iterdir()] + [d.name for d in (self.dir / "ml").iterdir()])

    def layer_dir(self, lid: str) -> Path:
        return self.dir / "ml" / lid / "u" if _is_memory(lid) else self.dir / "l" / lid

    def lowerdir(self, stack: tuple[str, ...]) -> str:
        return ":".join([*(str(self.layer_dir(lid)) for lid in stack), f"{self.dir}/b"])

    def ref(self, stack: tuple[str, ...]) -> None:
        for lid in stack:
            self._refs[lid] = self._refs.get(lid, 0) + 1

    def unref(self, stack: tuple[str, ...]) -> list[str]:
        """Drop references; returns layers nobody uses any more (not HEAD's)."""
        dead = []
        for lid in stack:
            n = self._refs.get(lid, 0) - 1
            if n <= 0:
                self._refs.pop(lid, None)
                if lid not in self.head_layers:
                    dead.append(lid)
            else:
                self._refs[lid] = n
        return dead

    def delete_layers(self, lids: list[str]) -> None:
        for lid in lids:
            if _is_memory(lid):
                _fs.umount(str(self.dir / "ml" / lid), detach=True)
                (self.dir / "ml" / lid).rmdir()
                self.mem_bytes.pop(lid, None)
            else:
                self.trash(self.layer_dir(lid))
                self.digests.pop(lid, None)
        self.purge_trash(above=256)

    def _gc_layers(self) -> None:
        keep = set(self._refs) | set(self.head_layers)
        for d in (self.dir / "l").iterdir():
            if d.name not in keep:
                self.trash(d)

    def new_layer_from(self, upper: Path, *, rename: bool) -> str:
        """Freeze an unmounted upper directory into a new disk layer."""
        while True:
            lid = new_id()
            if not self.layer_dir(lid).exists():
                break
        if rename:
            os.rename(upper, self.layer_dir(lid))
        else:
            tmp = self.dir / "l" / f"{lid}.tmp"
            _fs.copy_tree(upper, tmp)
            if self.config.durable:
                _fs.sync_tree(tmp)
            os.rename(tmp, self.layer_dir(lid))
        self._record_digest(lid)
        return lid

    def _record_digest(self, lid: str) -> None:
        """Digest a new disk layer (a private state dir is never reopened: no need)."""
        if not self.ephemeral:
            self.digests[lid] = layer_digest(self.layer_dir(lid))

    def new_memory_layer(self, rw: Path) -> str:
        """Turn a sandbox's tmpfs (upper in ``u/``) into a memory layer: move the mount
        under ``ml/`` and make it read-only. O(1) in the size of the changes."""
        while True:
            lid = "m" + new_id()
            target = self.dir / "ml" / lid
            try:
                target.mkdir()
                break
            except FileExistsError:
                continue
        _fs.mount(str(rw), str(target), "", _fs.MS_MOVE)
        _fs.remount_readonly(str(target))
        self.mem_bytes[lid] = _tmpfs_used(target)
        return lid

    def write_head(self, version: str, layers: tuple[str, ...]) -> None:
        """Make (version, layers) the committed state. A private (ephemeral) state
        directory is never reopened: after its first HEAD, the committed state is kept in
        memory only (a commit costs no file write)."""
        if self.ephemeral and self._head_written:
            self.head_version, self.head_layers = version, layers
            return
        data = {
            "schema": _HEAD_SCHEMA,
            "version": version,
            "layers": list(layers),
            "base": str(self.base.path),
            "base_version": self.base.version,
            "digests": {lid: self.digests[lid] for lid in layers if lid in self.digests},
        }
        write_atomic(self.dir / "HEAD", (json.dumps(data) + "\n").encode(), durable=self.config.durable)
        self.head_version, self.head_layers = version, layers
        self._head_written = True

    def compaction_size(self, stack: tuple[str, ...]) -> tuple[int, bool]:
        """How many top layers of ``stack`` to merge now (0: none), and whether the merged
        layer may stay in memory (a deep stack of small changes) or must go to disk
        (memory layers hold more than ``memory_layers_bytes``)."""
        k = 0
        if len(stack) > self.config.compact_at or len(self.lowerdir(stack)) > _MAX_LOWERDIR:
            k = max(2, min(self.config.compact_at, len(stack)) // 2)
        mem = [i for i, lid in enumerate(stack) if _is_memory(lid)]
        live = sum(self.mem_bytes.get(lid, 0) for lid in self._live_memory())
        if mem and live > self.config.memory_layers_bytes:
            return min(max(k, mem[-1] + 1), len(stack)), False
        k = min(k, len(stack))
        # pages this process writes (a merge into memory) are charged to its own cgroup,
        # not to the session's budget: merge in memory only what memory_layers_bytes holds
        top = stack[:k]
        fits = all(_is_memory(lid) for lid in top) and live + sum(self.mem_bytes.get(lid, 0) for lid in top) <= (
            self.config.memory_layers_bytes
        )
        return k, fits and not self.config.durable

    def _live_memory(self) -> set[str]:
        return {lid for lid in self._refs if _is_memory(lid)} | {lid for lid in self.head_layers if _is_memory(lid)}

    def compact(self, stack: tuple[str, ...], k: int, memory: bool = False) -> str:
        """Merge the top ``k`` layers of ``stack`` into one new layer (blocking), on disk or
        (``memory``) in a new memory layer. The merged layer over the rest of the stack
        shows the same tree; the version is kept."""
        top = stack[:k]
        if memory:
            lid = "m" + new_id()
            mnt = self.dir / "ml" / lid
            mnt.mkdir()
            _fs.mount("tmpfs", str(mnt), "tmpfs", 0, "mode=0700")
            target = mnt / "u"
        else:
            lid = new_id()
            target = self.dir / "l" / f"{lid}.tmp"
        rest = stack[k:]
        try:
            _fs.copy_tree(self.layer_dir(top[-1]), target)
            for upper in reversed(top[:-1]):
                _apply_layer(self.layer_dir(upper), target)
            below = self.acquire_lower_view(rest) if rest else str(self.base.path)
            try:
                _drop_dead_whiteouts(target, below)
            finally:
                if rest:
                    self.release_lower_view(rest)
        except BaseException:
            if memory:
                _fs.umount(str(mnt), detach=True)
                mnt.rmdir()
            else:
                _fs.remove_tree(target)
            raise
        if memory:
            _fs.remount_readonly(str(mnt))
            self.mem_bytes[lid] = _tmpfs_used(mnt)
        else:
            if self.config.durable:
                _fs.sync_tree(target)
            os.rename(target, self.layer_dir(lid))
            self._record_digest(lid)
        self.compactions += 1
        return lid

    def acquire_lower_view(self, stack: tuple[str, ...]) -> str:
        """Mount (or share) a read-only overlay of ``stack``; release it when done."""
        with self._views_lock:
            view = self._views.get(stack)
            if view is None:
                path = self.dir / "s" / f"lv-{new_id()}"
                path.mkdir()
                _fs.mount("overlay", str(path), "overlay", _fs.MS_RDONLY, f"lowerdir={self.lowerdir(stack)}")
                view = self._views[stack] = [path, 0]
            view[1] += 1
            return str(view[0])

    def lower_view_path(self, stack: tuple[str, ...]) -> str:
        with self._views_lock:
            return str(self._views[stack][0])

    def release_lower_view(self, stack: tuple[str, ...]) -> None:
        with self._views_lock:
            view = self._views[stack]
            view[1] -= 1
            if view[1] == 0:
                del self._views[stack]
                _fs.umount(str(view[0]))
                view[0].rmdir()

    def next_cgroup(self, sid: str) -> str:
        self._cg_counter += 1
        return f"aospec-{self.id}-{sid}-{self._cg_counter}"

    def upper_bytes(self) -> int | None:
        """The size of a sandbox's tmpfs upper: ``disk_bytes``, never above a memory budget
        (a write past it then fails with ENOSPC, not with a kill)."""
        cfg = self.config
        sizes = [cfg.limits.disk_bytes, cfg.memory_budget_bytes, cfg.sandbox_memory_budget_bytes]
        present = [x for x in sizes if x is not None]
        return min(present) if present else None

    @property
    def cgroup(self) -> str:
        """The store's cgroup (the session's memory budget); sandboxes' nest in it."""
        return f"aospec-{self.id}"

    def cgroup_parents(self, sid: str) -> tuple[tuple[str, int | None], ...]:
        """The cgroups a command of sandbox ``sid`` nests in, with their memory budgets."""
        return (
            (self.cgroup, self.config.memory_budget_bytes),
            (f"{self.cgroup}-{sid}", self.config.sandbox_memory_budget_bytes),
        )

    def remove_sandbox_cgroup(self, sid: str) -> None:
        """Remove a sandbox's cgroup; what its commands left in memory layers stays
        charged to the store's (the kernel moves the charge to the parent)."""
        _, cgroups = host_support()
        if cgroups is not None:
            cgroups.remove(f"{self.cgroup}/{self.cgroup}-{sid}")

    def _reset_cgroups(self) -> list[str]:
        """Remove the cgroups a dead session of this store left and set the session's
        budget. The store's own cgroup is kept: the memory layers HEAD names are still
        charged to it, and stay inside the budget."""
        _, cgroups = host_support()
        if cgroups is None:
            return []
        removed = cgroups.remove_stale(f"{self.cgroup}-")  # flat ones (older aospec)
        removed += cgroups.remove_stale(f"{self.cgroup}-", under=self.cgroup)
        removed += cgroups.remove_stale(f"{self.cgroup}-", under=POOL)  # background commands'
        try:
            cgroups.ensure_group(self.cgroup, self.config.memory_budget_bytes, update=True)
        except OSError as exc:
            used = cgroups.memory_usage(self.cgroup)
            raise SandboxError(
                f"cannot set the memory budget of {self.path} to {self.config.memory_budget_bytes} bytes ({exc}); "
                f"its in-memory layers already hold {used} bytes: raise memory_budget_bytes"
            ) from None
        return removed


def _layer_problems(path: Path, layers: tuple[str, ...], digests: Mapping[str, str], *, memory_ok: bool) -> list[str]:
    """What differs between the disk layers ``layers`` of state directory ``path`` and the
    content digests HEAD recorded for them (empty: they match)."""
    problems = []
    for lid in layers:
        if _is_memory(lid):
            if not memory_ok:
                problems.append(
                    f"in-memory layer {lid} (left mounted by a session that died) cannot be checked: "
                    "open and close the state directory once to move it to disk"
                )
            continue
        layer = path / "l" / lid
        if not layer.is_dir():
            problems.append(f"layer l/{lid} is missing")
        elif lid not in digests:
            problems.append(
                f"layer l/{lid} has no recorded content digest (written by an aospec that did not verify "
                "states), so nothing ties its content to the version"
            )
        elif layer_digest(layer) != digests[lid]:
            changed = _changed_since(layer, (path / "HEAD").stat().st_mtime_ns)
            hint = f" (changed after HEAD was written: {', '.join(changed)})" if changed else ""
            problems.append(f"layer l/{lid} was modified on disk{hint}")
    return problems


def _changed_since(root: Path, ns: int, limit: int = 5) -> list[str]:
    """Up to ``limit`` paths below ``root`` whose inode changed after ``ns`` (a hint only)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for top, dirs, files, dfd in os.fwalk(root):
            for name in [*dirs, *files]:
                if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ctime_ns > ns:
                    found.append("/" + os.path.relpath(os.path.join(top, name), root))
                    if len(found) >= limit:
                        return found
    return found


@dataclass(frozen=True, slots=True)
class StateCheck:
    """What :func:`verify_state_dir` found: ``problems`` is empty when the state directory
    holds exactly the state its ``version`` names."""

    state_dir: str
    version: str
    base: str
    layers: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_state_dir(path: str | os.PathLike[str]) -> StateCheck:
    """Check a closed persistent state directory without opening a sandbox: its base still
    hashes to the base version HEAD names (a full hash of the base) and every disk layer
    to the digest HEAD recorded. Raises SandboxError when ``path`` is not a state
    directory or is in use; differences are returned as ``problems``."""
    state = Path(path).resolve()
    head = state / "HEAD"
    if not head.is_file():
        raise SandboxError(f"{state} is not an overlay state directory (it has no HEAD)")
    held = StateDir(state, backend="overlay", wait_s=0.5)
    try:
        try:
            data = json.loads((held.dir / "HEAD").read_text())
            version, layers = str(data["version"]), tuple(str(x) for x in data["layers"])
            base, want_base = Path(data["base"]), str(data["base_version"])
            digests = {str(k): str(v) for k, v in data.get("digests", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SandboxError(f"{head}: unreadable HEAD ({exc}); the state directory is damaged") from None
        problems = []
        if not base.is_dir():
            problems.append(f"its base {base} is missing")
        else:
            got = base_version(tree_layer(base).digest)
            if got != want_base:
                problems.append(f"its base {base} hashes to {got}, not to the base version {want_base} HEAD names")
        problems += _layer_problems(held.dir, layers, digests, memory_ok=False)
        return StateCheck(str(state), version, str(base), len(layers), tuple(problems))
    finally:
        held.close()


@contextlib.contextmanager
def fd_names(paths: list[str]) -> Iterator[list[str]]:
    """``/proc/self/fd/N`` names of ``paths``, open while the context lasts. A sandbox sees
    its root's mount options in /proc/self/mountinfo exactly as given: named this way,
    they show no host path (the state directory, the owner's pid in its name)."""
    fds: list[int] = []
    try:
        for p in paths:
            fds.append(os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        yield [f"/proc/self/fd/{fd}" for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def _tmpfs_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _apply_layer(src: Path, dst: Path) -> None:
    """Put layer ``src`` on top of the merged layer ``dst`` (overlayfs semantics), at any
    depth (directory descriptors, never long paths)."""
    sfd = os.open(src, _DIR)
    dfd = os.open(dst, _DIR)
    out = _fs.DirPath(dfd)
    links = _fs.LinkMap(dfd)  # names of one inode in src stay one inode in dst
    times: list[tuple[int, int]] = []  # per open level of ``out`` below the root
    try:
        for step in _fs.walk_tree(sfd):
            while out.depth >= max(step.depth, 1):
                os.utime(out.fd, ns=times.pop())
                out.pop()
            if step.depth:  # a directory of src merged into the same directory of dst
                out.push(step.name)
                os.fchown(out.fd, step.st.st_uid, step.st.st_gid)
                os.fchmod(out.fd, stat.S_IMODE(step.st.st_mode))
                times.append((step.st.st_atime_ns, step.st.st_mtime_ns))
            descend = []
            for entry in step.entries:
                name = os.fsencode(entry.name)
                st = entry.stat(follow_symlinks=False)
                try:
                    d_st: os.stat_result | None = os.stat(name, dir_fd=out.fd, follow_symlinks=False)
                except FileNotFoundError:
                    d_st = None
                if _fs.is_whiteout(st):
                    if d_st is not None:
                        _fs.remove_entry_at(out.fd, name)
                    os.mknod(name, stat.S_IFCHR | 0o000, 0, dir_fd=out.fd)
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if d_st is not None and stat.S_ISDIR(d_st.st_mode) and not _fs.is_opaque(step.fd, name):
                        descend.append(entry)
                        continue
                    hid_lower = d_st is not None  # a whiteout or non-directory in the merged range
                    if d_st is not None:
                        _fs.remove_entry_at(out.fd, name)
                    _fs.copy_entry_at(step.fd, name, out.fd, links=links, rel=_join(step.rel, name))
                    if hid_lower and not _fs.is_opaque(out.fd, name):
                        fd = os.open(name, _DIR, dir_fd=out.fd)
                        try:
                            os.setxattr(fd, _fs.OPAQUE_XATTR, b"y")
                        finally:
                            os.close(fd)
                    continue
                if d_st is not None:
                    _fs.remove_entry_at(out.fd, name)
                _fs.copy_entry_at(step.fd, name, out.fd, links=links, rel=_join(step.rel, name))
            step.entries[:] = descend
        while out.depth:
            os.utime(out.fd, ns=times.pop())
            out.pop()
    finally:
        out.close()
        os.close(dfd)
        os.close(sfd)


def _join(rel: bytes, name: bytes) -> bytes:
    return rel + b"/" + name if rel else name


def _drop_dead_whiteouts(layer: Path, below: str) -> None:
    """Remove the whiteouts of the merged layer ``layer`` that hide nothing in ``below``
    (the tree the layer will sit on). Overlayfs hides whiteouts only in a directory it
    merges with a lower one; in a directory only this layer has (new in the merged range,
    opaque, or over a non-directory below) it lists them as entries that cannot be
    opened, so a merged layer must not keep a whiteout its directory no longer needs."""
    lfd = os.open(layer, _DIR)
    bfd = os.open(below, _DIR)
    under = _fs.DirPath(bfd)
    try:
        for step in _fs.walk_tree(lfd):
            if step.depth:
                while under.depth >= step.depth:
                    under.pop()
                if under.depth == step.depth - 1 and not _fs.is_opaque(step.fd):
                    try:
                        under.push(step.name)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                            raise
            merged = under.depth == step.depth  # this directory shows ``below``'s too
            for entry in step.entries:
                if entry.is_dir(follow_symlinks=False) or not _fs.is_whiteout(entry.stat(follow_symlinks=False)):
                    continue
                if merged:
                    try:
                        hidden = os.stat(entry.name, dir_fd=under.fd, follow_symlinks=False)
                    except FileNotFoundError:
                        pass
                    else:
                        if not _fs.is_whiteout(hidden):
                            continue
                os.unlink(entry.name, dir_fd=step.fd)
    finally:
        under.close()
        os.close(bfd)
        os.close(lfd)
