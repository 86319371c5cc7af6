"""Host-side access to files inside a sandbox's root, never leaving it."""

from __future__ import annotations

import os

from aospec.runtime import _fs

from aospec.errors import SandboxError

__all__ = ["check_workdir", "read_in_root", "write_in_root"]


def check_workdir(root: str, cwd: str) -> None:
    """SandboxError unless ``cwd`` is a directory inside the sandbox rooted at ``root``."""
    try:
        fd = _fs.open_in_root(root, cwd, os.O_PATH | os.O_DIRECTORY)
    except OSError as exc:
        raise SandboxError(f"working directory {cwd!r} does not exist in the sandbox ({exc.strerror})") from None
    os.close(fd)


def read_in_root(root: str, path: str) -> bytes:
    """The content of ``path`` resolved inside ``root`` (symlinks and ``..`` included)."""
    try:
        fd = _fs.open_in_root(root, path, os.O_RDONLY)
    except OSError as exc:
        raise SandboxError(f"cannot read {path!r} in the sandbox: {exc.strerror}") from None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_in_root(root: str, path: str, data: bytes, mode: int) -> None:
    """Create or truncate ``path`` resolved inside ``root`` and write ``data``."""
    try:
        fd = _fs.open_in_root(root, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    except OSError as exc:
        raise SandboxError(f"cannot write {path!r} in the sandbox: {exc.strerror}") from None
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
    finally:
        os.close(fd)
