"""Host-side access to files inside a sandbox's root, never leaving it.

Every open is non-blocking and checked on the descriptor before any byte moves: a FIFO,
socket or device is refused at once (a blocking open or read of a FIFO would hang the
caller, and with it every later call of the session), and a size limit is checked with
``fstat`` before anything is read."""

from __future__ import annotations

import errno
import os
import stat

from aospec.runtime import _fs

from aospec.errors import FileTooLargeError, SandboxError

__all__ = ["check_path", "check_workdir", "read_in_root", "write_in_root"]

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symlink",
}


def check_path(path: str, what: str = "path") -> None:
    """SandboxError when ``path`` holds a NUL byte: the kernel would read it only up to
    the NUL (``/etc/passwd\\0x`` names ``/etc/passwd``), a silent change of meaning."""
    if "\0" in path:
        raise SandboxError(f"{what} {path!r} contains a NUL byte; no path can")


def check_workdir(root: str, cwd: str) -> None:
    """SandboxError unless ``cwd`` is a directory inside the sandbox rooted at ``root``."""
    check_path(cwd, "working directory")
    try:
        fd = _fs.open_in_root(root, cwd, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise SandboxError(f"working directory {cwd!r} does not exist in the sandbox ({exc.strerror})") from None
    os.close(fd)


def _open_regular(root: str, path: str, flags: int, mode: int, verb: str) -> tuple[int, os.stat_result]:
    """Open ``path`` inside ``root`` without blocking and return it with its fstat;
    SandboxError (descriptor closed) unless it is a regular file."""
    check_path(path)
    try:
        fd = _fs.open_in_root(root, path, flags | os.O_NONBLOCK | os.O_NOCTTY, mode)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO nobody reads (O_WRONLY|O_NONBLOCK)
            raise SandboxError(f"cannot {verb} {path!r} in the sandbox: it is not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise SandboxError(f"cannot {verb} {path!r} in the sandbox: it is a directory, not a regular file") from None
        raise SandboxError(f"cannot {verb} {path!r} in the sandbox: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise SandboxError(f"cannot {verb} {path!r} in the sandbox: it is {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_in_root(root: str, path: str, max_bytes: int | None = None) -> bytes:
    """The content of the regular file ``path`` resolved inside ``root`` (symlinks and
    ``..`` included). With ``max_bytes``, a larger file is refused (FileTooLargeError)
    from its ``fstat``, before anything is read; a file growing while it is read is
    refused too (at most ``max_bytes + 1`` bytes are ever read)."""
    fd, st = _open_regular(root, path, os.O_RDONLY, 0, "read")
    try:
        if max_bytes is not None and st.st_size > max_bytes:
            raise FileTooLargeError(path, st.st_size, max_bytes)
        want = None if max_bytes is None else max_bytes + 1
        chunks = []
        got = 0
        while want is None or got < want:
            chunk = os.read(fd, 1 << 20 if want is None else min(1 << 20, want - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if max_bytes is not None and got > max_bytes:
            raise FileTooLargeError(path, got, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_in_root(root: str, path: str, data: bytes, mode: int) -> None:
    """Create or truncate the regular file ``path`` resolved inside ``root`` and write
    ``data`` (truncated only once it is known to be a regular file)."""
    fd, _ = _open_regular(root, path, os.O_WRONLY | os.O_CREAT, mode, "write")
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
