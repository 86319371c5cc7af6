"""The Docker backend: sandboxes are containers of a local daemon (docker SDK).

The base filesystem is imported once as an image (labelled with its version). A
sandbox is a container running an idle process under ``docker-init``; each command is a
``docker exec`` of bash, after which every other process left in the container is
killed (as with the overlay backend, nothing outlives its command). Versions come from
the container's overlay2 upper directory, read on the host by the same ``UpperTracker``
as the overlay backend (a cumulative upper this time), so the same parent state plus the
same changes gives the same version on both backends.

Forks: ``copy-upper`` (default when the upper is readable, measured faster here) creates
a container from the parent's image and copies the parent's upper into the new
container's upper before starting it; ``commit`` uses ``docker commit`` and starts the
fork from the committed image. Process checkpoints (``docker checkpoint``, CRIU) are not
used: ``aospec.runtime.daemon.checkpoint_support()`` says whether this host could.

Needs a local daemon with the overlay2 storage driver (the upper, lower and merged
directories and the container's cgroup are read on this host).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import tarfile
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from aospec.runtime import _fs
from aospec.runtime._files import check_workdir, read_in_root, write_in_root
from aospec.runtime._session import SandboxSession
from aospec.runtime._state import (
    RecoveryReport,
    StateDir,
    default_state_root,
    new_id,
    private_dir,
    store_identity,
    unregister_store,
    write_atomic,
)
from aospec.runtime.bases import BaseFS, open_base
from aospec.runtime.cgroups import _cpu_usage
from aospec.runtime.config import SandboxConfig, cap_name
from aospec.runtime.daemon import docker_client
from aospec.runtime.isolation import check_binds, reached_file_size, scrub_binds
from aospec.runtime.observation import (
    TIMEOUT_RETURNCODE,
    CommandResult,
    ObservationFormatter,
    OutputBuffer,
    SandboxStatistics,
    get_formatter,
)
from aospec.runtime.pausing import CommandPause
from aospec.runtime.seccomp import docker_profile
from aospec.runtime.versions import UpperTracker

from aospec._lazy import require
from aospec.errors import ConfigError, SandboxError, SandboxUnavailableError

__all__ = ["DockerSandbox", "ensure_base_image", "open_docker"]

_IDLE = ["/bin/sleep", "2147483647"]
#: who the container's init and idle process run as: a uid no file of a base is owned by
#: (commands run as root, which without CAP_SYS_PTRACE may not ptrace, open the memory
#: of, or, without CAP_KILL, signal another user's processes)
KEPT_UID = 2147483646
_KEPT_USER = f"{KEPT_UID}:{KEPT_UID}"
#: capabilities that would let a command become the kept processes' user (CAP_SETUID;
#: CAP_FOWNER: set-ID bits on a file it chowned to that user), ptrace them, or anything:
#: refused for the docker backend
DOCKER_UNSAFE_CAPS = frozenset({"CAP_SETUID", "CAP_FOWNER", "CAP_SYS_PTRACE", "CAP_SYS_ADMIN", "ALL"})
_CTIME_SLACK_NS = 1_000_000_000  # ctime comes from a coarse clock (see scrub_binds)
_LABEL_STORE = "aospec.store"
_LABEL_BASE = "aospec.base_version"
_HEAD_SCHEMA = 1


def ensure_base_image(client: Any, base: BaseFS) -> str:
    """The id of the image holding ``base`` (imported from its directory on first use)."""
    found = client.images.list(filters={"label": f"{_LABEL_BASE}={base.version}"})
    if found:
        return found[0].id
    r, w = os.pipe()
    error: list[BaseException] = []

    def produce() -> None:
        try:
            with os.fdopen(w, "wb") as f, tarfile.open(fileobj=f, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for name in sorted(os.listdir(base.path)):
                    tar.add(base.path / name, arcname=name, recursive=True)
        except BaseException as exc:
            error.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    try:
        with os.fdopen(r, "rb") as f:
            client.api.import_image_from_stream(
                f,
                repository=f"aospec/base-{base.name}",
                tag=base.version[:16],
                changes=[f"LABEL {_LABEL_BASE}={base.version}"],
            )
    finally:
        t.join()
    if error:
        raise SandboxError(f"importing base {base.path} into Docker failed: {error[0]}")
    found = client.images.list(filters={"label": f"{_LABEL_BASE}={base.version}"})
    if not found:
        raise SandboxError(f"importing base {base.path} into Docker produced no image")
    return found[0].id


class _Box:
    """One running container and what we read of it on the host."""

    def __init__(self, store: DockerStore, container: Any, box_dir: Path, image_owned: str | None) -> None:
        self.store = store
        self.container = container
        self.dir = box_dir
        self.image_owned = image_owned  # an image made for this container by a commit-fork
        self.background = False  # the container runs at the least CPU shares
        self.lv = box_dir / "lv"
        self.lv_mounted = False
        self.keep: set[int] = set()
        self.init_fd = -1  # pidfd of the container's init: readable once it exited
        self.cgroups: list[Path] = []
        self.cpu_dir: Path | None = None  # the container's CPU accounting cgroup
        self.frozen = False  # paused (``docker pause``) while a command runs
        # a pause (from the event loop's worker) and a kill's thaw (from the command's) go
        # one at a time, so ``frozen`` is what the daemon did last
        self._freeze_lock = threading.Lock()
        data = store.client.api.inspect_container(container.id)["GraphDriver"]
        if data.get("Name") != "overlay2":
            raise SandboxUnavailableError(
                f"the docker backend needs the overlay2 storage driver, the daemon uses {data.get('Name')!r}"
            )
        self.upper = Path(data["Data"]["UpperDir"])
        self.lower = data["Data"]["LowerDir"].split(":")
        self.merged = Path(data["Data"]["MergedDir"])
        if not self.upper.is_dir():
            raise SandboxUnavailableError(
                f"cannot read the container's upper directory {self.upper}: the docker backend needs a local daemon"
            )
        self.tracker = UpperTracker(self.upper, self._lower_view)

    def _lower_view(self) -> str:
        if len(self.lower) == 1:
            return self.lower[0]
        if not self.lv_mounted:
            self.lv.mkdir(parents=True, exist_ok=True)
            _fs.mount("overlay", str(self.lv), "overlay", _fs.MS_RDONLY, "lowerdir=" + ":".join(self.lower))
            self.lv_mounted = True
        return str(self.lv)

    def set_background(self, background: bool) -> None:
        if background == self.background:
            return
        self.store.client.api.update_container(self.container.id, cpu_shares=2 if background else 1024)
        self.background = background

    def started(self) -> None:
        """Learn the container's init pids and cgroups after a (re)start."""
        state = self.store.client.api.inspect_container(self.container.id)["State"]
        if not state.get("Running"):
            raise SandboxError(f"container {self.container.id[:12]} did not start: {state.get('Error') or state}")
        init = int(state["Pid"])
        if self.init_fd >= 0:
            os.close(self.init_fd)
            self.init_fd = -1
        try:
            self.init_fd = os.pidfd_open(init)
        except ProcessLookupError:
            raise SandboxError(f"container {self.container.id[:12]} stopped right after it started") from None
        self.keep = {init}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            kids = _children(init)
            if kids:
                self.keep.update(kids)
                break
            time.sleep(0.005)
        self.cgroups = _cgroup_dirs(init)
        self.cpu_dir = _cpu_dir(init)

    def cpu_usage_ns(self) -> int:
        """CPU time the container's processes used so far (0 without CPU accounting)."""
        if self.cpu_dir is None:
            return 0
        return _cpu_usage(self.cpu_dir, 1 if (self.cpu_dir / "cpuacct.usage").exists() else 2) or 0

    def freeze(self, frozen: bool) -> None:
        """``docker pause`` / ``docker unpause`` the container (the cgroup freezer)."""
        with self._freeze_lock:
            if frozen == self.frozen:
                return
            try:
                if frozen:
                    self.store.client.api.pause(self.container.id)
                else:
                    self.store.client.api.unpause(self.container.id)
            except Exception as exc:
                # 409: it already is, or it is not running (a command killed its init)
                if getattr(exc, "status_code", None) != 409:
                    raise
            self.frozen = frozen

    def running(self) -> bool:
        return bool(self.store.client.api.inspect_container(self.container.id)["State"].get("Running"))

    def died(self) -> bool:
        """Whether the container's init (the one :meth:`started` saw) has exited."""
        if self.init_fd < 0:
            return True
        return bool(select.select([self.init_fd], [], [], 0)[0])

    def stray_pids(self) -> set[int]:
        pids: set[int] = set()
        for d in self.cgroups:
            with contextlib.suppress(FileNotFoundError):
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
        return pids - self.keep

    def kill_strays(self) -> None:
        """Kill every process of the container but its init and idle process."""
        deadline = time.monotonic() + 10
        while True:
            strays = self.stray_pids()
            if not strays:
                return
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if self.frozen:
                # a frozen process dies only once thawed; the signal is taken first
                self.freeze(False)
            if time.monotonic() > deadline:
                raise SandboxError(f"processes {sorted(strays)} in container {self.container.id[:12]} do not die")
            time.sleep(0.002)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.cgroups:
            for name, key, what in (
                ("memory.oom_control", "oom_kill", "memory"),
                ("memory.events", "oom_kill", "memory"),
                ("pids.events", "max", "pids"),
            ):
                with contextlib.suppress(FileNotFoundError):
                    for line in (d / name).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key and v.strip().isdigit():
                            out[what] = out.get(what, 0) + int(v)
        return out

    def remove(self) -> None:
        if self.frozen:
            with contextlib.suppress(Exception):
                self.freeze(False)
        if self.init_fd >= 0:
            os.close(self.init_fd)
            self.init_fd = -1
        if self.lv_mounted:
            _fs.umount(str(self.lv), detach=True)
            self.lv_mounted = False
        with contextlib.suppress(Exception):
            self.container.remove(force=True, v=True)
        if self.image_owned:
            with contextlib.suppress(Exception):
                self.store.client.images.remove(self.image_owned, force=True, noprune=False)
        _fs.remove_tree(self.dir)


