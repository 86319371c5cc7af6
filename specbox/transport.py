"""Out-of-band transport: large tool outputs and artifacts handed over through shared memory.

A producer (the process that ran a tool) publishes an artifact in an
:class:`ArtifactServer`; what travels in-band (in the observation, a JSON message) is an
:class:`ArtifactRef`: the bytes themselves when the artifact is smaller than the inline
threshold (64 KiB by default), else a random **64-bit token**, the size and the server's
address. A consumer in another process resolves the token through an
:class:`ArtifactClient` and gets a read-only, zero-copy :class:`memoryview` of the
producer's memory: handing over 1 GB costs one request on a Unix socket and one ``mmap``,
not a copy.

Two backings:

- ``"memfd"`` (default): the artifact is an anonymous ``memfd_create`` file, sealed
  against writes, growing and shrinking once published (``F_SEAL_WRITE|F_SEAL_GROW|
  F_SEAL_SHRINK|F_SEAL_SEAL``); a consumer receives a file descriptor over the Unix
  socket (``SCM_RIGHTS``) and maps it read-only. Nothing is named anywhere: when the
  producer crashes the kernel frees every artifact no consumer has mapped, and mappings
  a consumer holds stay valid.
- ``"shm"``: a named POSIX shared-memory segment (``/dev/shm/aospec-<pid>-<token>``, mode
  0600), for consumers that cannot receive descriptors; the consumer opens it read-only by
  name. Names survive a crashed producer: :func:`sweep_orphans` unlinks the segments whose
  producer process is gone (an ``ArtifactServer`` sweeps at start).

Reference counts, kept by the server: publishing gives the artifact one *token reference*
(held by whoever holds the ref); each consumer ``open`` adds a *lease*, dropped by
``Artifact.close`` or when the consumer's connection ends (a crashed consumer leaks
nothing). ``release(ref)`` drops the token reference; ``take(ref)`` opens and releases in
one step (ownership moves to the consumer). On the last reference the server frees the
artifact (closes the memfd, or unlinks the segment). ``ArtifactServer.sweep(max_age_s)``
drops token references nobody took in time.

Limits, for a server other local users can reach (an abstract socket is open to every
process in the network namespace): ``max_bytes`` bounds what the server holds at once
(published artifacts and ones being filled); a new artifact that would pass it first frees
the oldest ones only their token holds (published, never taken: the ones a sweep would
free), and when that is not enough it is refused with :class:`ArtifactBudgetError` naming
the limit. ``max_connections`` bounds the connections served at once (more wait in the
listen backlog); the accept loop survives running out of descriptors or threads (it backs
off and keeps accepting). Every request names the token of a live artifact, ``ping``
included, so a process without one learns nothing.

For comparison, :class:`JsonRpcServer`/:class:`JsonRpcClient` are a plain JSON-RPC 2.0
baseline over a Unix socket (``Content-Length`` framing) moving the bytes as base64 in the
reply, as tool servers usually do. ``scripts/bench_transport.py`` compares the two.

``python -m aospec.specbox.transport`` runs a producer driven by lines on stdin (used by the tests
and the benchmark to publish from another process); see :func:`main`.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import mmap
import os
import secrets
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aospec.errors import AospecError

__all__ = [
    "INLINE_THRESHOLD",
    "SHM_DIR",
    "SHM_PREFIX",
    "Artifact",
    "ArtifactBudgetError",
    "ArtifactClient",
    "ArtifactRef",
    "ArtifactServer",
    "ArtifactWriter",
    "JsonRpcClient",
    "JsonRpcServer",
    "ProducerGoneError",
    "ServerStats",
    "TransportError",
    "UnknownTokenError",
    "sweep_orphans",
]

#: Artifacts smaller than this many bytes travel inline (in the ref itself).
INLINE_THRESHOLD = 64 * 1024
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "aospec-"
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
_MSG_MAX = 4096

Backing = Literal["memfd", "shm"]


class TransportError(AospecError):
    """A transport request failed (an :class:`aospec.errors.AospecError`, so a command-line
    run reports it in one line)."""


class UnknownTokenError(TransportError, LookupError):
    """No live artifact has this token at that server (never published, or already freed)."""


class ProducerGoneError(TransportError, ConnectionError):
    """The producer's server cannot be reached (it exited or crashed)."""


