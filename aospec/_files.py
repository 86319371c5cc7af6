"""File helpers shared by the packages above the engine."""

from __future__ import annotations

__all__ = ["new_file_mode"]


def new_file_mode() -> int:
    """The mode the process's umask gives a new file (0o644 under the usual umask 022):
    what a file written through a private temporary file (``tempfile.mkstemp`` makes them
    0600) should get before it is renamed into place."""
    umask = 0o022
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
                    break
    except (OSError, ValueError):
        pass
    return 0o666 & ~umask
