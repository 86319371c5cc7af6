"""Issue 20, High #3, Medium #10 and #11 and the runtime's Low items: a directory that is
not an aospec state is never taken over, the state directory is held by descriptor,
SIGTERM and SIGHUP clean up as SIGINT does, and the one-line errors and gc counts."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime._state import STORE_REGISTRY
from aospec.runtime.host import host_support

from aospec.errors import SandboxError

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


def aospec(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aospec", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
    )


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry below ``root`` with its full mode and content (or symlink target)."""
    out: dict[str, tuple[int, str]] = {".": (os.lstat(root).st_mode, "")}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath, name)
            st = p.lstat()
            body = os.readlink(p) if p.is_symlink() else p.read_text() if stat.S_ISREG(st.st_mode) else ""
            out[str(p.relative_to(root))] = (st.st_mode, body)
    return out


def _user_dir(tmp_path: Path) -> Path:
    """The issue's directory: names that collide with aospec's, and the user's files."""
    d = tmp_path / "d"
    for sub in ("l", "u", "s", "trash"):
        (d / sub).mkdir(parents=True)
        (d / sub / "notes.txt").write_text(f"user data in {sub}\n")
    (d / "b").write_text("a user file named b\n")
    (d / "report.tmp").write_text("draft\n")
    (d / "README").write_text("mine\n")
    d.chmod(0o755)
    return d


def test_exec_refuses_a_directory_that_is_not_a_state_and_never_touches_it(backend: str, tmp_path: Path) -> None:
    """Before: exit 0, everything but README deleted, b turned into a symlink, mode
    755 -> 700. Now: one line, exit 2, the directory exactly as it was."""
    d = _user_dir(tmp_path)
    before = _snapshot(d)
    proc = aospec("sandbox", "exec", "--backend", backend, "--state-dir", str(d), "--", "echo hi")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("aospec: error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is not an aospec state directory" in proc.stderr and "nothing was changed" in proc.stderr
    assert proc.stdout == ""
    assert _snapshot(d) == before


async def test_the_runtime_refuses_foreign_directories_for_every_entry_point(tmp_path: Path, overlay: str) -> None:
    """The check is in the runtime, so every caller that opens a persistent state (the
    API, ``sandbox exec --state-dir``, ``aospec mcp --state``) inherits it: a directory
    with a HEAD that aospec did not write (a bare git repository) is refused untouched;
    an empty one becomes a state; a state of the other backend is named as such."""
    git = tmp_path / "repo.git"
    (git / "refs").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    before = _snapshot(git)
    with pytest.raises(SandboxError, match="its HEAD is not one aospec wrote"):
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(git))):
            pass
    assert _snapshot(git) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(empty))) as sb:
        await sb.run("echo kept > /tmp/k")
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(empty))) as sb:
        assert (await sb.run("cat /tmp/k")).output == "kept\n"
    head = json.loads((empty / "HEAD").read_text())
    (empty / "HEAD").write_text(json.dumps({**head, "backend": "docker"}))
    with pytest.raises(SandboxError, match="state directory of the docker backend"):
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(empty))):
            pass


@pytest.mark.parametrize(
    ("state_dir", "message"),
    [("/proc/self", "is not an aospec state directory"), ("/etc/passwd", "not a directory")],
)
def test_exec_on_a_system_path_is_one_line(overlay: str, state_dir: str, message: str) -> None:
    proc = aospec("sandbox", "exec", "--state-dir", state_dir, "--", "true")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


async def test_a_state_whose_b_is_a_directory_is_one_line(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "st"
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        await sb.run("true")
    (state / "b").unlink()
    (state / "b").mkdir()
    proc = aospec("sandbox", "exec", "--state-dir", str(state), "--", "true")
    assert proc.returncode == 2 and "b is not the symlink to the base" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (state / "b").is_dir() and not mounts_under(str(state))


def test_a_backend_that_is_not_an_opener_is_one_line(overlay: str) -> None:
    proc = aospec("sandbox", "exec", "--backend", "os:system", "--", "true")
    assert proc.returncode == 2 and "sandbox backend 'os:system'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


async def test_the_state_directory_is_held_by_descriptor(overlay: str, tmp_path: Path) -> None:
    """Medium #11: the owner of the parent directory swaps the state directory for a
    symlink between commands. Before, root then wrote the session's layers and HEAD into
    the symlink's target (and the session failed leaving mounts and cgroups). Now every
    write goes to the directory that was checked and opened, the session goes on, and
    closing it leaves nothing mounted anywhere."""
    parent = tmp_path / "parent"
    parent.mkdir()
    state, moved, target = parent / "st", parent / "moved", parent / "target"
    target.mkdir()
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state), memory_layers_bytes=0)) as sb:
        await sb.run("echo one > /tmp/a")
        os.rename(state, moved)
        os.symlink(target, state)
        for i in range(3):
            fork = await sb.fork()
            await fork.run(f"echo {i} >> /tmp/a")
            await sb.commit(fork)
        await sb.run("echo two >> /tmp/a")
        assert (await sb.run("cat /tmp/a")).output == "one\n0\n1\n2\ntwo\n"
        store_id = sb.store.id
    assert list(target.iterdir()) == []
    assert not mounts_under(str(parent)) and not mounts_under(str(moved))
    assert (moved / "HEAD").is_file()
    _, cgroups = host_support()
    if cgroups is not None:
        for croot in set(cgroups.roots.values()):
            assert not list(croot.glob(f"aospec-{store_id}*"))
    os.unlink(state)
    os.rename(moved, state)
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        assert (await sb.run("cat /tmp/a")).output == "one\n0\n1\n2\ntwo\n"