class ArtifactBudgetError(TransportError, MemoryError):
    """A new artifact does not fit the server's ``max_bytes`` (the message names the limit)."""


def _fmt_token(token: int) -> str:
    return f"{token:016x}"


def _parse_token(token: int | str) -> int:
    if isinstance(token, int) and not isinstance(token, bool):
        value = token
    elif isinstance(token, str):
        try:
            value = int(token, 16)
        except ValueError:
            raise UnknownTokenError(f"malformed token {token!r}: expected 16 hex digits") from None
    else:
        raise UnknownTokenError(f"malformed token {token!r}")
    if not 0 <= value < 1 << 64:
        raise UnknownTokenError(f"token {token!r} is not a 64-bit value")
    return value


def _sock_address(address: str) -> str:
    """``@name`` is a Linux abstract socket (no file), anything else a filesystem path."""
    return "\0" + address[1:] if address.startswith("@") else address


# ---------------------------------------------------------------------------------------
# Refs


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """What travels in-band: the bytes (``inline``), or a 64-bit ``token`` at ``address``."""

    size: int
    token: int | None = None
    address: str | None = None
    inline: bytes | None = None

    @property
    def is_inline(self) -> bool:
        return self.inline is not None

    def to_json(self) -> dict[str, Any]:
        if self.inline is not None:
            return {"size": self.size, "inline": base64.b64encode(self.inline).decode("ascii")}
        assert self.token is not None
        return {"size": self.size, "token": _fmt_token(self.token), "address": self.address}

    @classmethod
    def from_json(cls, obj: Any) -> ArtifactRef:
        if not isinstance(obj, dict) or not isinstance(obj.get("size"), int):
            raise TransportError(f"not an artifact ref: {obj!r}")
        if "inline" in obj:
            data = base64.b64decode(obj["inline"], validate=True)
            if len(data) != obj["size"]:
                raise TransportError("inline artifact ref: size does not match its data")
            return cls(len(data), inline=data)
        address = obj.get("address")
        if not isinstance(address, str):
            raise TransportError(f"artifact ref without an address: {obj!r}")
        return cls(obj["size"], _parse_token(obj.get("token")), address)


# ---------------------------------------------------------------------------------------
# The producer's side


@dataclass
class _Entry:
    token: int
    size: int
    backing: Backing
    fd: int  # memfd, or the segment's fd (kept so that open does not race an unlink)
    name: str | None  # shm segment name
    token_refs: int = 1
    leases: int = 0
    created: float = 0.0

    @property
    def refs(self) -> int:
        return self.token_refs + self.leases


@dataclass(frozen=True)
class ServerStats:
    """Counts of an :class:`ArtifactServer`."""

    published: int = 0
    inline: int = 0
    opened: int = 0
    freed: int = 0
    swept: int = 0
    evicted: int = 0
    refused: int = 0
    live: int = 0
    live_bytes: int = 0