def _children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        return set()


def _cpu_dir(pid: int) -> Path | None:
    """The CPU accounting cgroup of ``pid`` (v1 cpuacct, or the v2 unified one)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",")
        if "cpuacct" in names:
            d = Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
            if not d.exists():
                d = Path("/sys/fs/cgroup/cpuacct") / path.lstrip("/")
            if (d / "cpuacct.usage").exists():
                return d
        elif controllers == "":
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (d / "cpu.stat").exists() and (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
                unified = d
    return unified


def _cgroup_dirs(pid: int) -> list[Path]:
    dirs = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            d = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (d / "cgroup.procs").exists() and not Path("/sys/fs/cgroup/pids").exists():
                dirs.append(d)
        for c in controllers.split(","):
            if c in ("pids", "memory"):
                d = Path("/sys/fs/cgroup") / c / path.lstrip("/")
                if d.exists():
                    dirs.append(d)
    return dirs


class DockerStore:
    """The docker backend's state directory: HEAD (committed container, version and the
    tracker's knowledge of its upper), its lock, and a tmpfs for lower-view mounts."""

    def __init__(self, path: Path, base: BaseFS, config: SandboxConfig, client: Any, *, ephemeral: bool) -> None:
        self.path = path
        self.base = base
        self.config = config
        self.client = client
        self.ephemeral = ephemeral
        self.id = ""
        self.image = ""
        self.recovery = RecoveryReport()
        self.live: dict[str, DockerSandbox] = {}
        self.dir = path  # the held directory's /proc/PID/fd/N name once open (StateDir.dir)
        self._state: StateDir | None = None
        self.shell = "/bin/bash" if os.path.lexists(base.path / "bin/bash") else "/bin/sh"
        self.fork_method = "copy-upper" if config.docker_fork in ("auto", "copy-upper") else "commit"
        # the container's seccomp profile: the overlay backend's filter (None: Docker's default)
        self.seccomp = docker_profile(config.seccomp, network=config.network, writable_binds=config.writable_binds)

    def open(self) -> dict[str, Any] | None:
        """Check, lock, recover; returns HEAD's content (None for a new store). A
        directory that is neither new, empty nor a docker state is refused untouched."""
        self._state = StateDir(self.path, backend="docker")
        self.dir = self._state.dir
        try:
            self.id = store_identity(self._state, ephemeral=self.ephemeral)
            (self.dir / "s").mkdir(exist_ok=True)
            unmounted = _fs.unmount_all_under(str(self.dir))
            _fs.mount("tmpfs", str(self.dir / "s"), "tmpfs", _fs.MS_NOSUID | _fs.MS_NODEV, "size=16m,mode=0700")
            self.image = ensure_base_image(self.client, self.base)
            head = self._read_head()
            keep = head["container"] if head else None
            removed = []
            for c in self.client.containers.list(all=True, filters={"label": f"{_LABEL_STORE}={self.id}"}):
                if c.id != keep:
                    removed.append(c.id[:12])
                    c.remove(force=True, v=True)
            for img in self.client.images.list(filters={"label": f"{_LABEL_STORE}={self.id}"}):
                with contextlib.suppress(Exception):
                    self.client.images.remove(img.id, force=True)
            shown = [str(self.path) + p[len(str(self.dir)) :] for p in unmounted]
            self.recovery = RecoveryReport(unmounted=tuple(shown), containers=tuple(removed))
            return head
        except BaseException:
            self.close()
            raise

    def _read_head(self) -> dict[str, Any] | None:
        head = self.dir / "HEAD"
        if not head.exists():
            return None
        try:
            data = json.loads(head.read_text())
            missing = [k for k in ("version", "container", "base_version", "upper") if k not in data]
            if missing:
                raise KeyError(", ".join(missing))
        except (ValueError, KeyError, TypeError) as exc:
            raise SandboxError(f"{self.path}/HEAD: unreadable HEAD ({exc}); the state directory is damaged") from None
        if data["base_version"] != self.base.version:
            raise SandboxError(
                f"state directory {self.path} was created from a base with version {data['base_version']}, "
                f"not {self.base.version}; open it with the same base or use a new state dir"
            )
        return data

    def write_head(self, version: str, container_id: str, tracker: UpperTracker) -> None:
        data = {
            "schema": _HEAD_SCHEMA,
            "backend": "docker",
            "version": version,
            "container": container_id,
            "base_version": self.base.version,
            "upper": tracker.snapshot(),
        }
        write_atomic(self.dir / "HEAD", json.dumps(data).encode(), durable=self.config.durable)

    def create_box(self, image: str, *, image_owned: str | None = None, upper_from: _Box | None = None) -> _Box:
        """Create (and start) a container; with ``upper_from``, seed its upper with a copy
        of that container's upper first (copy-upper fork)."""
        cfg = self.config
        lim = cfg.limits
        docker = require("docker", "docker")
        ulimits = []
        for name, value in (("fsize", lim.file_size_bytes), ("nofile", lim.open_files), ("cpu", lim.cpu_time_s)):
            if value is not None:
                ulimits.append(docker.types.Ulimit(name=name, soft=value, hard=value))
        sid = new_id()
        try:
            container = self.client.containers.create(
                image,
                command=_IDLE,
                name=f"aospec-{self.id}-{sid}",
                init=True,
                hostname="sandbox",
                network_mode="bridge" if cfg.network else "none",
                # the init and the idle process run as KEPT_UID, every command as root: a
                # command can neither ptrace nor signal them, so nothing of the sandbox's
                # own can run between commands. Not no-new-privileges: with it, Docker
                # 20.10 would give a root exec in a non-root container no capability at
                # all (cap_add); the bounding set (cap_drop ALL + cap_add) caps every
                # process anyway, and the filter below is the overlay backend's.
                user=_KEPT_USER,
                cap_drop=["ALL"],
                cap_add=list(cfg.cap_add) or None,
                security_opt=[f"seccomp={self.seccomp}"] if self.seccomp else None,
                pids_limit=lim.pids,
                mem_limit=lim.memory_bytes,
                memswap_limit=lim.memory_bytes,
                nano_cpus=int(lim.cpus * 1e9) if lim.cpus is not None else None,
                ulimits=ulimits or None,
                volumes={b.source: {"bind": b.target, "mode": "rw" if b.writable else "ro"} for b in cfg.binds} or None,
                labels={_LABEL_STORE: self.id, "aospec.state_dir": str(self.path)},
                detach=True,
            )
        except Exception as exc:
            raise SandboxError(f"docker could not create a container: {exc}") from None
        box_dir = self.dir / "s" / sid
        box_dir.mkdir()
        try:
            box = _Box(self, container, box_dir, image_owned)
            if upper_from is not None:
                _fs.copy_tree(upper_from.upper, box.upper, merge=True)
            container.start()
            box.started()
        except BaseException:
            with contextlib.suppress(Exception):
                container.remove(force=True, v=True)
            _fs.remove_tree(box_dir)
            raise
        return box

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        state = self._state
        if state is None:
            return
        try:
            with contextlib.suppress(Exception):
                _fs.unmount_all_under(str(self.dir))
            if self.ephemeral:
                state.remove()
        finally:
            if self.id:
                unregister_store(self.id)
            state.close()
            self._state = None