async def test_a_private_state_moved_away_is_still_removed_whole(overlay: str, tmp_path: Path) -> None:
    """An ephemeral state renamed under the session: its contents go on close; only the
    now empty directory, at a name aospec no longer owns, is left for its owner."""
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        await sb.run("echo x > /tmp/x")
        path = sb.store.path
        elsewhere = path.with_name(path.name + "-moved")
        os.rename(path, elsewhere)
        os.symlink(tmp_path, path)
    assert list(elsewhere.iterdir()) == [] and list(tmp_path.iterdir()) == []
    elsewhere.rmdir()
    path.unlink()


def _cgroups_of(store_id: str) -> list[Path]:
    _, cgroups = host_support()
    if cgroups is None:
        return []
    return [cg for croot in set(cgroups.roots.values()) for cg in croot.glob(f"aospec-{store_id}*")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_termination_signals_clean_up_as_sigint_does(overlay: str, tmp_path: Path, sig: signal.Signals) -> None:
    """Medium #10: SIGTERM and SIGHUP of ``aospec sandbox exec`` left 4 mounts, 9 cgroups,
    the state directory, its registry entry and its tmpfs pages; SIGINT was clean. All
    three now cancel the command and close the session: nothing is left."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aospec", "sandbox", "exec", "--", "echo started; sleep 60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), AOSPEC_STATE_ROOT=str(root)),
    )
    deadline = time.monotonic() + 60
    states: list[Path] = []
    while time.monotonic() < deadline and not (states and mounts_under(str(states[0]))):
        states = [p for p in root.iterdir() if p.name.startswith("e-")]
        time.sleep(0.05)
    assert states, "the session never opened its state directory"
    store_id = (states[0] / "ID").read_text().strip()
    time.sleep(1.0)  # the command is running
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 128 + sig), err
    assert not mounts_under(str(root))
    assert list(root.iterdir()) == []
    assert not (STORE_REGISTRY / store_id).exists()
    assert _cgroups_of(store_id) == []


def test_the_helper_turns_a_termination_signal_into_an_interrupt() -> None:
    """The reusable helper alone: SIGTERM inside anyio.run cancels the main task (its
    finally runs) and leaves as a KeyboardInterrupt naming SIGTERM, which ``aospec`` exits 143 for."""
    code = (
        "import anyio, os, signal\nfrom aospec.signals import interrupt_on_signals, interrupting_signal\n"
        "async def main():\n"
        "    try:\n        os.kill(os.getpid(), signal.SIGTERM)\n        await anyio.sleep(30)\n"
        "    finally:\n        print('cleaned up', flush=True)\n"
        "try:\n    with interrupt_on_signals():\n        anyio.run(main)\n"
        "except KeyboardInterrupt as exc:\n    print('terminated', interrupting_signal(exc) == signal.SIGTERM)\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "cleaned up\nterminated True\nTrue\n", proc.stderr


@pytest.mark.docker
def test_gc_dry_run_counts_the_containers_gc_removes(docker_backend: str, runtime_dirs: dict[str, Path]) -> None:
    """A killed docker session: ``gc --dry-run`` reported 0 containers where ``gc`` removed
    one (the dry run saw the dead private state's HEAD and kept its container)."""
    code = (
        "import anyio\nfrom aospec.runtime import open_sandbox\n"
        "async def main():\n"
        "    async with open_sandbox(backend='docker') as sb:\n"
        "        print('READY', sb.store.path, flush=True)\n"
        "        await sb.run('sleep 600', timeout=900)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    dry = json.loads(aospec("sandbox", "gc", "--dry-run", "--format", "json").stdout)
    real = json.loads(aospec("sandbox", "gc", "--format", "json").stdout)
    assert dry["containers"] and sorted(dry["containers"]) == sorted(real["containers"])


def test_gc_removes_the_registry_links_of_dead_stores(overlay: str, runtime_dirs: dict[str, Path]) -> None:
    """A session killed with kill -9 never unregisters: gc leaves no link naming it."""
    code = (
        "import anyio\nfrom aospec.runtime import open_sandbox\n"
        "async def main():\n"
        "    async with open_sandbox(backend='overlay') as sb:\n"
        "        print('READY', sb.store.id, flush=True)\n"
        "        await sb.run('sleep 600', timeout=900)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    store_id = line.split()[1]
    assert os.path.lexists(STORE_REGISTRY / store_id)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    report = json.loads(aospec("sandbox", "gc", "--format", "json").stdout)
    assert store_id in report["registry"]
    assert not os.path.lexists(STORE_REGISTRY / store_id)
