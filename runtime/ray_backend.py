"""Sandboxes on many hosts, through Ray (issue 14, section 2).

::

    from aospec.runtime.ray_backend import RayOptions, RaySandboxCluster

    cluster = RaySandboxCluster(RayOptions(address="auto"))       # or ray.init() first
    async with cluster.open(SandboxConfig(base="busybox")) as sb:  # a RaySandbox
        await sb.execute(Action.bash("echo hi > /tmp/x"))
        fork = await sb.fork()                                     # on the same node
        ...
    cluster.shutdown()                                             # closes every session it opened

On every node a Ray actor (a :class:`NodeHost`, named ``aospec-sandbox-host-NODE``, pinned
to its node with node-affinity scheduling, ``num_cpus=0``) owns that node's sandboxes: it
opens them with the ordinary local backend (``overlay`` by default, or ``docker``) under a
state root of its own (``<state root>/ray-NODE``, so two "nodes" on one host never share
a store). A :class:`RaySandbox` is a handle: ``version``/``execute``/``fork``/``commit``/
``discard`` (plus ``run``, ``read_file``, ``write_file``, ``aclose``) are calls on its
node's actor. Versions are computed by the node's backend, where the layers are, and come
back with every call that can move them, so ``version`` stays a plain property and the
engine's JASV check is the same one comparison. A fork lives on its parent's node (it is
a sandbox of the same actor).

Placement: a session opens on the node with the most headroom among those below their
limits (sessions per CPU, live sandboxes, free memory; :class:`RayOptions`). When every
node is full, opening waits (polling) up to ``placement_timeout_s`` and then raises
:class:`ClusterFullError` with each node's load; a fork past a node's live-sandbox limit
waits up to the same bound for a slot on that node.

Node loss: when a node's actor dies (the node went away, the actor was killed), every call
of a session on it raises :class:`NodeLostError` naming the node; sessions on other nodes
go on (their committed state never left their node). A session's forks are discarded when
the session closes; :meth:`RaySandboxCluster.gc` closes sessions idle past a bound (their
driver died) and cleans state that dead hosts left on each node.

``open_sandbox(SandboxConfig(backend="aospec.runtime.ray_backend:open_ray"))`` uses
:func:`default_cluster` (``AOSPEC_RAY_ADDRESS``, default: the Ray this process is connected
to, else ``auto``). Ray is an optional dependency (``pip install 'aospec[ray]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Self

import anyio

from aospec.errors import ConfigError, MissingDependencyError, SandboxError
from aospec.types import Action

__all__ = [
    "ClusterFullError",
    "NodeHost",
    "NodeLostError",
    "RayOptions",
    "RaySandbox",
    "RaySandboxCluster",
    "default_cluster",
    "open_ray",
    "set_default_cluster",
]

HOST_PREFIX = "aospec-sandbox-host-"


class NodeLostError(SandboxError):
    """The node holding a sandbox session died (or its host actor did); names the node."""

    def __init__(self, message: str, *, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


class ClusterFullError(SandboxError):
    """No node had room for a session (or a node none for a fork) within the bounded wait."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            "the Ray sandbox backend needs Ray: pip install 'aospec[ray]' (or pip install 'ray[default]')"
        ) from exc
    return ray


@dataclass(frozen=True, slots=True)
class RayOptions:
    """How sandboxes are placed on a Ray cluster.

    ``address``: ``None`` uses the Ray this process is connected to (``ray.init()`` first;
    if not connected, ``auto``), else ``auto`` or ``ray://HOST:PORT``. ``backend``: the
    local backend each node runs. ``state_root``: where each node keeps its stores (a
    directory ``ray-NODE`` below it; default ``$AOSPEC_STATE_ROOT`` on the node);
    ``cache_dir``: the base cache on each node (default ``$AOSPEC_CACHE_DIR`` there).
    Limits per node: ``sessions_per_cpu`` (sessions = CPUs x this), ``max_live_sandboxes``
    (roots and forks), ``min_free_memory_bytes`` (MemAvailable below it: full).
    ``placement_timeout_s`` bounds every wait for room.
    """

    address: str | None = None
    namespace: str = "aospec"
    backend: str = "overlay"
    state_root: str | None = None
    cache_dir: str | None = None
    sessions_per_cpu: float = 8.0
    max_live_sandboxes: int = 256
    min_free_memory_bytes: int = 256 * 2**20
    placement_timeout_s: float = 30.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if self.sessions_per_cpu <= 0 or self.max_live_sandboxes < 1:
            raise ConfigError("sessions_per_cpu must be > 0 and max_live_sandboxes >= 1")
        if self.placement_timeout_s < 0 or self.poll_s <= 0:
            raise ConfigError("placement_timeout_s must be >= 0 and poll_s > 0")
        if self.backend in ("ray", "aospec.runtime.ray_backend:open_ray"):
            raise ConfigError("the Ray backend runs a local backend on each node (overlay or docker), not itself")