class DockerSandbox(SandboxSession):
    """A container sandbox; same API as :class:`aospec.runtime.overlay.OverlaySandbox`."""

    backend = "docker"

    def __init__(
        self,
        store: DockerStore,
        box: _Box,
        *,
        version: str,
        is_root: bool,
        formatter: ObservationFormatter,
        lineage: tuple[str, ...] = (),
    ) -> None:
        self._init_session(store, version=version, is_root=is_root, formatter=formatter, lineage=lineage)
        self._box = box
        self._stats = {"commands": 0, "forks": 0, "commits": 0}
        self._pause = CommandPause()  # the paused flag, the timeout clock and the CPU count
        self._gate = anyio.Lock()  # a pause and the start of a command go one at a time
        self._resumed = anyio.Event()
        self._cpu_start: int | None = None  # the container's CPU count when the command started
        # the command's exec (once created), and whether dockerd reported it running: only
        # then may the container be paused (one paused while its exec starts freezes runc
        # init, and dockerd then waits on it forever, with the container locked)
        self._exec_id: str | None = None
        self._starting = False  # a command began and its exec is not yet known running or over
        self._live = False
        self._stopping = False  # a discard or close gives up on the command
        store.live[self.sid] = self

    @property
    def version(self) -> str:
        return self._version

    @property
    def container_id(self) -> str:
        return str(self._box.container.id)

    async def fork(self) -> DockerSandbox:
        self._check_open()
        async with self._lock:
            self._check_open()
            child_box = await anyio.to_thread.run_sync(self._fork_blocking)
            child = DockerSandbox(
                self.store,
                child_box,
                version=self._version,
                is_root=False,
                formatter=self._formatter,
                lineage=(*self._lineage, self.sid),
            )
            self._stats["forks"] += 1
            return child

    def _fork_blocking(self) -> _Box:
        parent = self._box
        if self.store.fork_method == "commit":
            image = parent.container.commit(
                repository=f"aospec/fork-{self.store.id}",
                tag=new_id(),
                conf={"Labels": {_LABEL_STORE: self.store.id}},
            )
            box = self.store.create_box(image.id, image_owned=image.id)
            box.tracker.adopt()
        else:
            image = (
                parent.container.attrs.get("Image")
                or self.store.client.api.inspect_container(parent.container.id)["Image"]
            )
            box = self.store.create_box(image, upper_from=parent)
            box.tracker.adopt(known=parent.tracker.states())
        return box

    async def set_priority(self, *, foreground: bool) -> None:
        """Run this sandbox's container at the least CPU shares (background) or the default
        (``docker update --cpu-shares``; :class:`aospec.protocols.PrioritizedSandbox`),
        for processes already running too."""
        self._check_open()
        await anyio.to_thread.run_sync(self._box.set_background, not foreground)

    async def pause(self) -> None:
        """``docker pause`` the container while a command runs (:class:`aospec.protocols.PausableSandbox`);
        a command started while paused starts once resumed, and one still starting is paused
        as soon as dockerd reports it running. Paused time does not count against the
        command's timeout. Idempotent."""
        if self._closed:
            return
        # shielded: a pause cancelled while it waits for an exec to start would leave the
        # sandbox paused and its command running (the wait ends with the exec's start)
        with anyio.CancelScope(shield=True):
            async with self._gate:
                await self._pause.pause()
                if await self._exec_running() and not self._stopping:
                    await anyio.to_thread.run_sync(self._box.freeze, True)

    async def resume(self) -> None:
        """``docker unpause``: the command's timeout runs on from where it stopped."""
        async with self._gate:
            if self._box.frozen:
                await anyio.to_thread.run_sync(self._box.freeze, False)
            self._pause.resume()
            self._resumed.set()
            self._resumed = anyio.Event()

    @property
    def paused(self) -> bool:
        return self._pause.paused

    @property
    def cpu_ns(self) -> int:
        """CPU time (ns) of the commands this sandbox ran, the running one included (the
        container's cgroup, :class:`aospec.protocols.MeteredSandbox`); a fork starts from 0."""
        running = 0 if self._cpu_start is None else max(0, self._box.cpu_usage_ns() - self._cpu_start)
        return self._pause.cpu_ns() + running

    def _stop_paused_command(self) -> None:
        # a command waiting for a resume gives up; one starting is not paused any more
        self._stopping = True
        self._resumed.set()
        if self._pause.paused and self._live:
            with contextlib.suppress(Exception):
                self._box.kill_strays()

    def _in_background(self) -> bool:
        return self._box.background

    async def commit(self, fork: DockerSandbox) -> None:
        self._check_open()
        self._check_fork_committable(fork)
        async with self._lock, fork._lock:
            self._check_open()
            self._check_fork_live(fork)
            with anyio.CancelScope(shield=True):
                old = self._box
                self._box, self._version = fork._box, fork._version
                self.last_layer = fork.last_layer
                fork._closed = True
                self.store.live.pop(fork.sid, None)
                if self.is_root:
                    await anyio.to_thread.run_sync(self._write_head)
                if self._box.background:
                    await anyio.to_thread.run_sync(self._box.set_background, False)
                await anyio.to_thread.run_sync(old.remove)
                self._stats["commits"] += 1

    async def _release(self) -> None:
        await anyio.to_thread.run_sync(self._box.remove)

    async def _run_locked(self, command: str, *, timeout_s: float, env: dict[str, str], cwd: str) -> CommandResult:
        cfg = self.store.config
        box = self._box
        await anyio.to_thread.run_sync(self._ensure_running)
        await anyio.to_thread.run_sync(check_workdir, str(box.merged), cwd)
        before = await anyio.to_thread.run_sync(box.counters)
        out = OutputBuffer(cfg.max_output_bytes)
        timed_out = False
        done = anyio.Event()
        started = time.perf_counter()
        since_ns = time.time_ns() - _CTIME_SLACK_NS
        info: dict[str, Any] = {}
        await self._begin_command()
        try:
            exec_id = self._exec_id = await anyio.to_thread.run_sync(
                lambda: self.store.client.api.exec_create(
                    box.container.id,
                    # one pipe for stdout and stderr keeps their interleaving (a
                    # docker exec otherwise multiplexes two streams)
                    [self.store.shell, "-c", 'exec "$0" -c "$1" 2>&1', self.store.shell, command],
                    stdout=True,
                    stderr=True,
                    environment=env,
                    workdir=cwd,
                    user="0:0",
                )["Id"]
            )

            async def watchdog() -> None:
                nonlocal timed_out
                try:
                    with self._pause.deadline(timeout_s):  # paused time does not count
                        await anyio.sleep_forever()
                    timed_out = True
                    out.freeze()  # what the kill below makes the shell print is not output
                finally:
                    # on timeout *and* when cancelled: killing the command's
                    # processes is what makes the blocking reader below return
                    if not done.is_set():
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(box.kill_strays)

            async with anyio.create_task_group() as tg:
                tg.start_soon(watchdog)
                await anyio.to_thread.run_sync(self._read_exec, exec_id, out)
                done.set()
                tg.cancel_scope.cancel()
            info = await anyio.to_thread.run_sync(self.store.client.api.exec_inspect, exec_id)
            rc = info.get("ExitCode")
        finally:
            self._starting = False  # (a pause waiting for the exec to start stops waiting)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(box.kill_strays)
                if cfg.writable_binds:
                    await anyio.to_thread.run_sync(scrub_binds, cfg.binds, since_ns)
                await self._end_command()
                await self._after_change()
        if box.died() or not info.get("Pid"):
            # the container died under the command (or the exec never started): what the
            # command printed and left is unknown, and the OCI runtime's error text is no
            # observation of it. The next command starts the container again.
            raise SandboxError(
                f"container {box.container.id[:12]} died while running the command: no result "
                f"(docker: exit code {rc}, {'the command never started' if not info.get('Pid') else 'init exited'})"
            )
        after = await anyio.to_thread.run_sync(box.counters)
        hit = ["timeout"] if timed_out else []
        hit += [k for k, v in after.items() if v > before.get(k, 0)]
        if timed_out:
            rc = TIMEOUT_RETURNCODE
        if rc == 128 + signal.SIGXFSZ or reached_file_size(
            str(box.upper), (p for p, st in self.last_layer.records if st is not None), cfg.limits.file_size_bytes
        ):
            hit.append("file_size")
        text, truncated = out.text()
        self._stats["commands"] += 1
        return CommandResult(
            returncode=rc if rc is not None else -1,
            output=text,
            timed_out=timed_out,
            duration_s=time.perf_counter() - started,
            limits_hit=tuple(hit),
            truncated=truncated,
        )

    def _read_exec(self, exec_id: str, out: OutputBuffer) -> None:
        for chunk in self.store.client.api.exec_start(exec_id, stream=True, demux=False):
            out.add(chunk)

    async def _begin_command(self) -> None:
        """A command starts: not while the sandbox is paused (it starts once resumed, its
        timeout not running meanwhile); its CPU is counted from here."""
        while True:
            if self._stopping:
                raise SandboxError("the sandbox was discarded while its command waited for a resume")
            async with self._gate:
                if not self._pause.paused:
                    self._cpu_start = self._box.cpu_usage_ns()
                    self._starting = True
                    return
                resumed = self._resumed
            await resumed.wait()

    async def _exec_running(self) -> bool:
        """(Under the gate) whether a command's exec runs, waiting while one is starting
        (created, or about to be) until dockerd reports its process started, or done."""
        delay = 0.002
        while self._starting and not self._live and not self._stopping:
            if self._exec_id is not None:
                info = await anyio.to_thread.run_sync(self.store.client.api.exec_inspect, self._exec_id)
                # (dockerd sets Running before it starts the exec, and Pid once it started)
                if info.get("Running") and info.get("Pid"):
                    self._live = True
                    break
                if info.get("ExitCode") is not None:
                    return False
            await anyio.sleep(delay)
            delay = min(0.05, delay * 2)
        return self._live

    async def _end_command(self) -> None:
        """The command's processes are gone: count its CPU; the container runs again."""
        async with self._gate:
            self._live, self._exec_id = False, None
            if self._box.frozen:
                await anyio.to_thread.run_sync(self._box.freeze, False)
            if self._cpu_start is not None:
                self._pause.add_cpu(max(0, self._box.cpu_usage_ns() - self._cpu_start))
                self._cpu_start = None

    def _ensure_running(self) -> None:
        box = self._box
        if box.died() or not box.running():
            # the container stopped between commands (killed from outside, or by the
            # command that already failed with a SandboxError): its filesystem, the upper
            # directory, is kept; start it again. What differs is read by the next diff,
            # so the version still names the state.
            box.container.start()
            box.started()

    async def _after_change(self) -> None:
        layer = await anyio.to_thread.run_sync(self._box.tracker.diff)
        self._version = layer.apply_to(self._version)
        self.last_layer = layer
        if self.is_root and layer:
            await anyio.to_thread.run_sync(self._write_head)

    def _write_head(self) -> None:
        self.store.write_head(self._version, self._box.container.id, self._box.tracker)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """As :meth:`aospec.runtime.overlay.OverlaySandbox.read_file`."""
        self._check_open()
        async with self._lock:
            self._check_open()
            await anyio.to_thread.run_sync(self._ensure_running)
            return await anyio.to_thread.run_sync(read_in_root, str(self._box.merged), path, max_bytes)

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._check_open()
        raw = data.encode() if isinstance(data, str) else data
        async with self._lock:
            self._check_open()
            await anyio.to_thread.run_sync(self._ensure_running)
            try:
                await anyio.to_thread.run_sync(write_in_root, str(self._box.merged), path, raw, mode)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._after_change()

    def _close_root(self) -> None:
        if self.store.ephemeral:
            self._box.remove()
        else:
            self._stop_blocking()
        self.store.close()

    def _stop_blocking(self) -> None:
        self._write_head()
        with contextlib.suppress(Exception):
            self._box.container.stop(timeout=1)

    def statistics(self) -> SandboxStatistics:
        return SandboxStatistics(**self._stats)


