"""What this host can do for the overlay backend: root, overlayfs, bubblewrap, writable
cgroups (probed once per process)."""

from __future__ import annotations

import os
import shutil
import threading
from dataclasses import dataclass

from aospec.runtime.cgroups import Cgroups
from aospec.runtime.config import Limits

__all__ = ["HostSupport", "host_support"]


@dataclass(frozen=True, slots=True)
class HostSupport:
    """What this host can do for the overlay backend (``aospec sandbox info``)."""

    root: bool
    overlayfs: bool
    bwrap: str | None
    cgroup_version: int | None
    cgroup_controllers: tuple[str, ...]
    can_mount: bool = True

    def problems(self) -> list[str]:
        out = []
        if not self.root:
            out.append("the overlay backend needs root (mounting overlayfs); run as root or use --backend docker")
        elif not self.can_mount:
            out.append("mounting is not permitted here (an unprivileged container?); run with CAP_SYS_ADMIN")
        if not self.overlayfs:
            out.append("the kernel has no overlayfs (modprobe overlay)")
        if not self.bwrap:
            out.append("bubblewrap is not installed (apt-get install bubblewrap)")
        return out

    def unenforced(self, limits: Limits, memory_budget_bytes: int | None = None) -> list[str]:
        """The limits (and the session memory budget) this host cannot enforce."""
        missing = []
        have = set(self.cgroup_controllers)
        if memory_budget_bytes is not None and "memory" not in have:
            missing.append("memory budget (no writable memory cgroup: host memory held by sandboxes is not bounded)")
        if limits.pids is not None and "pids" not in have:
            missing.append("pids")
        if limits.memory_bytes is not None and "memory" not in have:
            missing.append("memory (RLIMIT_AS used instead)")
        if limits.cpus is not None and "cpu" not in have:
            missing.append("cpus")
        return missing


def _can_mount() -> bool:
    import tempfile

    from aospec.runtime import _fs

    d = tempfile.mkdtemp(prefix="aospec-probe-")
    try:
        _fs.mount("tmpfs", d, "tmpfs", 0, "size=64k")
    except OSError:
        return False
    else:
        _fs.umount(d)
        return True
    finally:
        os.rmdir(d)


_support: HostSupport | None = None
_cgroups: Cgroups | None = None
_support_lock = threading.Lock()


def host_support() -> tuple[HostSupport, Cgroups | None]:
    """Probe the host once per process."""
    global _support, _cgroups
    with _support_lock:
        if _support is None:
            with open("/proc/filesystems") as f:
                overlay = any(line.split()[-1] == "overlay" for line in f if line.strip())
            is_root = os.geteuid() == 0
            cg = Cgroups.detect() if is_root else None
            bwrap = shutil.which("bwrap")
            _cgroups = cg
            _support = HostSupport(
                root=is_root,
                overlayfs=overlay,
                bwrap=bwrap,
                cgroup_version=cg.version if cg else None,
                cgroup_controllers=cg.controllers if cg else (),
                can_mount=is_root and _can_mount(),
            )
        return _support, _cgroups
