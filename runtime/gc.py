"""Cleaning up after sessions that died without closing (``aospec sandbox gc``).

A state directory whose lock no live process holds is stale. A private (ephemeral) one
is deleted with its mounts, cgroups and containers; a persistent one keeps its committed
state (HEAD and its layers/container) and loses only its mounts and cgroups; the rest
is recovered when it is next opened.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from aospec.runtime import _fs
from aospec.runtime._state import STORE_REGISTRY, default_state_root, state_dir_in_use, store_alive
from aospec.runtime.cgroups import POOL, thaw_process
from aospec.runtime.host import host_support
from aospec.runtime.processes import MARKER_ENV, OWNER_ENV, live_owner_tokens, process_environments

__all__ = ["GcReport", "collect_garbage"]


@dataclass(slots=True)
class GcReport:
    """What ``collect_garbage`` removed (or would remove, on a dry run)."""

    state_dirs: list[str] = field(default_factory=list)
    unmounted: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    registry: list[str] = field(default_factory=list)
    skipped_in_use: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, list[str]]:
        return {
            "state_dirs": self.state_dirs,
            "unmounted": self.unmounted,
            "cgroups": self.cgroups,
            "processes": self.processes,
            "containers": self.containers,
            "registry": self.registry,
            "skipped_in_use": self.skipped_in_use,
        }


def collect_garbage(state_root: Path | None = None, *, dry_run: bool = False, docker: bool = True) -> GcReport:
    """Clean stale state directories under ``state_root`` (default: default_state_root())."""
    root = state_root or default_state_root()
    report = GcReport()
    stale_ids: set[str] = set()
    live_ids: set[str] = set()
    gone_dirs: set[str] = set()  # ephemeral state dirs this gc removes (or would, dry-run)
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if not d.is_dir() or not (d / "lock").exists():
                continue
            sid = (d / "ID").read_text().strip() if (d / "ID").exists() else ""
            if state_dir_in_use(d):
                report.skipped_in_use.append(str(d))
                live_ids.add(sid)
                continue
            stale_ids.add(sid)
            points = _fs.mounts_under(str(d))
            report.unmounted += points
            ephemeral = (d / "EPHEMERAL").exists()
            if ephemeral:
                report.state_dirs.append(str(d))
                gone_dirs.add(str(d))
            if dry_run:
                continue
            _fs.unmount_all_under(str(d))
            if ephemeral:
                _fs.remove_tree(d)
    report.processes += _kill_orphans(live_ids, dry_run=dry_run)
    _, cgroups = host_support()
    if cgroups is not None:
        for croot in set(cgroups.roots.values()):
            # a store's cgroup (aospec-STORE, its sandboxes' nested in it), one of an
            # older aospec (aospec-STORE-SANDBOX-N, flat), or a background command's in the
            # host's speculation pool (speculation/aospec-STORE-SANDBOX-N)
            for cg in [*croot.glob("aospec-*"), *(croot / POOL).glob("aospec-*")]:
                store_id = cg.name.split("-")[1]
                if store_id in live_ids:
                    continue
                alive = store_alive(store_id)
                if alive:
                    # open under another state root: its cgroup is in use even between
                    # commands (a command starting while gc removed it would be killed)
                    continue
                if (
                    alive is None
                    and store_id not in stale_ids
                    and (_store_id_known(root, store_id) or _has_processes(cg))
                ):
                    # a store under another state root may be alive: its session cgroup
                    # carries its memory budget between commands, and a running command
                    # must never be killed. Only an empty cgroup of an unknown store goes
                    # (a crashed session's, whose orphans were killed above).
                    continue
                report.cgroups.append(str(cg))
                if not dry_run:
                    cgroups.remove(str(cg.relative_to(croot)))
    if docker:
        report.containers += _gc_containers(live_ids, gone_dirs, dry_run=dry_run)
    report.registry += _gc_registry(dry_run=dry_run)
    return report


def _gc_registry(*, dry_run: bool) -> list[str]:
    """Registry links of stores no live process holds (a session killed before it could
    unregister), and temporary links of processes that are gone."""
    removed = []
    with contextlib.suppress(OSError):
        for link in sorted(STORE_REGISTRY.iterdir()):
            if link.name.startswith("."):
                pid = link.name.rpartition(".")[2]
                stale = not pid.isdigit() or not Path(f"/proc/{pid}").exists()
            else:
                stale = store_alive(link.name) is False
            if stale:
                removed.append(link.name)
                if not dry_run:
                    link.unlink(missing_ok=True)
    return removed


def _kill_orphans(live_ids: set[str], *, dry_run: bool) -> list[int]:
    """Sandbox processes (marked by their environment) whose owning session is gone:
    the process that started them (identified by a hash of its PID and start time) no
    longer runs."""
    found = []
    needle = f"{MARKER_ENV}=aospec-".encode()
    owner_key = f"{OWNER_ENV}=".encode()
    live_tokens: set[str] | None = None
    for pid, env in process_environments():
        marks = [item for item in env if item.startswith(needle)]
        if not marks:
            continue
        store_id = marks[0][len(needle) :].split(b"-")[0].decode(errors="replace")
        owners = [item[len(owner_key) :].decode(errors="replace") for item in env if item.startswith(owner_key)]
        owner = owners[0] if owners else ""
        if live_tokens is None:
            live_tokens = live_owner_tokens()
        owner_alive = owner in live_tokens
        if store_id in live_ids or owner_alive:
            continue
        found.append(pid)
        if not dry_run:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                thaw_process(pid)  # a paused sandbox's processes die only once thawed
    return found


def _has_processes(cg: Path) -> bool:
    """Whether any process is in cgroup directory ``cg`` or below it."""
    for procs in (cg, *cg.rglob("*/")):
        with contextlib.suppress(OSError):
            if (procs / "cgroup.procs").read_text().strip():
                return True
    return False


def _store_id_known(root: Path, store_id: str) -> bool:
    if not root.is_dir():
        return False
    for d in root.iterdir():
        with contextlib.suppress(OSError):
            if (d / "ID").read_text().strip() == store_id:
                return True
    return False


def _gc_containers(live_ids: set[str], gone_dirs: set[str], *, dry_run: bool) -> list[str]:
    """Containers of ephemeral stores whose owner is gone (persistent HEAD containers are
    kept); ``gone_dirs`` are the ephemeral state directories this gc removes (a dry run
    leaves them, and must still count their containers)."""
    try:
        from aospec.runtime.daemon import docker_client

        client = docker_client()
    except Exception:
        return []
    removed = []
    try:
        _remove_stale_containers(client, live_ids, gone_dirs, removed, dry_run=dry_run)
    finally:
        client.close()
    return removed


def _remove_stale_containers(
    client: object, live_ids: set[str], gone_dirs: set[str], removed: list[str], *, dry_run: bool
) -> None:
    # ignore_removed: a container listed and then removed (by its own session) before it is
    # inspected is not an error
    for c in client.containers.list(all=True, filters={"label": "aospec.store"}, ignore_removed=True):  # type: ignore[attr-defined]
        labels = c.labels or {}
        store_id = labels.get("aospec.store", "")
        state_dir = Path(labels.get("aospec.state_dir", "/nonexistent"))
        if store_id in live_ids:
            continue
        if state_dir.exists() and state_dir_in_use(state_dir):
            continue
        head = state_dir / "HEAD"
        if str(state_dir) not in gone_dirs and head.exists() and c.id in head.read_text():
            continue  # the committed container of a persistent store
        removed.append(c.id[:12])
        if not dry_run:
            with contextlib.suppress(Exception):
                c.remove(force=True, v=True)
