"""Helpers shared by the backends' state directories: ids, atomic writes, locking."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from aospec.errors import SandboxError

__all__ = ["RecoveryReport", "default_state_root", "lock_state_dir", "new_id", "private_dir", "write_atomic"]


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
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise SandboxError(f"state directory {path} is in use by another process") from None
            time.sleep(0.02)


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


def store_identity(path: Path, *, ephemeral: bool) -> str:
    """The ID of the store whose state directory ``path`` this process has locked (made on
    first use), registered as live (:func:`register_store`); an ephemeral state is marked
    ``EPHEMERAL`` so that gc deletes it once its session is gone."""
    id_file = path / "ID"
    if not id_file.exists():
        write_atomic(id_file, new_id().encode())
    store_id = id_file.read_text().strip()
    register_store(store_id, path)
    if ephemeral:
        (path / "EPHEMERAL").touch()
    return store_id


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