def _config_data(config: Any) -> dict[str, Any]:
    """A SandboxConfig as plain, picklable data (SandboxConfig.from_mapping reads it back)."""
    data = {f.name: getattr(config, f.name) for f in fields(config)}
    data["env"] = dict(data["env"])
    return data


def _meminfo_available() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------- the node actor


class NodeHost:
    """The Ray actor (async) that owns one node's sandboxes. Not used directly: a
    :class:`RaySandboxCluster` starts one per node and talks to it through handles.

    Every sandbox (a session's root or a fork) has a handle id; calls name it. A
    session's sandboxes are all here. Errors come back as the backend raised them
    (SandboxError and subclasses), so callers see what a local sandbox would raise.
    """

    def __init__(self, node_id: str, cpus: float, options: RayOptions) -> None:
        from aospec.runtime._state import default_state_root, private_dir

        self.node_id = node_id
        self.options = options
        base_root = Path(options.state_root) if options.state_root else default_state_root()
        private_dir(base_root)
        self.state_root = base_root / f"ray-{node_id[:16]}"
        private_dir(self.state_root)
        # this actor's process is its own: the local backend opens private stores here
        os.environ["AOSPEC_STATE_ROOT"] = str(self.state_root)
        if options.cache_dir:
            os.environ["AOSPEC_CACHE_DIR"] = options.cache_dir
        self.max_sessions = max(1, int(cpus * options.sessions_per_cpu))
        self.sessions: dict[str, dict[str, Any]] = {}  # session id -> {cm, root, last}
        self.sandboxes: dict[str, Any] = {}  # handle -> sandbox
        self.owner: dict[str, str] = {}  # handle -> session id
        self._room: asyncio.Condition | None = None
        self._collect()

    # -- bookkeeping -------------------------------------------------------------------------

    def _collect(self) -> dict[str, int]:
        """Clean what dead hosts of this node left under its state root (mounts, dirs)."""
        from aospec.runtime.gc import collect_garbage

        with contextlib.suppress(Exception):
            r = collect_garbage(self.state_root, docker=False)
            return {"state_dirs": len(r.state_dirs), "unmounted": len(r.unmounted), "processes": len(r.processes)}
        return {}

    def _condition(self) -> asyncio.Condition:
        if self._room is None:
            self._room = asyncio.Condition()
        return self._room

    async def _freed(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    def _get(self, handle: str) -> Any:
        sb = self.sandboxes.get(handle)
        if sb is None:
            raise SandboxError("the sandbox was already discarded, committed or closed")
        sid = self.owner.get(handle)
        if sid in self.sessions:
            self.sessions[sid]["last"] = time.monotonic()
        return sb

    def _add(self, session_id: str, sb: Any) -> str:
        handle = f"{session_id}/{sb.sid}"
        self.sandboxes[handle] = sb
        self.owner[handle] = session_id
        return handle

    def _drop_closed(self) -> None:
        """Forget handles whose sandboxes the backend consumed (committed, discarded)."""
        for handle, sb in list(self.sandboxes.items()):
            if getattr(sb, "_closed", False):
                self.sandboxes.pop(handle, None)
                self.owner.pop(handle, None)

    def load(self) -> dict[str, Any]:
        """What placement reads: sessions, live sandboxes, free memory, and the limits."""
        return {
            "node_id": self.node_id,
            "sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
            "live_sandboxes": len(self.sandboxes),
            "max_live_sandboxes": self.options.max_live_sandboxes,
            "mem_available": _meminfo_available(),
            "state_root": str(self.state_root),
        }

    def _full(self) -> str | None:
        if len(self.sessions) >= self.max_sessions:
            return f"{len(self.sessions)}/{self.max_sessions} sessions"
        if len(self.sandboxes) >= self.options.max_live_sandboxes:
            return f"{len(self.sandboxes)}/{self.options.max_live_sandboxes} live sandboxes"
        avail = _meminfo_available()
        if avail and avail < self.options.min_free_memory_bytes:
            return f"{avail >> 20} MiB free memory"
        return None

    # -- sessions ----------------------------------------------------------------------------

    async def open(self, session_id: str, config: dict[str, Any]) -> tuple[str, str] | str:
        """Open a session: ``(root handle, version)``, or why this node is full (a string)."""
        from aospec.runtime import SandboxConfig, open_sandbox

        why = self._full()
        if why is not None:
            return why
        cfg = SandboxConfig.from_mapping({**config, "backend": self.options.backend})
        cm = open_sandbox(cfg)
        self.sessions[session_id] = {"cm": None, "root": None, "last": time.monotonic()}  # reserve the slot
        try:
            root = await cm.__aenter__()
        except BaseException:
            self.sessions.pop(session_id, None)
            raise
        self.sessions[session_id].update(cm=cm, root=root)
        return self._add(session_id, root), root.version

    async def close(self, session_id: str) -> None:
        """Close a session: its forks are discarded, its store released (idempotent)."""
        entry = self.sessions.pop(session_id, None)
        for handle in [h for h, s in self.owner.items() if s == session_id]:
            self.sandboxes.pop(handle, None)
            self.owner.pop(handle, None)
        if entry is not None and entry["cm"] is not None:
            await entry["cm"].__aexit__(None, None, None)
        await self._freed()

    async def gc(self, idle_s: float | None) -> dict[str, Any]:
        """Close sessions idle for more than ``idle_s`` (their driver is gone), then clean
        what dead hosts left under this node's state root."""
        closed = []
        if idle_s is not None:
            now = time.monotonic()
            for sid, entry in list(self.sessions.items()):
                if entry["root"] is not None and now - entry["last"] > idle_s:
                    await self.close(sid)
                    closed.append(sid)
        return {"node_id": self.node_id, "closed_sessions": closed, **self._collect()}

    async def shutdown(self) -> int:
        """Close every session (before the actor is killed), clean what they left, and remove
        this node's state root when nothing is left in it (a host of another cluster on the
        node keeps its stores there, and ``rmdir`` leaves a directory that is not empty)."""
        n = len(self.sessions)
        for sid in list(self.sessions):
            await self.close(sid)
        self._collect()
        with contextlib.suppress(OSError):
            os.rmdir(self.state_root)
        return n

    # -- the Sandbox protocol, by handle --------------------------------------------------------

    async def version(self, handle: str) -> str:
        return str(self._get(handle).version)

    async def execute(self, handle: str, action: Action) -> tuple[str, str]:
        sb = self._get(handle)
        try:
            obs = await sb.execute(action)
        finally:
            self._drop_closed()
        return obs, sb.version

    async def run(
        self, handle: str, command: str, timeout: float | None, env: dict[str, str] | None, cwd: str | None
    ) -> tuple[Any, str]:
        sb = self._get(handle)
        result = await sb.run(command, timeout=timeout, env=env, cwd=cwd)
        return result, sb.version

    async def fork(self, handle: str) -> tuple[str, str]:
        sb = self._get(handle)
        if len(self.sandboxes) >= self.options.max_live_sandboxes:
            cond = self._condition()
            try:
                async with cond:
                    await asyncio.wait_for(
                        cond.wait_for(lambda: len(self.sandboxes) < self.options.max_live_sandboxes),
                        self.options.placement_timeout_s,
                    )
            except TimeoutError:
                raise ClusterFullError(
                    f"node {self.node_id[:12]}: {len(self.sandboxes)}/{self.options.max_live_sandboxes} live "
                    f"sandboxes; no fork slot freed within {self.options.placement_timeout_s:g} s"
                ) from None
        child = await sb.fork()
        sid = self.owner[handle]
        return self._add(sid, child), child.version

    async def commit(self, handle: str, fork_handle: str) -> str:
        sb = self._get(handle)
        fork = self.sandboxes.get(fork_handle)
        if fork is None:
            raise SandboxError("commit: the fork was already committed or discarded")
        try:
            await sb.commit(fork)
        finally:
            self._drop_closed()
            await self._freed()
        return str(sb.version)

    async def discard(self, handle: str) -> None:
        sb = self.sandboxes.get(handle)
        if sb is None:
            return
        try:
            await sb.discard()
        finally:
            self._drop_closed()
            await self._freed()

    async def read_file(self, handle: str, path: str, max_bytes: int | None = None) -> bytes:
        return bytes(await self._get(handle).read_file(path, max_bytes=max_bytes))

    async def write_file(self, handle: str, path: str, data: bytes | str, mode: int) -> str:
        sb = self._get(handle)
        await sb.write_file(path, data, mode=mode)
        return str(sb.version)

    async def statistics(self, handle: str) -> Any:
        return self._get(handle).statistics()


# ---------------------------------------------------------------------- the client side


async def _await_ref(ref: Any) -> Any:
    """Wait for an ObjectRef without blocking the event loop (asyncio or trio)."""
    import sniffio

    fut = ref.future()
    if sniffio.current_async_library() == "asyncio":
        return await asyncio.wrap_future(fut)
    return await anyio.to_thread.run_sync(fut.result, abandon_on_cancel=True)


@dataclass(slots=True)
class _Session:
    cluster: RaySandboxCluster
    session_id: str
    node_id: str
    node_ip: str
    host: Any
    lost: NodeLostError | None = None
    closed: bool = False

    def where(self) -> str:
        return f"node {self.node_id[:12]} ({self.node_ip})"

    async def call(self, method: str, *args: Any) -> Any:
        """Call the node's actor; Ray's errors become aospec errors."""
        ray = _ray()
        if self.lost is not None:
            raise self.lost
        if self.closed:
            raise SandboxError("the sandbox session was closed")
        ref = getattr(self.host, method).remote(*args)
        try:
            return await _await_ref(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else None
            if isinstance(cause, SandboxError):
                raise cause from None
            raise SandboxError(f"{method} on {self.where()} failed: {cause or exc}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            self.lost = NodeLostError(
                f"the sandbox session's {self.where()} was lost ({type(exc).__name__}); "
                "its sandboxes and their uncommitted state are gone, other nodes' sessions are unaffected",
                node_id=self.node_id,
            )
            raise self.lost from None
        except BaseException:
            # cancelled: stop the remote call, and wait (shielded) for it to settle so that
            # nothing runs on behind the caller's back
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
                with contextlib.suppress(BaseException), anyio.move_on_after(30):
                    await _await_ref(ref)
            raise


class RaySandbox:
    """A sandbox on a Ray node: implements :class:`aospec.protocols.Sandbox` (and ``run``,
    ``read_file``, ``write_file``, ``statistics``, ``aclose``) through its node's actor."""

    backend = "ray"

    def __init__(self, session: _Session, handle: str, version: str, *, is_root: bool) -> None:
        self._session = session
        self._handle = handle
        self._version = version
        self.is_root = is_root
        self._closed = False

    @property
    def version(self) -> str:
        return self._version

    @property
    def node_id(self) -> str:
        """The Ray node this sandbox (and its whole session) lives on."""
        return self._session.node_id

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox was already discarded, committed or closed")

    async def _refresh(self) -> None:
        with contextlib.suppress(SandboxError):
            self._version = await self._session.call("version", self._handle)

    async def execute(self, action: Action) -> str:
        self._check_open()
        try:
            obs, self._version = await self._session.call("execute", self._handle, action)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._refresh()  # what ran before the cancel is in the version
            raise
        return str(obs)

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> Any:
        """Run ``command`` with bash on the node; a :class:`runtime.CommandResult`."""
        self._check_open()
        try:
            result, self._version = await self._session.call(
                "run", self._handle, command, timeout, dict(env) if env else None, cwd
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._refresh()
            raise
        return result

    async def fork(self) -> RaySandbox:
        self._check_open()
        handle, version = await self._session.call("fork", self._handle)
        return RaySandbox(self._session, handle, version, is_root=False)

    async def commit(self, fork: RaySandbox) -> None:
        self._check_open()
        if not isinstance(fork, RaySandbox) or fork._session is not self._session:
            raise SandboxError("commit: the fork does not belong to this sandbox's session")
        if fork._closed:
            raise SandboxError("commit: the fork was already committed or discarded")
        with anyio.CancelScope(shield=True):  # a half-known commit would leave the handles wrong
            self._version = await self._session.call("commit", self._handle, fork._handle)
        fork._closed = True

    async def discard(self) -> None:
        if self._closed:
            return
        if self.is_root:
            await self.aclose()
            return
        self._closed = True
        if self._session.lost is None and not self._session.closed:
            with anyio.CancelScope(shield=True):
                await self._session.call("discard", self._handle)

    async def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        self._check_open()
        return bytes(await self._session.call("read_file", self._handle, path, max_bytes))

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644) -> None:
        self._check_open()
        self._version = await self._session.call("write_file", self._handle, path, data, mode)

    async def statistics(self) -> Any:
        self._check_open()
        return await self._session.call("statistics", self._handle)

    async def aclose(self) -> None:
        """A fork is discarded; the root closes the whole session on its node."""
        if not self.is_root:
            await self.discard()
            return
        if self._closed:
            return
        self._closed = True
        await self._session.cluster._close_session(self._session)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RaySandboxCluster:
    """Sandbox sessions placed on the nodes of a Ray cluster (one host actor per node)."""

    def __init__(self, options: RayOptions | None = None) -> None:
        self.options = options or RayOptions()
        self._hosts: dict[str, Any] = {}
        self._sessions: dict[str, _Session] = {}
        self._connected = False

    # -- the cluster -----------------------------------------------------------------------------

    def connect(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            address = self.options.address or os.environ.get("AOSPEC_RAY_ADDRESS") or "auto"
            ray.init(address=address, namespace=self.options.namespace, log_to_driver=False)
        self._connected = True

    def nodes(self) -> list[dict[str, Any]]:
        """The alive nodes: ``{"node_id", "ip", "cpus"}``."""
        self.connect()
        ray = _ray()
        return [
            {"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress", "?"), "cpus": n["Resources"].get("CPU", 1.0)}
            for n in ray.nodes()
            if n.get("Alive")
        ]

    def host(self, node_id: str, cpus: float = 1.0) -> Any:
        """The host actor of ``node_id`` (started there on first use)."""
        if node_id in self._hosts:
            return self._hosts[node_id]
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = (
            ray.remote(NodeHost)
            .options(
                name=f"{HOST_PREFIX}{node_id}",
                namespace=self.options.namespace,
                get_if_exists=True,
                num_cpus=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(node_id, cpus, self.options)
        )
        self._hosts[node_id] = actor
        return actor

    def loads(self) -> list[dict[str, Any]]:
        """Every alive node's load (starting its host if needed); unreachable nodes left out."""
        return [{**n, **load} for n in self.nodes() if (load := self._ask(n, "load")) is not None]

    def _ask(self, node: Mapping[str, Any], method: str, *args: Any, timeout: float = 120) -> Any:
        """Call a node's host; a dead host is replaced once (a new one cleans what the dead
        one left); None when the node cannot be reached."""
        ray = _ray()
        for _ in range(2):
            host = self.host(node["node_id"], node["cpus"])
            try:
                return ray.get(getattr(host, method).remote(*args), timeout=timeout)
            except ray.exceptions.RayActorError:
                self._hosts.pop(node["node_id"], None)
            except ray.exceptions.GetTimeoutError:
                return None
        return None

    # -- sessions ------------------------------------------------------------------------------

    @asynccontextmanager
    async def open(self, config: Any = None, **overrides: Any) -> AsyncIterator[RaySandbox]:
        """Open a session on the node with most room: ``async with cluster.open(cfg) as sb``."""
        from aospec.runtime import SandboxConfig

        if config is None:
            config = SandboxConfig()
        elif not isinstance(config, SandboxConfig):
            config = SandboxConfig.from_mapping(config)
        if overrides:
            config = config.replace(**overrides)
        root = await self.open_session(config)
        try:
            yield root
        finally:
            with anyio.CancelScope(shield=True):
                await root.aclose()

    async def open_session(self, config: Any) -> RaySandbox:
        """Place and open a session; the caller closes the returned root (``aclose``)."""
        from aospec.runtime._state import new_id

        await anyio.to_thread.run_sync(self.connect)
        data = _config_data(config)
        deadline = time.monotonic() + self.options.placement_timeout_s
        session_id = f"r{new_id()}"
        while True:
            loads = await anyio.to_thread.run_sync(self.loads)
            ranked = sorted(loads, key=_headroom, reverse=True)
            why: list[str] = []
            for load in ranked:
                host = self.host(load["node_id"], load["cpus"])
                session = _Session(self, session_id, load["node_id"], load["ip"], host)
                reply = await session.call("open", session_id, data)
                if isinstance(reply, str):
                    why.append(f"node {load['node_id'][:12]}: {reply}")
                    continue
                handle, version = reply
                self._sessions[session_id] = session
                return RaySandbox(session, handle, version, is_root=True)
            if time.monotonic() >= deadline:
                raise ClusterFullError(
                    f"no Ray node had room for a sandbox session within {self.options.placement_timeout_s:g} s"
                    f" ({'; '.join(why) or 'no alive nodes'})"
                )
            await anyio.sleep(self.options.poll_s)

    async def _close_session(self, session: _Session) -> None:
        self._sessions.pop(session.session_id, None)
        if session.closed:
            return
        with anyio.CancelScope(shield=True):
            try:
                if session.lost is None:
                    await session.call("close", session.session_id)
            finally:
                session.closed = True

    def gc(self, idle_s: float | None = None) -> list[dict[str, Any]]:
        """On every node: close sessions idle for more than ``idle_s`` (None: none) and
        clean what dead hosts left under the node's state root. Returns one report per node."""
        return [r for n in self.nodes() if (r := self._ask(n, "gc", idle_s)) is not None]

    def shutdown(self) -> None:
        """Close every session on every host this cluster started, then stop the hosts."""
        if not self._hosts:
            return
        ray = _ray()
        for actor in list(self._hosts.values()):
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=120)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._hosts.clear()
        self._sessions.clear()


def _headroom(load: Mapping[str, Any]) -> float:
    """Fraction of a node's limits still free (the smallest of sessions and sandboxes)."""
    s = 1 - load["sessions"] / max(1, load["max_sessions"])
    f = 1 - load["live_sandboxes"] / max(1, load["max_live_sandboxes"])
    return min(s, f)


_DEFAULT: list[RaySandboxCluster] = []


def default_cluster() -> RaySandboxCluster:
    """The process-wide cluster ``open_ray`` uses (RayOptions from ``AOSPEC_RAY_ADDRESS``)."""
    if not _DEFAULT:
        _DEFAULT.append(RaySandboxCluster(RayOptions(address=os.environ.get("AOSPEC_RAY_ADDRESS"))))
    return _DEFAULT[0]


def open_ray(config: Any = None, **overrides: Any) -> contextlib.AbstractAsyncContextManager[RaySandbox]:
    """The opener of ``SandboxConfig(backend="aospec.runtime.ray_backend:open_ray")``: a session
    on :func:`default_cluster`, running its default local backend (overlay) on the node."""
    return default_cluster().open(config, **overrides)


def set_default_cluster(cluster: RaySandboxCluster | None) -> None:
    """Make ``cluster`` the one :func:`open_ray` uses (None: back to the environment's)."""
    _DEFAULT[:] = [cluster] if cluster is not None else []
