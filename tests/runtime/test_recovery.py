"""A session killed with SIGKILL mid-operation: reopening its state directory cleans
every stale mount, fork, process, cgroup and container, and the committed version is
the one the last finished commit left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime._fs import mounts_under, unmount_all_under
from aospec.runtime.host import host_support
from aospec.runtime.processes import marked_processes

pytestmark = pytest.mark.anyio

CHILD = Path(__file__).with_name("recovery_child.py")


@pytest.fixture
def state(tmp_path: Path):
    """The killed sessions' state directory; whatever happens, nothing stays mounted."""
    path = tmp_path / "state"
    yield path
    unmount_all_under(str(path))


class Child:
    def __init__(self, backend: str, state: Path, mode: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), backend, str(state), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []

    def wait_for(self, word: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("child exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith(word):
                return
        raise AssertionError(f"no {word} within {timeout}s:\n" + "".join(self.lines))

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdout is not None
        self.lines += self.proc.stdout.readlines()
        self.proc.stdout.close()

    def last(self, word: str) -> list[str] | None:
        found = [line.split() for line in self.lines if line.startswith(word)]
        return found[-1] if found else None


def _leftover_processes(marker: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and "recovery_child" not in cmd:
            out.append(cmd)
    return out


def _aospec_cgroups(store_id: str, live: Iterable[str] = ()) -> list[str]:
    """The store's sandbox and command cgroups (nested in the store's, or flat) but those
    of the ``live`` sandboxes."""
    _, cgroups = host_support()
    if cgroups is None:
        return []
    keep = {f"aospec-{store_id}-{sid}" for sid in live}
    found = []
    for root in set(cgroups.roots.values()):
        # os.walk, not rglob: other processes' cgroups come and go meanwhile
        for dirpath, dirnames, _ in os.walk(root):
            for name in dirnames:
                p = Path(dirpath, name)
                if name.startswith(f"aospec-{store_id}-") and not keep & set(p.parts):
                    found.append(str(p))
    return found


async def test_overlay_recovers_from_sigkill_with_commands_in_flight(overlay: str, state: Path) -> None:
    child = Child(overlay, state, "inflight")
    child.wait_for("READY")
    done = child.last("DONE")
    child.kill()
    assert mounts_under(str(state)), "the killed session should have left mounts behind"
    store_id = (state / "ID").read_text().strip()
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        report = sb.store.recovery
        assert report.unmounted and report.sandboxes and not report.clean
        assert sb.version == done[2]
        out = await sb.run("cat /tmp/counter; ls /tmp")
        assert out.output == "2\ncounter\nd0\nd1\nd2\n"  # neither /tmp/fork nor /tmp/partial
        assert not _leftover_processes("sleep 98")
        assert not marked_processes(f"aospec-{store_id}-")
        assert not _aospec_cgroups(store_id, sb.store.live)
    assert not mounts_under(str(state))


@pytest.mark.slow
async def test_overlay_recovers_from_sigkill_at_random_moments(overlay: str, state: Path) -> None:
    rng = random.Random(4)
    for _ in range(3):
        child = Child(overlay, state, "loop")
        child.wait_for("DONE")
        time.sleep(rng.uniform(0.05, 0.6))
        child.kill()
        done, begun = child.last("DONE"), child.last("BEGIN")
        store_id = (state / "ID").read_text().strip()
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
            assert not marked_processes(f"aospec-{store_id}-")
            # the commit in progress either happened entirely or not at all
            assert sb.version in (done[2], begun[2])
            expected = done[1] if sb.version == done[2] else begun[1]
            assert (await sb.run("cat /tmp/counter")).output == f"{expected}\n"
        assert not mounts_under(str(state))


@pytest.mark.docker
@pytest.mark.slow
async def test_docker_recovers_from_sigkill_with_commands_in_flight(docker_backend: str, state: Path) -> None:
    from aospec.runtime.daemon import docker_client

    child = Child(docker_backend, state, "inflight")
    child.wait_for("READY", timeout=300)
    done = child.last("DONE")
    child.kill()
    store_id = (state / "ID").read_text().strip()
    client = docker_client()
    assert len(client.containers.list(all=True, filters={"label": f"aospec.store={store_id}"})) == 2
    try:
        async with open_sandbox(SandboxConfig(backend=docker_backend, state_dir=str(state))) as sb:
            report = sb.store.recovery
            assert len(report.containers) == 1  # the fork
            # the committed container was running a command that wrote /tmp/partial: a
            # container cannot be rolled back, so the version moves to describe it
            assert "interrupted" in report.note
            assert sb.version != done[2]
            assert (await sb.run("cat /tmp/counter /tmp/partial")).output == "2\npartial\n"
            assert not _leftover_processes("sleep 98")
            fork = await sb.fork()
            assert fork.version == sb.version
            await fork.discard()
    finally:
        for c in client.containers.list(all=True, filters={"label": f"aospec.store={store_id}"}):
            c.remove(force=True)
    assert not mounts_under(str(state))


def test_kill_all_marked_leaves_no_marked_process_even_one_forked_during_the_scan() -> None:
    # a marked shell that forks children as fast as it can: one scan-and-kill pass can
    # miss a child forked after the scan; recovery must leave none
    from aospec.runtime.processes import MARKER_ENV, kill_all_marked

    marker = f"aospec-killtest{os.getpid()}-x"
    env = dict(os.environ, **{MARKER_ENV: marker})
    proc = subprocess.Popen(["bash", "-c", "while :; do sleep 30 & done"], env=env)
    try:
        deadline = time.monotonic() + 10
        while len(marked_processes(marker)) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        killed = kill_all_marked(marker)
        assert proc.pid in killed
        assert not marked_processes(marker)
    finally:
        proc.kill()
        proc.wait()
        kill_all_marked(marker)
