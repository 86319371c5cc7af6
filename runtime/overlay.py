"""The overlay backend: sandboxes as stacks of immutable layers under one writable upper,
run with bubblewrap.

A sandbox mounts overlayfs over its stack of layers (``aospec.runtime.overlay_store`` keeps the
state directory: layers, HEAD, recovery, compaction, verification) with a tmpfs upper.
A command runs in the merged root; afterwards the upper's changes become a Layer and the
version moves on (``aospec.runtime.versions``). A fork freezes its parent's pending changes into
a layer and mounts a new overlay on the same stack; a commit makes the fork's stack the
parent's (and, for the committed root, HEAD's); discard unmounts and deletes.

Where the read tracer works (``aospec.runtime.readsets``), sandboxes are
:class:`ReadSetOverlaySandbox` es: a fork asked to trace runs its command under strace, and
the root can *rebase* a fork from an older version (docs/engine.md, "Read sets").
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from aospec.runtime import _fs
from aospec.runtime._files import check_workdir, read_in_root, write_in_root
from aospec.runtime._session import SandboxSession
from aospec.runtime._state import RecoveryReport, default_state_root, new_id, private_dir
from aospec.runtime.bases import open_base
from aospec.runtime.config import SandboxConfig
from aospec.runtime.host import host_support
from aospec.runtime.isolation import (
    CommandPriority,
    _in_thread,
    bwrap_argv,
    check_binds,
    missing_bind_points,
    reached_file_size,
    remove_bind_points,
    run_bwrap,
    scrub_binds,
)
from aospec.runtime.observation import CommandResult, ObservationFormatter, SandboxStatistics, get_formatter
from aospec.runtime.overlay_store import MOUNT_OPTS, OverlayStore, StateCheck, fd_names, verify_state_dir
from aospec.runtime.pausing import CommandPause
from aospec.runtime.readsets import (
    CommandTrace,
    EbpfCommandTrace,
    new_trace,
    read_set,
    shift_times,
    tracer_support,
    wait_for_tracer,
    write_set,
)
from aospec.runtime.seccomp import filter_program
from aospec.runtime.versions import Layer, UpperTracker, _TreeReader

from aospec.errors import ConfigError, SandboxError, SandboxUnavailableError
from aospec.readsets import ReadSet, WriteSet

__all__ = [
    "OverlaySandbox",
    "ReadSetOverlaySandbox",
    "OverlayStore",
    "RecoveryReport",
    "StateCheck",
    "default_state_root",
    "open_overlay",
    "verify_state_dir",
]


#: ctime comes from a coarse clock (a tick behind): what changed up to this long before a
#: command started is looked at again after it (scrub_binds), which costs nothing wrong
_CTIME_SLACK_NS = 1_000_000_000


@dataclass(slots=True)
class _Stats:
    commands: int = 0
    forks: int = 0
    commits: int = 0
    freezes: int = 0


class OverlaySandbox(SandboxSession):
    """One sandbox of an OverlayStore: the committed root (the session) or a fork.

    Implements :class:`aospec.protocols.Sandbox` (``version``, ``execute``, ``fork``,
    ``commit``, ``discard``) plus ``run`` (a CommandResult), ``read_file``/``write_file``
    and ``aclose``. Operations on one sandbox are serialised; different sandboxes run
    concurrently.
    """

    backend = "overlay"

    def __init__(
        self,
        store: OverlayStore,
        *,
        stack: tuple[str, ...],
        version: str,
        is_root: bool,
        formatter: ObservationFormatter,
        lineage: tuple[str, ...] = (),
    ) -> None:
        self._init_session(store, version=version, is_root=is_root, formatter=formatter, lineage=lineage)
        self._stack = stack
        self._dir = store.dir / "s" / self.sid
        self._tmpfs = store.config.limits.disk_bytes is not None
        self._rw = self._dir / "rw" if self._tmpfs else store.dir / "u" / self.sid
        self._upper = self._rw / "u"
        self._work = self._rw / "w"
        self._merged = self._dir / "m"
        self._lv: tuple[str, ...] | None = None  # the stack whose shared lower view we hold
        self._bind_points: list[tuple[str, ...]] = []
        self._bind_since: int | None = None  # when the running command started (scrub_binds)
        self._mounted = False
        self._rw_mounted = False
        self.tracker = UpperTracker(self._upper, self._lower_view)
        self._stats = _Stats()
        self._priority = CommandPriority()
        self._pause = CommandPause()
        # The committed root's last complete state, (stack, version), that it forks from
        # without its lock (None: fork under the lock, freezing pending changes first).
        self._published: tuple[tuple[str, ...], str] | None = None
        store.live[self.sid] = self

    # -- the Sandbox protocol ----------------------------------------------------------------

    #: ``fork()`` of the committed root may overlap its ``execute()``: the fork is at the
    #: state before the running command, and ``version`` stays that state's until
    #: ``execute`` returns (docs/runtime.md, "Forks while the root runs a command").
    forks_during_execute = True

    @property
    def version(self) -> str:
        """The filesystem version: it moves when a command (or a write, or a commit) is
        done, never while one runs."""
        return self._version

    async def fork(self) -> OverlaySandbox:
        """An isolated copy-on-write child at this sandbox's current version.

        The committed root forks without waiting for its lock: its pending changes are
        frozen after every command, so its last published (stack, version) is exact, and a
        fork taken while a command runs there (or a commit is in flight) is at the state
        before it. A fork forks under its lock, freezing its own pending changes first."""
        self._check_open()
        # (between commands, changes made behind the root's back, into its merged root on
        # the host, go into a layer first, under the lock: as they always did)
        if self._published is not None and (self._lock.locked() or self._upper_empty()):
            return await self._fork_from(*self._published)
        async with self._lock:
            self._check_open()
            await self._freeze()
            return await self._fork_from(self._stack, self._version)

    async def _fork_from(self, stack: tuple[str, ...], version: str) -> OverlaySandbox:
        child = type(self)(
            self.store,
            stack=stack,
            version=version,
            is_root=False,
            formatter=self._formatter,
            lineage=(*self._lineage, self.sid),
        )
        # taken before the first await: the layers stay while the child lives, whatever
        # this sandbox commits or compacts meanwhile
        self.store.ref(stack)
        try:
            await anyio.to_thread.run_sync(child._mount)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await child.discard()
            raise
        self._stats.forks += 1
        return child

    def _publish(self) -> None:
        """Make this sandbox's state the one the root forks from without its lock (only
        the committed root, and only with no pending changes in its upper)."""
        self._published = (self._stack, self._version) if self.is_root and self._upper_empty() else None

    async def commit(self, fork: OverlaySandbox) -> None:
        """Make ``fork``'s state this sandbox's state; the fork is consumed."""
        self._check_open()
        self._check_fork_committable(fork)
        async with self._lock, fork._lock:
            self._check_open()
            self._check_fork_live(fork)
            # shielded: a half-done commit would leave the two sandboxes inconsistent
            with anyio.CancelScope(shield=True):
                frozen, head_written = await anyio.to_thread.run_sync(self._commit_blocking, fork)
                old_stack = self._stack
                if frozen is not None:
                    self.store.ref((frozen,))
                    fork._stack = (frozen, *fork._stack)
                # the fork's references on its layers pass to this sandbox
                self._stack, self._version = fork._stack, fork._version
                self._publish()  # before the old stack is released below
                self.last_layer = fork.last_layer
                fork._closed = True
                self.store.live.pop(fork.sid, None)
                if not head_written:
                    k, memory = self.store.compaction_size(self._stack)
                    spill = self._durable_spill_size()
                    await self._compact(max(k, spill), memory and not spill)
                dead = self.store.unref(old_stack)
                if dead:
                    await anyio.to_thread.run_sync(self.store.delete_layers, dead)
                self._stats.commits += 1

    def _commit_blocking(self, fork: OverlaySandbox) -> tuple[str | None, bool]:
        """Freeze the fork's upper, drop this sandbox's own pending changes, and (root,
        nothing to compact) write HEAD: one worker-thread hop. The consumed fork's
        teardown (its cgroup, directories, a tmpfs it no longer needs) waits for the next
        discard, a later commit or the close (:meth:`OverlayStore.bury`): none of it is part
        of the committed state, and the step need not wait for it."""
        frozen = fork._freeze_if_needed()
        fork._unmount()
        self.store.bury_later(fork._teardown)
        self._unmount()
        self._reset_rw()
        stack = (frozen, *fork._stack) if frozen is not None else fork._stack
        spill = self.store.config.durable and any(lid.startswith("m") for lid in stack)
        if self.is_root and not spill and self.store.compaction_size(stack)[0] == 0:
            self.store.write_head(fork._version, stack)
            return frozen, True
        return frozen, False

    async def _release(self) -> None:
        """Release this fork's mounts, directories and the layers only it referenced (and
        what earlier commits left to tear down)."""
        await anyio.to_thread.run_sync(self._teardown_and_bury)
        dead = self.store.unref(self._stack)
        if dead:
            await anyio.to_thread.run_sync(self.store.delete_layers, dead)

    async def set_priority(self, *, foreground: bool) -> None:
        """Run this sandbox's commands at foreground (the default) or background CPU and
        IO priority (:class:`aospec.protocols.PrioritizedSandbox`); applies at once, to a
        command already running too."""
        self._priority.set(background=not foreground)

    @property
    def foreground(self) -> bool:
        """Whether this sandbox's commands run at foreground priority."""
        return not self._priority.background

    async def pause(self) -> None:
        """Freeze the command running here, if any, and every command started until
        :meth:`resume` (:class:`aospec.protocols.PausableSandbox`): the cgroup freezer, v1
        or v2. Returns once the kernel reports its processes frozen. Paused time does not
        count against the command's timeout. Idempotent; a no-op once discarded."""
        if not self._closed:
            await self._pause.pause()

    async def resume(self) -> None:
        """Thaw what :meth:`pause` froze; the command's timeout runs on from where it stopped."""
        self._pause.resume()

    @property
    def paused(self) -> bool:
        """Whether this sandbox is paused."""
        return self._pause.paused

    def _stop_paused_command(self) -> None:
        if self._pause.paused:
            self._pause.kill_running()

    def _in_background(self) -> bool:
        return self._priority.background

    @property
    def cpu_ns(self) -> int:
        """CPU time (user + system, ns) of every command this sandbox ran, the running one
        included (:class:`aospec.protocols.MeteredSandbox`; its cgroup's cpuacct, or v2's
        cpu.stat); a fork starts from 0. Always 0 where the host has no CPU accounting."""
        return self._pause.cpu_ns()

    # -- richer API -------------------------------------------------------------------------

    async def _run_locked(self, command: str, *, timeout_s: float, env: dict[str, str], cwd: str) -> CommandResult:
        cfg = self.store.config
        done: dict[str, Any] = {}
        try:
            result, _ = await run_bwrap(
                lambda info_fd, block_fd: bwrap_argv(
                    str(self._merged),
                    command,
                    shell=self.store.shell,
                    cwd=cwd,
                    env=env,
                    network=cfg.network,
                    binds=cfg.binds,
                    cap_add=cfg.cap_add,
                    info_fd=info_fd,
                    block_fd=block_fd,
                ),
                cwd=str(self._merged),
                timeout_s=timeout_s,
                limits=cfg.limits,
                cgroup_name=self.store.next_cgroup(self.sid),
                cgroup_parents=self.store.cgroup_parents(self.sid),
                seccomp=self.store.seccomp_program,
                priority=self._priority,
                pause=self._pause,
                tracer=self._command_tracer(cwd),
                max_output_bytes=cfg.max_output_bytes,
                before=lambda: self._prepare(cwd),
                # also when cancelled: the version must describe what the command left
                after=lambda: self._record_changes(done),
            )
        finally:
            with anyio.CancelScope(shield=True):
                self._apply_changes(done)
                await self._adopt_frozen(done.get("frozen"))
                self._publish()
        self._stats.commands += 1
        for what in ("disk_full", "file_size"):
            if done.get(what):
                result = _with_limit(result, what.removesuffix("_full"))
        return result

    def _command_tracer(self, cwd: str) -> CommandTrace | EbpfCommandTrace | None:
        """The tracer of the next command (:class:`ReadSetOverlaySandbox`), or None."""
        return None

    def _changes_recorded(self, layer: Layer) -> None:
        """A command's layer was just read, its upper not yet frozen (a subclass hook)."""

    def _prepare(self, cwd: str) -> None:
        check_binds(self.store.config.binds)
        self._bind_since = time.time_ns() - _CTIME_SLACK_NS
        self._mount()
        check_workdir(str(self._merged), cwd)
        # bubblewrap creates missing bind mount points in the root; binds are not part
        # of the sandbox's state, so they are removed before the changes are read
        self._bind_points = missing_bind_points(str(self._merged), self.store.config.binds)

    def _record_changes(self, done: dict[str, Any]) -> None:
        """After a command or a write (blocking): the layer it made and the version it
        moves to (applied on the event loop: :meth:`_apply_changes`); the committed root
        also freezes its upper. What happened goes into ``done``."""
        if self._bind_points:
            remove_bind_points(str(self._merged), self._bind_points)
            self._bind_points = []
        since = self._bind_since
        if self._bind_since is not None:
            scrub_binds(self.store.config.binds, self._bind_since)
            self._bind_since = None
        self._keep_hard_links(since or 0)
        layer = self.tracker.diff()
        done["layer"], done["version"] = layer, layer.apply_to(self._version)
        self._changes_recorded(layer)
        done["disk_full"] = self._tmpfs and self._disk_full()
        done["file_size"] = reached_file_size(
            str(self._upper), (p for p, st in layer.records if st is not None), self.store.config.limits.file_size_bytes
        )
        if self.is_root:
            done["frozen"] = self._freeze_if_needed()

    def _keep_hard_links(self, since_ns: int) -> None:
        """Copy up the other names of every hard-linked lower file the command copied up
        or unlinked a name of, so the upper holds the whole link group before it becomes a
        layer (blocking, after a command, while the overlay is mounted).

        With ``index=on`` (MOUNT_OPTS) overlayfs keeps a copied-up inode's other names on
        it while this mount lives, but only names the command looked up reach the upper; in
        a layer the rest would show the old inode again (a link broken one command later).
        Such a name is found in the merged view as a regular file that is absent from the
        upper, has more than one name below it, and whose inode changed since the command
        started (the indexed copy's ctime); a ``utime`` to its own times copies it up,
        linked to the indexed inode (neither content, mode, owner nor times change). Costs
        one walk of the tree, only when the index holds a regular file."""
        index = self._work / "index"
        try:
            with os.scandir(index) as it:
                if not any(e.is_file(follow_symlinks=False) for e in it):
                    return
        except (FileNotFoundError, NotADirectoryError):
            return
        if not self._mounted:
            return
        # looked up component by component, never following a symlink (a directory of the
        # merged view may be a symlink below it, aimed anywhere on the host)
        upper = _TreeReader(os.fsencode(self._upper))
        lower = _TreeReader(os.fsencode(self._lower_view()))
        root = os.open(self._merged, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for step in _fs.walk_tree(root):
                prefix = step.rel + b"/" if step.rel else b""
                for entry in step.entries:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    if st.st_ctime_ns < since_ns:
                        continue  # not changed by this command
                    rel = prefix + os.fsencode(entry.name)
                    if upper.lstat(rel) is not None:
                        continue  # in the upper already
                    found = lower.lstat(rel)
                    if found is None:
                        continue
                    below = found[2]
                    if not stat.S_ISREG(below.st_mode) or below.st_nlink < 2 or below.st_ctime_ns == st.st_ctime_ns:
                        continue
                    with contextlib.suppress(OSError):  # an immutable file stays as it is
                        os.utime(
                            os.fsencode(entry.name),
                            ns=(st.st_atime_ns, st.st_mtime_ns),
                            dir_fd=step.fd,
                            follow_symlinks=False,
                        )
        finally:
            os.close(root)
            upper.close()
            lower.close()

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The content of the regular file ``path`` inside the sandbox (symlinks resolved
        inside it). A FIFO, socket, device or directory is a SandboxError at once; with
        ``max_bytes`` a larger file is a FileTooLargeError before anything is read."""
        self._check_open()
        async with self._lock:
            self._check_open()
            await anyio.to_thread.run_sync(self._mount)
            return await anyio.to_thread.run_sync(read_in_root, str(self._merged), path, max_bytes)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        """Write the regular file ``path`` inside the sandbox (parents must exist; anything
        but a regular file there is a SandboxError); the version moves on."""
        self._check_open()
        raw = data.encode() if isinstance(data, str) else data

        def write(done: dict[str, Any]) -> None:
            self._mount()
            try:
                write_in_root(str(self._merged), path, raw, mode)
            finally:
                self._record_changes(done)

        async with self._lock:
            self._check_open()
            done: dict[str, Any] = {}
            try:
                await anyio.to_thread.run_sync(write, done)
            finally:
                with anyio.CancelScope(shield=True):
                    self._apply_changes(done)
                    await self._adopt_frozen(done.get("frozen"))
                    self._publish()

    def _teardown_and_bury(self) -> None:
        self._teardown()
        self.store.bury()

    def _close_root(self) -> None:
        self.store.bury()
        self._teardown()
        if not self.store.ephemeral:
            self.store.spill_head()
        self.store.close()

    @property
    def stack_depth(self) -> int:
        return len(self._stack)

    @property
    def root_path(self) -> Path:
        """The merged root on the host (mounted while the sandbox is in use), named below
        the state directory's path (aospec itself reaches it through the held descriptor)."""
        return self.store.path / "s" / self.sid / "m"

    def statistics(self) -> SandboxStatistics:
        return SandboxStatistics(
            commands=self._stats.commands,
            forks=self._stats.forks,
            commits=self._stats.commits,
            freezes=self._stats.freezes,
            stack_depth=len(self._stack),
            compactions=self.store.compactions,
            index_off_mounts=self.store.index_off_mounts,
        )

    # -- internals --------------------------------------------------------------------------

    def _mount(self) -> None:
        if self._mounted:
            return
        self._merged.mkdir(parents=True, exist_ok=True)
        self._rw.mkdir(parents=True, exist_ok=True)
        if not self._rw_mounted:
            if self._tmpfs:
                _fs.mount("tmpfs", str(self._rw), "tmpfs", 0, f"size={self.store.upper_bytes()},mode=0700")
            self._rw_mounted = True
            self._upper.mkdir(exist_ok=True)
            self._work.mkdir(exist_ok=True)
        with fd_names([*self.store.lowerdir(self._stack).split(":"), str(self._upper), str(self._work)]) as names:
            opts = f"lowerdir={':'.join(names[:-2])},upperdir={names[-2]},workdir={names[-1]},{MOUNT_OPTS}"
            try:
                self._mount_overlay(opts)
            except OSError as exc:
                raise SandboxError(f"mounting the sandbox overlay failed: {exc}") from None
        self._mounted = True

    def _mount_overlay(self, opts: str) -> None:
        """Mount the overlay. With ``index=on`` overlayfs refuses (EBUSY) a layer that is
        still the upper of a mount on its way out (unmounted lazily while a process forked
        meanwhile held a descriptor): that goes within moments, so the mount is retried
        for a while, then made with ``index=off`` (this mount's hard links then break on
        copy-up, as overlayfs's default does; counted in ``statistics().index_off_mounts``, over the store)."""
        delay = 0.005
        for _ in range(9):  # about 2.5 s in all
            try:
                _fs.mount("overlay", str(self._merged), "overlay", 0, opts)
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or "index=on" not in opts:
                    raise
            time.sleep(delay)
            delay *= 2
        _fs.mount("overlay", str(self._merged), "overlay", 0, opts.replace("index=on", "index=off"))
        self.store.index_off_mounts += 1

    def _unmount(self) -> None:
        if self._mounted:
            _fs.umount(str(self._merged))
            self._mounted = False
        if self._lv is not None:
            self.store.release_lower_view(self._lv)
            self._lv = None

    def _reset_rw(self) -> None:
        """A fresh, empty upper (after a freeze or a commit)."""
        if self._tmpfs:
            if self._rw_mounted:
                _fs.umount(str(self._rw))
            self._rw_mounted = False
        else:
            for d in (self._upper, self._work):
                if d.exists():
                    self.store.trash(d)
            self._rw_mounted = False
        self.tracker.reset()

    def _teardown(self) -> None:
        self.store.remove_sandbox_cgroup(self.sid)
        self._unmount()
        if self._rw_mounted and self._tmpfs:
            _fs.umount(str(self._rw))
        self._rw_mounted = False
        _fs.remove_tree(self._dir)
        if not self._tmpfs and self._rw.exists():
            self.store.trash(self._rw)

    def _lower_view(self) -> str:
        """A read-only view of this sandbox's lower stack (what the upper sits on)."""
        if not self._stack:
            return str(self.store.base.path)
        if self._lv != self._stack:
            if self._lv is not None:
                self.store.release_lower_view(self._lv)
            path = self.store.acquire_lower_view(self._stack)
            self._lv = self._stack
            return path
        return self.store.lower_view_path(self._stack)

    def _upper_empty(self) -> bool:
        if not self._rw_mounted:
            return True
        with os.scandir(self._upper) as it:
            return next(it, None) is None

    async def _freeze(self) -> None:
        """Turn the pending upper into an immutable layer (the version does not change)."""
        await self._adopt_frozen(await anyio.to_thread.run_sync(self._freeze_if_needed))

    def _freeze_if_needed(self) -> str | None:
        return None if self._upper_empty() else self._freeze_blocking()

    def _apply_changes(self, done: dict[str, Any]) -> None:
        """The version moves on to what the command (or write) left, on the event loop:
        never while it runs (a fork taken meanwhile is at the state before it)."""
        if "version" in done:
            self._version, self.last_layer = done["version"], done["layer"]

    async def _adopt_frozen(self, lid: str | None) -> None:
        """Put a just-frozen layer on top of the stack; compact; rewrite HEAD (root)."""
        if lid is None:
            return
        self.store.ref((lid,))
        self._stack = (lid, *self._stack)
        self._publish()  # version and stack together, before anything awaits
        self._stats.freezes += 1
        await self._compact(*self.store.compaction_size(self._stack))

    async def _compact(self, k: int, memory: bool = False) -> None:
        """Merge the top ``k`` layers of this sandbox's stack into one disk layer; HEAD
        is rewritten (root) before the replaced layers are released."""
        dead: list[str] = []
        if k:
            merged = await anyio.to_thread.run_sync(self.store.compact, self._stack, k, memory)
            self.store.ref((merged,))
            replaced = self._stack[:k]
            self._stack = (merged, *self._stack[k:])
            if self._published is not None:
                self._publish()  # before the replaced layers are released below
            dead = replaced  # released below, after HEAD no longer names them
        if self.is_root and (k or self._stack != self.store.head_layers):
            await anyio.to_thread.run_sync(self.store.write_head, self._version, self._stack)
        if dead:
            gone = self.store.unref(dead)
            if gone:
                await anyio.to_thread.run_sync(self.store.delete_layers, gone)

    def _durable_spill_size(self) -> int:
        """With ``durable``, the root's stack must not name memory layers."""
        mem = [i for i, lid in enumerate(self._stack) if lid.startswith("m")]
        return mem[-1] + 1 if mem and self.store.config.durable and self.is_root else 0

    def _freeze_blocking(self) -> str:
        self._unmount()
        # overlayfs's inode index (index=on) holds one more link to every copied-up
        # hard-linked inode: gone before the upper becomes a layer, so the layer's link
        # counts are its names' (all of them are in the upper: _keep_hard_links)
        if self._rw_mounted:
            _fs.remove_tree(str(self._work / "index"))
        cfg = self.store.config
        if not self._tmpfs:
            lid = self.store.new_layer_from(self._upper, rename=True)
            self._reset_rw()
        elif (self.is_root and cfg.durable) or cfg.memory_layers_bytes == 0:
            lid = self.store.new_layer_from(self._upper, rename=False)
            self._reset_rw()
        else:
            lid = self.store.new_memory_layer(self._rw)
            self._rw_mounted = False
            self.tracker.reset()
        return lid

    def _disk_full(self) -> bool:
        if not self._rw_mounted:
            return False
        st = os.statvfs(self._rw)
        return st.f_bavail * st.f_frsize < 64 * 1024


def _with_limit(result: CommandResult, what: str) -> CommandResult:
    if what in result.limits_hit:
        return result
    return CommandResult(
        result.returncode,
        result.output,
        result.timed_out,
        result.duration_s,
        (*result.limits_hit, what),
        result.truncated,
    )


def check_host() -> None:
    """Raise SandboxUnavailableError saying what to do when the overlay backend cannot run."""
    support, _ = host_support()
    problems = support.problems()
    if problems:
        raise SandboxUnavailableError("; ".join(problems))


class ReadSetOverlaySandbox(OverlaySandbox):
    """An overlay sandbox with the :class:`aospec.protocols.ReadSetSandbox` capability: a
    fork traces its next command's reads when asked (``read_sets="all"``: every command),
    and the root rebases a fork from an older version (``aospec.runtime.readsets``)."""

    _trace: CommandTrace | EbpfCommandTrace | None = None
    _trace_next = False
    _trace_cwd = "/"
    _committed_wall_ns = 0
    _root_writes: WriteSet | None = None
    _guess = False  # the traced command is a speculative guess (trace_reads asked for it)

    async def _run_locked(self, command: str, *, timeout_s: float, env: dict[str, str], cwd: str) -> CommandResult:
        result = await super()._run_locked(command, timeout_s=timeout_s, env=env, cwd=cwd)
        if self._guess and result.timed_out:
            # the tracer slows a guess down: one that timed out may not have where serial
            # execution would not, so its result is not offered (it only costs time)
            raise SandboxError("a traced speculative command timed out: its result is not used")
        return result

    _record_writes = False

    def record_writes(self) -> None:
        """From now on the committed root keeps each command's write set
        (:meth:`write_set`): for an engine that runs its steps on the root itself while
        forks from older versions wait for read-set validation."""
        self._record_writes = True

    def _changes_recorded(self, layer: Layer) -> None:
        # the root freezes its upper right after each command: with every command traced
        # (recordings), or when asked, its write set is read while the upper still shows it
        if self.is_root and (self._record_writes or self.store.config.read_sets == "all"):
            self._root_writes = write_set(self.tracker, layer, self._lower_view())

    def _command_tracer(self, cwd: str) -> CommandTrace | EbpfCommandTrace | None:
        self._guess = False
        if self._trace is not None:
            self._trace.remove()
            self._trace = None
        if not (self._trace_next or self.store.config.read_sets == "all"):
            return None
        self._guess, self._trace_next = self._trace_next, False
        self._trace_cwd = cwd
        self._trace = new_trace(self._dir / "trace")
        return self._trace

    async def trace_reads(self) -> None:
        """Record what the next command reads (:meth:`read_set`)."""
        self._check_open()
        self._trace_next = True

    async def read_set(self) -> ReadSet | None:
        """What the last command read, resolved in its origin and final states; None when
        it was not traced or did something untracked."""
        self._check_open()
        async with self._lock:
            self._check_open()
            trace = self._trace
            if trace is None:
                return None
            cfg = self.store.config

            def parse() -> ReadSet | None:
                self._mount()
                views = [str(self._merged)]
                if self.last_layer:
                    views.insert(0, self._lower_view())
                return read_set(trace, views=views, cwd=self._trace_cwd, binds=cfg.binds, network=cfg.network)

            return await _in_thread(self._priority, parse)

    async def write_set(self) -> WriteSet | None:
        """What the last command changed (from its layer and upper), against its origin."""
        self._check_open()
        async with self._lock:
            self._check_open()
            if self.is_root:
                return self._root_writes
            if not self.last_layer and not self.tracker._seen:
                return WriteSet()
            return await _in_thread(
                self._priority, lambda: write_set(self.tracker, self.last_layer, self._lower_view())
            )

    async def commit(self, fork: OverlaySandbox) -> None:
        await super().commit(fork)
        self._committed_wall_ns = time.time_ns()

    async def rebase(self, fork: ReadSetOverlaySandbox) -> WriteSet:
        """Commit ``fork``, forked from an older version, by putting its changes on top of
        this sandbox's state: the new version is ``H(version, H(fork's layer))``, its own
        modification times move after this sandbox's last commit. Only for a fork whose reads
        and writes no change since its origin touched (the engine's read-set validation):
        its layer is then the one running it here would make. Returns its write set."""
        self._check_open()
        self._check_fork_committable(fork)
        async with self._lock, fork._lock:
            self._check_open()
            self._check_fork_live(fork)
            with anyio.CancelScope(shield=True):
                await self._freeze()
                writes, frozen, head_written = await anyio.to_thread.run_sync(self._rebase_blocking, fork)
                layer = fork.last_layer
                if frozen is not None:
                    self.store.ref((frozen,))
                    self._stack = (frozen, *self._stack)
                self._version = layer.apply_to(self._version)
                self.last_layer = layer
                self._publish()  # stack and version together: the root's lock-free forks see them
                fork._closed = True
                self.store.live.pop(fork.sid, None)
                if not head_written:
                    k, memory = self.store.compaction_size(self._stack)
                    spill = self._durable_spill_size()
                    await self._compact(max(k, spill), memory and not spill)
                dead = self.store.unref(fork._stack)  # the fork's references on its origin's layers
                if dead:
                    await anyio.to_thread.run_sync(self.store.delete_layers, dead)
                self._stats.commits += 1
                self._committed_wall_ns = time.time_ns()
                return writes

    def _rebase_blocking(self, fork: ReadSetOverlaySandbox) -> tuple[WriteSet, str | None, bool]:
        """The fork's write set, its times moved, its upper frozen and the fork torn down;
        this sandbox unmounted (its stack changes); HEAD written when nothing is to compact."""
        writes = write_set(fork.tracker, fork.last_layer, fork._lower_view())
        if os.environ.get("AOSPEC_READ_SETS_CHECK"):
            # the lossless check's second line: the layer committed must be the one a fresh
            # diff of the fork's changes against this state gives
            fresh = UpperTracker(fork._upper, self._lower_view).diff()
            if fresh.records != fork.last_layer.records:
                raise SandboxError(
                    f"rebase: the fork's layer ({len(fork.last_layer.records)} records) is not the one its changes "
                    f"make on the committed state ({len(fresh.records)}): {fresh.describe()[:4]} vs "
                    f"{fork.last_layer.describe()[:4]}"
                )
        trace = fork._trace
        fork._unmount()
        if trace is not None and fork._rw_mounted:
            shift_times(
                str(fork._upper),
                started_ns=trace.started_ns,
                ended_ns=trace.ended_ns,
                after_ns=self._committed_wall_ns,
                now_ns=time.time_ns(),
                lower=fork._lower_view(),
                new_lower=self._lower_view(),
            )
            fork._unmount()
        frozen = fork._freeze_if_needed()
        fork._teardown()
        self._unmount()
        self._reset_rw()
        stack = (frozen, *self._stack) if frozen is not None else self._stack
        version = fork.last_layer.apply_to(self._version)
        spill = self.store.config.durable and any(lid.startswith("m") for lid in stack)
        if self.is_root and not spill and self.store.compaction_size(stack)[0] == 0:
            self.store.write_head(version, stack)
            return writes, frozen, True
        return writes, frozen, False


def read_sets_on(config: SandboxConfig) -> tuple[bool, str]:
    """Whether sandboxes of ``config`` record read sets, and why (one line)."""
    if config.read_sets == "off":
        return False, "off: read_sets is off in the sandbox configuration"
    support = tracer_support()
    if not support.ok:
        if config.read_sets == "all":
            raise ConfigError(f"read_sets all: {support.detail.removeprefix('off: ')}")
        return False, support.detail
    if config.network and config.read_sets != "all":
        return False, "off: the sandbox has network access, which the tracer does not follow"
    return True, support.detail


@asynccontextmanager
async def open_overlay(config: SandboxConfig | None = None, **overrides: Any) -> AsyncIterator[OverlaySandbox]:
    """Open an overlay sandbox session: ``async with open_overlay(base="busybox") as sb``.

    The yielded sandbox is the committed root; closing the session discards its forks and
    unmounts everything (a private state dir is deleted, a given one kept for reopening).
    """
    config = (config or SandboxConfig()).replace(**overrides) if overrides else (config or SandboxConfig())
    check_host()
    check_binds(config.binds)
    seccomp = await anyio.to_thread.run_sync(
        lambda: filter_program(config.seccomp, network=config.network, writable_binds=config.writable_binds)
    )
    base = await anyio.to_thread.run_sync(lambda: open_base(config.base))
    if config.state_dir is None:
        root = default_state_root()
        private_dir(root)
        path = root / f"e-{os.getpid()}-{new_id()}"
        ephemeral = True
    else:
        path = Path(config.state_dir).resolve()
        ephemeral = False
    store = OverlayStore(path, base, config, ephemeral=ephemeral)
    store.seccomp_program = seccomp
    await anyio.to_thread.run_sync(store.open)
    cls = ReadSetOverlaySandbox if read_sets_on(config)[0] else OverlaySandbox
    if cls is ReadSetOverlaySandbox and config.read_sets == "all":
        # every command's read set is recorded: the eBPF tracer must be running first (else
        # it starts with the first fork asked to trace, in the background)
        await anyio.to_thread.run_sync(wait_for_tracer)
    try:
        sandbox = cls(
            store,
            stack=store.head_layers,
            version=store.head_version,
            is_root=True,
            formatter=get_formatter(config.formatter),
        )
        store.ref(store.head_layers)
        sandbox._publish()
    except BaseException:
        await anyio.to_thread.run_sync(store.close)
        raise
    try:
        yield sandbox
    finally:
        await sandbox.aclose()