@asynccontextmanager
async def open_docker(config: SandboxConfig | None = None, **overrides: Any) -> AsyncIterator[DockerSandbox]:
    """Open a docker sandbox session (the yielded sandbox is the committed root)."""
    config = (config or SandboxConfig()).replace(**overrides) if overrides else (config or SandboxConfig())
    if os.geteuid() != 0:
        raise SandboxUnavailableError("the docker backend reads container layers on the host and needs root")
    check_binds(config.binds)  # the daemon would create a missing source on the host
    unsafe = sorted({cap_name(c) for c in config.cap_add} & DOCKER_UNSAFE_CAPS)
    if unsafe:
        raise ConfigError(
            f"cap_add {', '.join(unsafe)}: the docker backend cannot keep it (a command could then ptrace or "
            "become the container's kept processes and run code between commands); drop it or use the overlay backend"
        )
    client = await anyio.to_thread.run_sync(docker_client)
    base = await anyio.to_thread.run_sync(lambda: open_base(config.base))
    if config.state_dir is None:
        root = default_state_root()
        private_dir(root)
        path, ephemeral = root / f"d-{os.getpid()}-{new_id()}", True
    else:
        path, ephemeral = Path(config.state_dir).resolve(), False
    store = DockerStore(path, base, config, client, ephemeral=ephemeral)
    head = await anyio.to_thread.run_sync(store.open)
    try:
        box, version, note = await anyio.to_thread.run_sync(_open_root_box, store, head)
        if note:
            store.recovery = RecoveryReport(
                unmounted=store.recovery.unmounted, containers=store.recovery.containers, note=note
            )
        sandbox = DockerSandbox(store, box, version=version, is_root=True, formatter=get_formatter(config.formatter))
        if head is None or note:
            await anyio.to_thread.run_sync(sandbox._write_head)
    except BaseException:
        await anyio.to_thread.run_sync(store.close)
        raise
    try:
        yield sandbox
    finally:
        await sandbox.aclose()


