"""Helpers shared by the backends' state directories: ids, atomic writes, locking."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from aospec.errors import SandboxError

__all__ = [
    "STATE_NAMES",
    "RecoveryReport",
    "StateDir",
    "check_state_entries",
    "default_state_root",
    "lock_state_dir",
    "new_id",
    "private_dir",
    "write_atomic",
]


def new_id() -> str:
    return secrets.token_hex(4)


def default_state_root() -> Path:
    """Where private state directories are made: ``$AOSPEC_STATE_ROOT`` or /var/tmp/aospec."""
    return Path(os.environ.get("AOSPEC_STATE_ROOT", "/var/tmp/aospec"))


def private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700, parents as needed) or check the existing one: it must be
    a real directory owned by this user, and its mode is set to 0700. Sandboxes write as
    root, so what lies below a state directory must be out of other host users' reach;
    a directory someone else owns could be swapped under us, so it is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"{path} is not a directory (a symlink or file is there); remove it or choose another path")
    if st.st_uid != os.geteuid():
        raise SandboxError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): another user could "
            "change what the sandboxes see; remove it or choose another state directory"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening a state directory cleaned up after an unclean exit."""

    unmounted: tuple[str, ...] = ()
    sandboxes: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()
    containers: tuple[str, ...] = ()
    note: str = ""
    processes: tuple[int, ...] = ()

    @property
    def clean(self) -> bool:
        return not (
            self.unmounted or self.sandboxes or self.layers or self.cgroups or self.containers or self.processes
        )


def write_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Replace ``path`` by ``data`` atomically (write a sibling, rename over)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def lock_state_dir(path: Path, *, wait_s: float = 3.0) -> int:
    """Take the state directory's exclusive lock (held while the fd is open). A process
    that was just killed can hold it for a moment while the kernel tears it down, so
    this waits up to ``wait_s`` before saying the directory is in use. The directory (and
    the default state root above it) is made private first (:func:`private_dir`)."""
    if path.parent == default_state_root():
        private_dir(path.parent)
    private_dir(path)
    return _take_lock(path, path, wait_s)


def _take_lock(directory: Path, shown: Path, wait_s: float) -> int:
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise SandboxError(f"state directory {shown} is in use by another process") from None
            time.sleep(0.02)


#: What aospec itself puts in a state directory (both backends). A directory holding
#: anything else and no HEAD is not a state: it is refused, never taken over.
STATE_NAMES = frozenset({"HEAD", "HEAD.tmp", "ID", "ID.tmp", "EPHEMERAL", "lock", "b", "l", "ml", "s", "u", "trash"})