class ArtifactWriter:
    """A writable artifact being filled (``view``); ``publish()`` seals it and returns its
    ref. Use as a context manager: leaving without ``publish`` (or on an error) frees it."""

    def __init__(self, server: ArtifactServer, size: int, backing: Backing) -> None:
        self._server = server
        self.size = size
        self.token = server._new_token()
        self.backing = backing
        self.name: str | None = None
        server._reserve(size)  # ArtifactBudgetError when it does not fit
        try:
            if backing == "memfd":
                self.fd = os.memfd_create(f"aospec-{_fmt_token(self.token)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            else:
                self.name = f"{SHM_PREFIX}{os.getpid()}-{_fmt_token(self.token)}"
                self.fd = os.open(SHM_DIR / self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except BaseException:
            server._unreserve(size)
            raise
        try:
            os.ftruncate(self.fd, size)
            self._mmap: mmap.mmap | None = mmap.mmap(self.fd, size) if size else None
        except BaseException:
            self._free()
            raise
        self.view = memoryview(self._mmap) if self._mmap is not None else memoryview(bytearray())
        self._done = False

    def _free(self) -> None:
        self._server._unreserve(self.size)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self.name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / self.name)

    def _unmap(self) -> None:
        self.view.release()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                raise TransportError("release every view of the artifact's buffer before publishing it") from None

    def publish(self) -> ArtifactRef:
        if self._done:
            raise TransportError("the artifact was already published or abandoned")
        self._unmap()
        self._done = True
        try:
            if self.backing == "memfd":
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            else:
                os.fchmod(self.fd, 0o400)
        except BaseException:
            self._free()
            raise
        return self._server._register(self)

    def abandon(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(TransportError):
            self._unmap()
        self._free()

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()


class ArtifactServer:
    """Publishes artifacts and serves them to consumers over a Unix socket (module doc).

    ``address``: a filesystem path, or ``@name`` for a Linux abstract socket (the default,
    ``@aospec-transport-<pid>-<random>``: no file to clean up). ``threshold``: artifacts
    smaller than this travel inline. ``backing``: ``"memfd"`` or ``"shm"``. ``max_bytes``
    (None: no limit), ``limit_flag`` (the option that raises it, named in the refusal) and
    ``max_connections``: the limits of the module doc. Start it with ``start()`` or
    ``with``; ``close()`` frees every artifact (consumers' mappings stay valid) and ends
    every connection.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        threshold: int = INLINE_THRESHOLD,
        backing: Backing = "memfd",
        sweep: bool = True,
        max_bytes: int | None = None,
        limit_flag: str | None = None,
        max_connections: int = 64,
    ) -> None:
        if backing not in ("memfd", "shm"):
            raise ValueError(f"unknown backing {backing!r}")
        if max_connections < 1 or (max_bytes is not None and max_bytes < 0):
            raise ValueError("max_connections must be >= 1 and max_bytes >= 0")
        self.address = address or f"@aospec-transport-{os.getpid()}-{secrets.token_hex(6)}"
        self.threshold = threshold
        self.backing: Backing = backing
        self.max_bytes = max_bytes
        self.limit_flag = limit_flag
        self._pending_bytes = 0  # of writers not yet published
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._stats = ServerStats()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._leases = 0
        if sweep and backing == "shm":
            sweep_orphans()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> ArtifactServer:
        if self._listener is not None:
            return self
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(_sock_address(self.address))
        sock.listen(64)
        self._listener = sock
        t = threading.Thread(target=self._accept, name=f"artifacts {self.address}", daemon=True)
        t.start()
        self._threads.append(t)
        weakref.finalize(self, _close_fds, self._entries, self._lock)
        return self

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            if not self.address.startswith("@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        _close_fds(self._entries, self._lock)

    def __enter__(self) -> ArtifactServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publishing ---------------------------------------------------------------------

    def _new_token(self) -> int:
        while True:
            token = secrets.randbits(64)
            with self._lock:
                if token not in self._entries:
                    return token

    def allocate(self, size: int) -> ArtifactWriter:
        """A writable shared-memory artifact of ``size`` bytes to fill, then ``publish()``
        (for producers that write their output in place: no copy at all)."""
        if size < 0:
            raise ValueError("size must be >= 0")
        self._check_open()
        return ArtifactWriter(self, size, self.backing)

    def put(self, data: bytes | bytearray | memoryview) -> ArtifactRef:
        """Publish ``data``: inline below the threshold, else copied once into shared memory."""
        self._check_open()
        view = memoryview(data).cast("B")
        if view.nbytes < self.threshold or view.nbytes == 0:
            with self._lock:
                self._bump(inline=1)
            return ArtifactRef(view.nbytes, inline=bytes(view))
        with self.allocate(view.nbytes) as writer:
            writer.view[:] = view
            return writer.publish()

    def _register(self, writer: ArtifactWriter) -> ArtifactRef:
        entry = _Entry(writer.token, writer.size, writer.backing, writer.fd, writer.name, created=time.monotonic())
        with self._lock:
            self._pending_bytes -= writer.size  # now counted as a live entry
            self._entries[entry.token] = entry
            self._bump(published=1)
        return ArtifactRef(entry.size, entry.token, self.address)

    # -- references ---------------------------------------------------------------------

    def refcount(self, token: int | str) -> int:
        """Token references plus leases of a live artifact; 0 when it is gone."""
        with self._lock:
            entry = self._entries.get(_parse_token(token))
            return entry.refs if entry else 0

    def release(self, ref: ArtifactRef | int | str) -> None:
        """Drop the token reference of an artifact (frees it when no consumer holds it)."""
        token = ref.token if isinstance(ref, ArtifactRef) else ref
        if token is None:
            return  # inline: nothing to release
        with self._lock:
            entry = self._get(_parse_token(token))
            if entry.token_refs <= 0:
                raise TransportError(f"token {_fmt_token(entry.token)} was already released")
            entry.token_refs -= 1
            self._maybe_free(entry)

    def sweep(self, max_age_s: float) -> int:
        """Free artifacts older than ``max_age_s`` that only their token still holds (handed to
        a consumer that never came); returns how many."""
        now = time.monotonic()
        with self._lock:
            doomed = [e for e in self._entries.values() if e.leases == 0 and now - e.created >= max_age_s]
            for e in doomed:
                e.token_refs = 0
                self._maybe_free(e)
            self._bump(swept=len(doomed))
        return len(doomed)

    @property
    def stats(self) -> ServerStats:
        with self._lock:
            return ServerStats(
                **{
                    **self._stats.__dict__,
                    "live": len(self._entries),
                    "live_bytes": sum(e.size for e in self._entries.values()),
                }
            )

    def tokens(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    # -- internals (call with the lock held) -------------------------------------------

    def _bump(self, **deltas: int) -> None:
        self._stats = ServerStats(**{k: v + deltas.get(k, 0) for k, v in self._stats.__dict__.items()})

    def _get(self, token: int) -> _Entry:
        entry = self._entries.get(token)
        if entry is None:
            raise UnknownTokenError(
                f"no artifact with token {_fmt_token(token)} at {self.address}: never published here, or already freed"
            )
        return entry

    def _maybe_free(self, entry: _Entry) -> None:
        if entry.refs > 0:
            return
        self._entries.pop(entry.token, None)
        _free_entry(entry)
        self._bump(freed=1)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the artifact server is closed")

    def _reserve(self, size: int) -> None:
        """Count ``size`` bytes against ``max_bytes`` for a writer, freeing the oldest
        artifacts only their token holds to make room (module doc)."""
        with self._lock:
            if self.max_bytes is not None:
                held = self._pending_bytes + sum(e.size for e in self._entries.values())
                if held + size > self.max_bytes:
                    for e in sorted(self._entries.values(), key=lambda e: e.created):
                        if held + size <= self.max_bytes:
                            break
                        if e.leases == 0:
                            held -= e.size
                            e.token_refs = 0
                            self._maybe_free(e)
                            self._bump(evicted=1)
                if held + size > self.max_bytes:
                    self._bump(refused=1)
                    raise ArtifactBudgetError(self._over_budget(size, held))
            self._pending_bytes += size

    def _over_budget(self, size: int, held: int) -> str:
        raise_it = f" ({self.limit_flag} raises it)" if self.limit_flag else ""
        if size > self.max_bytes:  # type: ignore[operator]
            return f"{size} bytes are over the {self.max_bytes}-byte limit on held artifacts{raise_it}"
        return (
            f"{size} more bytes do not fit the {self.max_bytes}-byte limit on held artifacts: {held} bytes are "
            f"held by consumers reading them{raise_it}"
        )

    def _unreserve(self, size: int) -> None:
        with self._lock:
            self._pending_bytes -= size

    # -- serving ------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        backoff = 0.0
        while not self._closed:
            if backoff:
                time.sleep(backoff)  # out of descriptors or threads: let some go, then go on
            if not self._slots.acquire(timeout=0.5):
                continue  # max_connections served: the next waits in the listen backlog
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                self._slots.release()
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listener was closed
                backoff = min(1.0, backoff * 2 or 0.01)  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ...
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    self._slots.release()
                    return
                self._conns.add(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            try:
                t.start()
            except RuntimeError:  # can't start a new thread
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                self._slots.release()
                backoff = min(1.0, backoff * 2 or 0.01)
                continue
            backoff = 0.0
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._serve_requests(conn)
        finally:
            self._slots.release()

    def _serve_requests(self, conn: socket.socket) -> None:
        leases: dict[int, int] = {}  # lease id -> token
        try:
            while True:
                try:
                    msg = conn.recv(_MSG_MAX)
                except OSError:
                    return
                if not msg:
                    return
                fd: int | None = None
                try:
                    reply, fd = self._handle(json.loads(msg), leases)
                except TransportError as exc:
                    kind = "unknown_token" if isinstance(exc, UnknownTokenError) else "error"
                    reply = {"ok": False, "kind": kind, "error": str(exc)}
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "kind": "error", "error": f"bad request: {exc!r}"}
                data = json.dumps(reply).encode()
                try:
                    if fd is not None:
                        socket.send_fds(conn, [data], [fd])
                    else:
                        conn.send(data)
                except OSError:
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
                for token in leases.values():
                    entry = self._entries.get(token)
                    if entry is not None:
                        entry.leases -= 1
                        self._maybe_free(entry)
            conn.close()

    def _handle(self, req: dict[str, Any], leases: dict[int, int]) -> tuple[dict[str, Any], int | None]:
        op = req["op"]
        if op in ("open", "take"):
            token = _parse_token(req["token"])
            with self._lock:
                entry = self._get(token)
                entry.leases += 1
                if op == "take":
                    if entry.token_refs <= 0:
                        entry.leases -= 1
                        raise TransportError(f"token {_fmt_token(token)} was already released: open it instead")
                    entry.token_refs -= 1
                self._leases += 1
                lease = self._leases
                leases[lease] = token
                self._bump(opened=1)
                reply = {"ok": True, "size": entry.size, "lease": lease, "backing": entry.backing, "name": entry.name}
                # the fd is sent while the lease holds the entry, so it cannot be closed under us
                return reply, entry.fd if entry.backing == "memfd" else None
        if op == "close":
            token = leases.pop(int(req["lease"]), None)
            if token is None:
                raise TransportError(f"no lease {req['lease']!r} on this connection")
            with self._lock:
                entry = self._entries.get(token)
                if entry is not None:
                    entry.leases -= 1
                    self._maybe_free(entry)
            return {"ok": True}, None
        if op == "release":
            self.release(req["token"])
            return {"ok": True}, None
        if op == "ping":  # only for a holder of a live token: the pid tells others nothing
            with self._lock:
                self._get(_parse_token(req["token"]))
            return {"ok": True, "pid": os.getpid()}, None
        raise TransportError(f"unknown op {op!r}")


def _free_entry(entry: _Entry) -> None:
    with contextlib.suppress(OSError):
        os.close(entry.fd)
    if entry.name is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / entry.name)


def _close_fds(entries: dict[int, _Entry], lock: threading.Lock) -> None:
    with lock:
        doomed = list(entries.values())
        entries.clear()
    for e in doomed:
        _free_entry(e)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from /proc; None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        btime = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _owner_alive(pid: int, made_at: float) -> bool:
    """Whether the producer that made a segment at ``made_at`` still runs: its pid exists and
    did not start after the segment was made (a reused pid)."""
    if not _pid_alive(pid):
        return False
    start = _process_start(pid)
    return start is None or start <= made_at + 2.0  # /proc's boot time has 1 s resolution


async def sweep_forever(artifacts: ArtifactServer, ttl_s: float) -> None:
    """Free published results no client took within ``ttl_s`` (a client that does not read
    artifacts, or one that went away before taking), checking every quarter of ``ttl_s``;
    runs until cancelled."""
    import anyio

    while True:
        await anyio.sleep(max(ttl_s / 4, 0.05))
        artifacts.sweep(ttl_s)


def sweep_orphans(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the shared-memory segments (``aospec-<pid>-<token>``) whose producer process no
    longer exists (or whose pid now names a process started after the segment was made);
    returns their names. Safe to run any time: a live producer's segments are never
    touched. Pids are those of the caller's pid namespace: run it where the producers run."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX):
            continue
        pid_text, _, token = name[len(SHM_PREFIX) :].partition("-")
        if not pid_text.isdigit() or len(token) != 16:
            continue
        try:
            made_at = os.stat(shm_dir / name).st_mtime  # >= the creation, which came after the producer started
        except FileNotFoundError:
            continue
        if _owner_alive(int(pid_text), made_at):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_dir / name)
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------
# The consumer's side


class Artifact:
    """A consumer's read-only view of an artifact (``view``, a zero-copy memoryview).

    ``close()`` unmaps it and drops its lease; views derived from ``view`` (slices, numpy
    arrays) must be released first, else the mapping stays until they are collected (the
    lease is dropped anyway; the memory stays valid while mapped)."""

    def __init__(
        self, view: memoryview, size: int, token: int | None, mm: mmap.mmap | None, closer: Any | None
    ) -> None:
        self.view = view
        self.size = size
        self.token = token
        self._mmap = mm
        self._closer = closer
        self.closed = False

    def tobytes(self) -> bytes:
        return self.view.tobytes()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.view.release()
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.size


class ArtifactClient:
    """A consumer's connection to one :class:`ArtifactServer` (thread-safe; one request at a
    time). Closing it (or the process ending) drops every lease it holds."""

    def __init__(self, address: str, *, timeout_s: float = 30.0) -> None:
        self.address = address
        self._lock = threading.Lock()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.settimeout(timeout_s)
        try:
            sock.connect(_sock_address(address))
        except OSError as exc:
            sock.close()
            raise ProducerGoneError(f"cannot reach the artifact server at {address}: {exc}") from None
        self._sock: socket.socket | None = sock

    def _request(self, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            if self._sock is None:
                raise TransportError("the artifact client is closed")
            try:
                self._sock.send(json.dumps(req).encode())
                msg, fds, _, _ = socket.recv_fds(self._sock, _MSG_MAX, 1)
            except OSError as exc:
                raise ProducerGoneError(f"the artifact server at {self.address} went away: {exc}") from None
        if not msg:
            for fd in fds:
                os.close(fd)
            raise ProducerGoneError(f"the artifact server at {self.address} closed the connection")
        reply = json.loads(msg)
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            cls = UnknownTokenError if reply.get("kind") == "unknown_token" else TransportError
            raise cls(reply.get("error", "request failed"))
        return reply, fds

    def _token(self, ref: ArtifactRef | int | str) -> int:
        if isinstance(ref, ArtifactRef):
            if ref.address is not None and ref.address != self.address:
                raise TransportError(f"the ref is served at {ref.address}, this client talks to {self.address}")
            if ref.token is None:
                raise TransportError("an inline ref has no token")
            return ref.token
        return _parse_token(ref)

    def open_fd(self, ref: ArtifactRef | int | str, *, take: bool = False) -> tuple[int, int, int]:
        """(fd, size, lease) of a memfd-backed artifact, for callers that pass the descriptor
        on (e.g. into a sandboxed process); close the fd and ``close_lease(lease)`` after."""
        reply, fds = self._request({"op": "take" if take else "open", "token": _fmt_token(self._token(ref))})
        if reply["backing"] == "shm":
            fd = os.open(SHM_DIR / reply["name"], os.O_RDONLY | os.O_CLOEXEC)
        elif len(fds) != 1:
            raise TransportError("the server sent no file descriptor")
        else:
            fd = fds[0]
        return fd, int(reply["size"]), int(reply["lease"])

    def close_lease(self, lease: int) -> None:
        """Drop a lease (a no-op once the client is closed or the server gone: the lease went
        with the connection)."""
        if self._sock is None:
            return
        with contextlib.suppress(ProducerGoneError):
            self._request({"op": "close", "lease": lease})

    def open(self, ref: ArtifactRef | int | str, *, take: bool = False) -> Artifact:
        """Map an artifact read-only (inline refs need no server). ``take`` also drops the
        token reference (the artifact is freed when this consumer closes it)."""
        if isinstance(ref, ArtifactRef) and ref.inline is not None:
            return Artifact(memoryview(ref.inline), ref.size, None, None, None)
        fd, size, lease = self.open_fd(ref, take=take)
        try:
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        except BaseException:
            self.close_lease(lease)
            raise
        finally:
            os.close(fd)
        view = memoryview(mm) if mm is not None else memoryview(b"")
        return Artifact(view, size, self._token(ref), mm, lambda: self.close_lease(lease))

    def take(self, ref: ArtifactRef | int | str) -> Artifact:
        return self.open(ref, take=True)

    def release(self, ref: ArtifactRef | int | str) -> None:
        """Drop the token reference (the producer's or one handed over)."""
        if isinstance(ref, ArtifactRef) and ref.inline is not None:
            return
        self._request({"op": "release", "token": _fmt_token(self._token(ref))})

    def ping(self, ref: ArtifactRef | int | str) -> int:
        """The server process's pid; ``ref`` must be a live artifact's (its token)."""
        return int(self._request({"op": "ping", "token": _fmt_token(self._token(ref))})[0]["pid"])

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> ArtifactClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# JSON-RPC baseline


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise ConnectionError("connection closed mid-message")
        got += k
    return buf


def _recv_message(sock: socket.socket) -> bytearray | None:
    header = b""
    while not header.endswith(b"\r\n\r\n"):
        c = sock.recv(1)
        if not c:
            if header:
                raise ConnectionError("connection closed mid-header")
            return None
        header += c
        if len(header) > 1024:
            raise ValueError("JSON-RPC header too long")
    length = None
    for line in header.decode("ascii").split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    if length is None:
        raise ValueError("JSON-RPC message without Content-Length")
    return _recv_exact(sock, length)


class JsonRpcServer:
    """The baseline: a JSON-RPC 2.0 server on a Unix stream socket (``Content-Length``
    framing, as LSP and many tool servers) whose ``get`` method returns
    ``{"size": n, "data": base64}`` of a registered buffer."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address or f"@aospec-jsonrpc-{os.getpid()}-{secrets.token_hex(6)}"
        self._objects: dict[str, Any] = {}
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def register(self, name: str, data: bytes | memoryview) -> None:
        with self._lock:
            self._objects[name] = data

    def unregister(self, name: str) -> None:
        with self._lock:
            self._objects.pop(name, None)

    def start(self) -> JsonRpcServer:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(_sock_address(self.address))
        sock.listen(16)
        self._sock = sock
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        with self._lock:
            conns = list(self._conns)
            self._objects.clear()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> JsonRpcServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                msg = _recv_message(conn)
                if msg is None:
                    return
                req = json.loads(msg)
                rid = json.dumps(req.get("id"))
                parts: list[bytes]
                with self._lock:
                    obj = self._objects.get(req.get("params", {}).get("name")) if req.get("method") == "get" else None
                if obj is None:
                    err = {"code": -32602, "message": "unknown method or object"}
                    parts = [json.dumps({"jsonrpc": "2.0", "id": req.get("id"), "error": err}).encode()]
                else:
                    # base64 needs no JSON escaping: the reply is assembled without a second copy
                    b64 = base64.b64encode(obj)
                    size = memoryview(obj).nbytes
                    head = f'{{"jsonrpc":"2.0","id":{rid},"result":{{"size":{size},"data":"'.encode()
                    parts = [head, b64, b'"}}']
                total = sum(len(p) for p in parts)
                conn.sendall(f"Content-Length: {total}\r\n\r\n".encode())
                for p in parts:
                    conn.sendall(p)
                del parts
        except (OSError, ValueError, ConnectionError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()


class JsonRpcClient:
    """A JSON-RPC 2.0 client for :class:`JsonRpcServer`."""

    def __init__(self, address: str, *, timeout_s: float = 120.0) -> None:
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(_sock_address(address))
        except OSError as exc:
            self._sock.close()
            raise ProducerGoneError(f"cannot reach the JSON-RPC server at {address}: {exc}") from None
        self._id = 0

    def call(self, method: str, params: dict[str, Any]) -> Any:
        self._id += 1
        body = json.dumps({"jsonrpc": "2.0", "id": self._id, "method": method, "params": params}).encode()
        self._sock.sendall(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        msg = _recv_message(self._sock)
        if msg is None:
            raise ProducerGoneError("the JSON-RPC server closed the connection")
        reply = json.loads(msg)
        del msg
        if "error" in reply:
            raise TransportError(f"JSON-RPC error: {reply['error']}")
        return reply["result"]

    def get(self, name: str) -> bytes:
        result = self.call("get", {"name": name})
        return base64.b64decode(result.pop("data"))

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> JsonRpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# A producer process driven by stdin (tests, benchmark)


def fill_pattern(view: memoryview, seed: int = 0) -> None:
    """Fill ``view`` with a cheap deterministic pattern (byte i = (i * 7 + seed) % 251)."""
    import numpy as np

    arr = np.frombuffer(view, dtype=np.uint8)
    block = ((np.arange(251 * 4096, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)
    n = arr.size
    for start in range(0, n, block.size):
        end = min(n, start + block.size)
        arr[start:end] = block[: end - start]
    del arr


def main(argv: list[str] | None = None) -> int:
    """``python -m aospec.specbox.transport [--backing memfd|shm] [--threshold N]``: start an
    artifact server and a JSON-RPC server, print ``ready ARTIFACT_ADDRESS RPC_ADDRESS PID``,
    then obey one command a line on stdin, answering one line each:

    - ``put SIZE [SEED]``: publish SIZE pattern bytes (:func:`fill_pattern`), also under the
      JSON-RPC name ``a<token>``; answers the ref's JSON.
    - ``release TOKEN``: drop the token reference; answers ``ok``.
    - ``stats``: the server's counts as JSON.
    - ``quit`` (or end of input): close everything and exit.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m aospec.specbox.transport")
    parser.add_argument("--backing", choices=["memfd", "shm"], default="memfd")
    parser.add_argument("--threshold", type=int, default=INLINE_THRESHOLD)
    args = parser.parse_args(argv)
    out = sys.stdout
    with (
        ArtifactServer(threshold=args.threshold, backing=args.backing) as server,
        JsonRpcServer() as rpc,
    ):
        views: dict[int, tuple[mmap.mmap, memoryview]] = {}
        print("ready", server.address, rpc.address, os.getpid(), file=out, flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            try:
                if words[0] == "put":
                    size, seed = int(words[1]), int(words[2]) if len(words) > 2 else 0
                    with server.allocate(size) as w:
                        fill_pattern(w.view, seed)
                        ref = w.publish() if size >= server.threshold else ArtifactRef(size, inline=w.view.tobytes())
                    if ref.token is not None:
                        # the JSON-RPC server serves the same memory (read-only mapping of the artifact)
                        fd = os.dup(server._entries[ref.token].fd)
                        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                        os.close(fd)
                        views[ref.token] = (mm, memoryview(mm))
                        rpc.register(f"a{_fmt_token(ref.token)}", views[ref.token][1])
                    print(json.dumps(ref.to_json()), file=out, flush=True)
                elif words[0] == "release":
                    token = _parse_token(words[1])
                    rpc.unregister(f"a{words[1]}")
                    if token in views:
                        mm, view = views.pop(token)
                        view.release()
                        mm.close()
                    server.release(token)
                    print("ok", file=out, flush=True)
                elif words[0] == "stats":
                    print(json.dumps(server.stats.__dict__), file=out, flush=True)
                elif words[0] == "quit":
                    break
                else:
                    print(json.dumps({"error": f"unknown command {words[0]!r}"}), file=out, flush=True)
            except (TransportError, ValueError, IndexError, OSError) as exc:
                print(json.dumps({"error": str(exc)}), file=out, flush=True)
        rpc.close()
        for mm, view in views.values():
            view.release()
            mm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