def _open_root_box(store: DockerStore, head: dict[str, Any] | None) -> tuple[_Box, str, str]:
    if head is None:
        box = store.create_box(store.image)
        box.tracker.adopt()
        return box, store.base.version, ""
    try:
        container = store.client.containers.get(head["container"])
    except Exception:
        raise SandboxError(
            f"{store.path}/HEAD names container {head['container'][:12]}, which no longer exists; "
            "the committed state is lost (use a new state dir)"
        ) from None
    user = (store.client.api.inspect_container(container.id).get("Config") or {}).get("User")
    if user != _KEPT_USER:
        raise SandboxError(
            f"{store.path}: its container {container.id[:12]} runs its init as {user or 'root'}, not as {_KEPT_USER} "
            "(made by an older aospec, whose commands could reach it between commands); use a new state dir"
        )
    sid = new_id()
    box_dir = store.dir / "s" / sid
    box_dir.mkdir()
    box = _Box(store, container, box_dir, None)
    if not box.running():
        container.start()
    box.started()
    box.kill_strays()
    box.tracker.restore(head["upper"])
    layer = box.tracker.diff()
    version = layer.apply_to(head["version"])
    note = ""
    if layer:
        note = (
            f"the committed container changed after HEAD was written (a command was interrupted); "
            f"{len(layer.records)} path(s) differ, version moved from {head['version']} to {version}"
        )
    return box, version, note