def check_state_entries(dir_fd: int, shown: Path, backend: str) -> None:
    """SandboxError unless the directory ``dir_fd`` is empty, holds an aospec state of
    ``backend`` (a HEAD that aospec wrote), or holds only what aospec makes before its
    first HEAD (``lock`` among it: a session that died while opening it, or one opening
    it now, which its lock then tells).
    Nothing is changed; the error names the directory and the fix."""
    names = set(os.listdir(dir_fd))
    if not names:
        return
    if "HEAD" not in names:
        if "lock" in names and names <= STATE_NAMES:
            return  # aospec's own, opened by a session that died (or is opening it now)
        raise SandboxError(
            f"{shown} is not an aospec state directory (it has no HEAD) and is not empty: refusing to use it, "
            "nothing was changed; give a new or empty directory as the state directory"
        )
    try:
        fd = os.open("HEAD", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise SandboxError(f"{shown}/HEAD cannot be read ({exc.strerror}): not an aospec state directory") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxError(f"{shown}/HEAD is not a regular file: not an aospec state directory")
        with open(fd, "rb", closefd=False) as f:
            data = json.loads(f.read())
    except ValueError:
        data = None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not {"version", "base_version"} <= set(data):
        raise SandboxError(
            f"{shown} is not an aospec state directory (its HEAD is not one aospec wrote): refusing to use it, "
            "nothing was changed; give a new or empty directory as the state directory"
        )
    found = str(data.get("backend", "overlay"))
    if found != backend:
        raise SandboxError(f"{shown} is a state directory of the {found} backend, not of {backend}: open it with that backend")


class StateDir:
    """A state directory held by descriptor for a session's life.

    Opening checks it (a directory owned by this user, not a symlink, and empty or an
    aospec state: :func:`check_state_entries`) before changing anything, makes it 0700
    and takes its lock. Every later operation goes through :attr:`dir`, a
    ``/proc/PID/fd/N`` name of the held descriptor: whoever owns the parent directory
    may rename the state directory or put a symlink in its place between two commands,
    and root's writes still land in the directory that was checked (a path would be
    re-resolved on every operation). :attr:`path` is the name it was opened by (for
    messages and the store registry)."""

    def __init__(self, path: Path, *, backend: str, wait_s: float = 3.0) -> None:
        self.path = path
        self.fd = -1
        self.lock_fd = -1
        if path.parent == default_state_root():
            private_dir(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        created = False
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            created = True
        try:
            self.fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise SandboxError(
                    f"{path} is not a directory (a symlink or file is there); remove it or choose another path"
                ) from None
            raise SandboxError(f"cannot open the state directory {path}: {exc.strerror}") from None
        try:
            self.dir = Path(f"/proc/{os.getpid()}/fd/{self.fd}")
            st = os.fstat(self.fd)
            if st.st_uid != os.geteuid():
                raise SandboxError(
                    f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): another user could "
                    "change what the sandboxes see; remove it or choose another state directory"
                )
            if not created:
                try:
                    listing = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError as exc:
                    raise SandboxError(f"cannot read the state directory {path}: {exc.strerror}") from None
                try:
                    check_state_entries(listing, path, backend)
                finally:
                    os.close(listing)
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(self.dir, 0o700)
            self.lock_fd = _take_lock(self.dir, path, wait_s)
        except BaseException:
            self.close()
            raise

    def moved(self) -> bool:
        """Whether :attr:`path` no longer names the held directory (renamed, replaced)."""
        try:
            a, b = os.lstat(self.path), os.fstat(self.fd)
        except OSError:
            return True
        return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino)

    def remove(self) -> None:
        """Delete everything in the held directory, then its name where that still is
        the held directory (a private state). Refuses while anything is mounted below."""
        from aospec.runtime import _fs

        left = _fs.mounts_under(str(self.dir))
        if left:
            raise SandboxError(f"cannot delete {self.path}: still mounted below it: {left[:3]}")
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _fs.clear_dir(dfd)
        finally:
            os.close(dfd)
        if not self.moved():
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def close(self) -> None:
        """Drop the lock and the descriptor."""
        for name in ("lock_fd", "fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


#: Where each open store names its state directory (``STORE_ID -> path``), so that gc of
#: one state root can tell a live store under another root (its lock is held) from a
#: crashed one without knowing that root. Root only; elsewhere nothing is registered.
STORE_REGISTRY = Path("/run/aospec/stores")


def register_store(store_id: str, state_dir: Path) -> None:
    """Name ``state_dir`` as the live store ``store_id``'s (best effort)."""
    with contextlib.suppress(OSError):
        STORE_REGISTRY.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = STORE_REGISTRY / f".{store_id}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        os.symlink(str(state_dir), tmp)
        os.replace(tmp, STORE_REGISTRY / store_id)


def unregister_store(store_id: str) -> None:
    with contextlib.suppress(OSError):
        (STORE_REGISTRY / store_id).unlink()


def store_identity(state: StateDir, *, ephemeral: bool) -> str:
    """The ID of the store whose state directory ``state`` this process has locked (made
    on first use), registered as live (:func:`register_store`); an ephemeral state is
    marked ``EPHEMERAL`` so that gc deletes it once its session is gone."""
    id_file = state.dir / "ID"
    if not id_file.exists():
        write_atomic(id_file, new_id().encode())
    store_id = id_file.read_text().strip()
    if not _ID.fullmatch(store_id):
        raise SandboxError(f"{state.path}/ID is not a store id aospec wrote ({store_id[:40]!r}); the state directory is damaged")
    register_store(store_id, state.path)
    if ephemeral:
        (state.dir / "EPHEMERAL").touch()
    return store_id


_ID = re.compile(r"[0-9a-f]{8}")


def store_alive(store_id: str) -> bool | None:
    """Whether the store ``store_id`` is open in a live process: True/False from its
    registered state directory's lock (and ID), None when it never registered."""
    try:
        target = Path(os.readlink(STORE_REGISTRY / store_id))
    except OSError:
        return None
    try:
        if (target / "ID").read_text().strip() != store_id:
            return False
    except OSError:
        return False
    return state_dir_in_use(target)


def state_dir_in_use(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
