"""Issue 9, runtime items 1, 3 and 4: what a sandbox writes gives no host user privilege
(private state directories, nosuid/nodev mounts), a reopened state is verified against its
version, sockets survive every copy, and a busy unmount never fails a run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from aospec.runtime import Limits, SandboxConfig, _fs, default_state_root, open_sandbox
from aospec.runtime.bases import cache_dir
from aospec.runtime.overlay import verify_state_dir

from aospec.errors import SandboxError

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _mount_options(prefix: Path) -> dict[str, set[str]]:
    """Per-mount options of every mount at or below ``prefix``."""
    found = {}
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            point = fields[4]
            if point == str(prefix) or point.startswith(f"{prefix}/"):
                found[point] = set(fields[5].split(","))
    return found


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True, text=True, timeout=30)


@pytest.fixture
def open_state_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state root whose parents every host user can traverse (/var/tmp), unlike the
    session's (under pytest's private tmp)."""
    top = Path(tempfile.mkdtemp(prefix="aospec-h1-", dir="/var/tmp"))
    os.chmod(top, 0o755)  # only aospec's own modes keep other users out
    root = top / "state"
    monkeypatch.setenv("AOSPEC_STATE_ROOT", str(root))
    yield root
    leaked = _fs.mounts_under(str(root.parent))
    _fs.unmount_all_under(str(root.parent))
    _fs.remove_tree(root.parent)
    assert not leaked


# -- item 1: private state directories, nosuid/nodev ------------------------------------------


async def test_the_state_root_and_every_state_dir_are_private(overlay: str, tmp_path: Path) -> None:
    os.chmod(default_state_root(), 0o755)  # left open by an older aospec: fixed on open
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        assert os.stat(default_state_root()).st_mode & 0o777 == 0o700
        assert os.stat(sb.store.path).st_mode & 0o777 == 0o700
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
        assert state.stat().st_mode & 0o777 == 0o700
    os.chmod(state, 0o777)
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
        assert state.stat().st_mode & 0o777 == 0o700


async def test_a_state_dir_owned_by_another_user_is_refused(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "theirs"
    state.mkdir(mode=0o700)
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(SandboxError, match=f"owned by uid {NOBODY}, not by this user .*choose another state"):
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
            pass
    assert not (state / "lock").exists()
    link = tmp_path / "link-root"
    link.symlink_to(state)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AOSPEC_STATE_ROOT", str(link))
        with pytest.raises(SandboxError, match="is not a directory"):
            async with open_sandbox(SandboxConfig(backend=overlay)):
                pass


async def test_every_mount_the_overlay_backend_makes_is_nosuid_and_nodev(overlay: str) -> None:
    # memory layers, their compaction into a new memory layer, lower views, live forks
    async with open_sandbox(SandboxConfig(backend=overlay, compact_at=4)) as sb:
        for i in range(8):
            fork = await sb.fork()
            await fork.run(f"echo {i} > /tmp/f{i}")
            await sb.commit(fork)
        live = [await sb.fork() for _ in range(2)]
        for i, fork in enumerate(live):
            await fork.run(f"echo {i} > /tmp/live; ls /tmp")
        await sb.run("echo root > /tmp/root")
        assert sb.store.compactions >= 1
        mounts = _mount_options(sb.store.path)
        kinds = {p.removeprefix(str(sb.store.path)).split("/")[1] for p in mounts}
        assert {"s", "ml"} <= kinds
        assert any(p.endswith("/m") for p in mounts) and any("/lv-" in p for p in mounts)
        assert any("/ml/m" in p and "ro" in o for p, o in mounts.items())  # remounted read-only
        assert {p: o for p, o in mounts.items() if not {"nosuid", "nodev"} <= o} == {}
        for fork in live:
            await fork.discard()
    # layers and uppers on disk
    async with open_sandbox(SandboxConfig(backend=overlay, memory_layers_bytes=0)) as sb:
        fork = await sb.fork()
        await fork.run("echo x > /tmp/x")
        mounts = _mount_options(sb.store.path)
        assert mounts and {p: o for p, o in mounts.items() if not {"nosuid", "nodev"} <= o} == {}
        await sb.commit(fork)


async def test_a_setuid_file_written_in_a_sandbox_gives_host_users_no_root(overlay: str, open_state_root: Path) -> None:
    # the reproduction: with all defaults, a setuid-root bash written in the sandbox
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        result = await sb.run("cp /bin/bash /tmp/sbash; chmod 4755 /tmp/sbash")
        assert result.returncode == 0, result.output
        # in the memory layer it froze into, and in the mounted root
        in_layer = Path(sb.store.shown(str(sb.store.layer_dir(sb.store.head_layers[0])))) / "tmp/sbash"
        merged = sb.root_path / "tmp/sbash"
        await sb.run("true")  # (re)mounts the merged root
        for copy in (in_layer, merged):
            assert os.stat(copy).st_mode & 0o4777 == 0o4755 and os.stat(copy).st_uid == 0
            # nobody cannot even reach it
            denied = _as_nobody(str(copy), "-p", "-c", "id -u")
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
        # opened up on purpose, every directory on the way: the mount is nosuid
        opened = []
        d = merged.parent
        while d != open_state_root.parent.parent:
            opened.append((d, os.stat(d).st_mode & 0o7777))
            os.chmod(d, os.stat(d).st_mode | 0o005)
            d = d.parent
        try:
            ran = _as_nobody(str(merged), "-p", "-c", "id -u")
            assert (ran.returncode, ran.stdout) == (0, f"{NOBODY}\n"), ran
        finally:
            for d, mode in reversed(opened):
                os.chmod(d, mode)
    # durable: the layer is on disk, in the private state directory
    state = open_state_root / "durable"
    async with open_sandbox(SandboxConfig(backend=overlay, durable=True, state_dir=str(state))) as sb:
        await sb.run("cp /bin/bash /tmp/sbash; chmod 4755 /tmp/sbash")
        layer = Path(sb.store.shown(str(sb.store.layer_dir(sb.store.head_layers[0]))))
    assert os.stat(layer / "tmp/sbash").st_mode & 0o4000
    denied = _as_nobody(str(layer / "tmp/sbash"), "-p", "-c", "id -u")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def test_the_base_cache_is_private() -> None:
    from aospec.runtime.bases import open_base

    bases = cache_dir() / "bases"
    open_base("busybox")
    os.chmod(bases, 0o755)
    base = open_base("busybox")
    assert os.stat(bases).st_mode & 0o777 == 0o700
    assert base.path.parent.parent == bases


# -- item 1: a reopened state is verified -----------------------------------------------------


async def _persistent_state(overlay: str, state: Path) -> str:
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        await sb.run("mkdir -p /work; echo hi > /work/a; chmod 1777 /work")
        fork = await sb.fork()
        await fork.run("echo there > /work/b; rm /etc/profile")
        await sb.commit(fork)
        return sb.version


async def test_a_file_planted_in_a_closed_state_makes_the_reopen_refuse(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    version = await _persistent_state(overlay, state)
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        assert sb.version == version  # untouched: reopens
        assert (await sb.run("cat /work/a /work/b")).output == "hi\nthere\n"
    head = json.loads((state / "HEAD").read_text())
    assert [lid for lid in head["layers"] if not lid.startswith("m")] == head["layers"]
    # the reproduction: a host user drops a file into the layer's world-writable directory
    (layer,) = [state / "l" / lid for lid in head["layers"] if (state / "l" / lid / "work").is_dir()]
    (layer / "work/planted").write_text("surprise\n")
    with pytest.raises(SandboxError, match=rf"{state} no longer holds the state its version {version} names") as err:
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
            pass
    assert "/work/planted" in str(err.value) and "use a new state dir" in str(err.value)
    (layer / "work/planted").unlink()
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))) as sb:
        assert sb.version == version
    os.chmod(layer / "work/a", 0o4755)  # a changed mode is a change too
    with pytest.raises(SandboxError, match="was modified on disk"):
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
            pass


async def test_a_state_without_content_digests_is_refused(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    await _persistent_state(overlay, state)
    head = json.loads((state / "HEAD").read_text())
    del head["digests"]
    (state / "HEAD").write_text(json.dumps(head))
    with pytest.raises(SandboxError, match="has no recorded content digest"):
        async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
            pass


def _verify_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", "verify", *args], capture_output=True, text=True, env=env, timeout=60
    )


async def test_sandbox_verify_on_good_and_tampered_states(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    version = await _persistent_state(overlay, state)
    ok = _verify_cli(str(state))
    assert (ok.returncode, ok.stdout) == (0, f"ok {version}\n"), ok
    data = json.loads(_verify_cli("--format", "json", str(state)).stdout)
    assert (data["ok"], data["version"], data["problems"]) == (True, version, [])
    head = json.loads((state / "HEAD").read_text())
    lid = next(lid for lid in head["layers"] if (state / "l" / lid / "work/a").exists())
    (state / "l" / lid / "work/a").write_text("HI\n")
    bad = _verify_cli(str(state))
    assert bad.returncode == 1 and f"layer l/{lid} was modified on disk" in bad.stdout and "/work/a" in bad.stdout
    data = json.loads(_verify_cli("--format", "json", str(state)).stdout)
    assert data["ok"] is False and len(data["problems"]) == 1
    assert verify_state_dir(state).problems == tuple(data["problems"])
    not_state = _verify_cli(str(tmp_path))
    assert not_state.returncode == 2 and "is not an overlay state directory" in not_state.stderr


async def test_sandbox_verify_refuses_a_state_in_use(overlay: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with open_sandbox(SandboxConfig(backend=overlay, state_dir=str(state))):
        busy = _verify_cli(str(state))
    assert busy.returncode == 2 and "in use by another process" in busy.stderr


# -- item 3: sockets survive every copy -------------------------------------------------------


def _bind(path: Path) -> None:
    """A program binds a Unix socket at ``path`` (through the sandbox's root) and exits.
    (Bound through the directory's descriptor: a socket path must fit in 108 bytes.)"""
    dfd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(f"/proc/self/fd/{dfd}/{path.name}")
    finally:
        s.close()
        os.close(dfd)


CONFIGS = {
    "durable": {"durable": True},
    "disk-layers": {"memory_layers_bytes": 0},
    "compacting": {"compact_at": 4},
    "upper-on-disk": {"limits": Limits(disk_bytes=None)},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
async def test_a_socket_is_in_the_state_when_it_is_in_the_version(overlay: str, tmp_path: Path, config: str) -> None:
    cfg = SandboxConfig(backend=overlay, state_dir=str(tmp_path / "state"), **CONFIGS[config])
    async with open_sandbox(cfg) as sb:
        await sb.run("true")
        f = await sb.fork()
        _bind(f.root_path / "tmp/s")
        await f.run("true")
        f2 = await f.fork()
        _bind(sb.root_path / "tmp/s")
        await sb.run("true")
        assert sb.version == f.version == f2.version
        for other in range(6):  # commits and compactions copy the layer around
            g = await sb.fork()
            await g.run(f"echo {other} > /tmp/o{other}")
            await sb.commit(g)
        for box in (sb, f2):
            assert (await box.run("test -S /tmp/s && stat -c %A /tmp/s")).output.startswith("s")
        version = sb.version
        await f.discard()
        await f2.discard()
    async with open_sandbox(cfg) as sb:
        assert sb.version == version
        assert (await sb.run("test -S /tmp/s")).returncode == 0


def test_copy_tree_copies_sockets(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _bind(src / "s")
    os.chmod(src / "s", 0o640)
    _fs.copy_tree(src, dst)
    st = os.lstat(dst / "s")
    assert (oct(st.st_mode), st.st_uid) == (oct(os.lstat(src / "s").st_mode), 0)
    _fs.copy_entry(src / "s", tmp_path / "one")
    assert os.lstat(tmp_path / "one").st_mode == os.lstat(src / "s").st_mode


# -- item 4: a busy unmount never fails a run --------------------------------------------------


def test_a_busy_unmount_detaches_instead_of_failing(tmp_path: Path) -> None:
    point = tmp_path / "busy"
    point.mkdir()
    _fs.mount("tmpfs", str(point), "tmpfs", 0, "size=1m")
    try:
        with open(point / "held", "w") as held:  # another holder of the mount, as a forked bwrap can be
            _fs.umount(str(point))
            assert _fs.mounts_under(str(point)) == []
            held.write("still writable until released\n")
    finally:
        _fs.umount(str(point), detach=True)


def test_a_read_only_remount_waits_for_a_passing_writer(tmp_path: Path) -> None:
    point = tmp_path / "ro"
    point.mkdir()
    _fs.mount("tmpfs", str(point), "tmpfs", 0, "size=1m")
    try:
        writer = open(point / "w", "w")  # noqa: SIM115 - closed by the thread below
        threading.Thread(target=lambda: (time.sleep(0.05), writer.close())).start()
        _fs.remount_readonly(str(point))
        assert {"ro", "nosuid", "nodev"} <= _mount_options(point)[str(point)]
    finally:
        _fs.umount(str(point), detach=True)


async def test_many_live_sandboxes_commit_and_discard_without_a_busy_unmount(overlay: str) -> None:
    """The reproduction: several sandboxes live while others commit and discard; the
    spawning of one sandbox's bwrap holds the others' mounts for a moment."""

    async def worker(sb, i: int, rounds: int) -> None:
        for j in range(rounds):
            f = await sb.fork()
            await f.run(f"mkdir -p /tmp/d{i}; echo {i}-{j} > /tmp/d{i}/f; ls -R /tmp > /dev/null")
            g = await f.fork()
            await g.run(f"echo {j} >> /tmp/d{i}/g")
            await f.commit(g)
            if j % 2:
                await sb.commit(f)
            else:
                await f.discard()

    async def root(sb, rounds: int) -> None:
        for j in range(rounds):
            await sb.run(f"echo {j} > /tmp/root{j % 5}; rm -f /tmp/root{(j + 2) % 5}")

    for _ in range(2):
        # compact_at=4: frequent compactions, so read-only remounts and lower views come
        # and go while other sandboxes' bwrap are being spawned
        async with open_sandbox(SandboxConfig(backend=overlay, timeout_s=60, compact_at=4)) as sb:
            path = sb.store.path
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(worker, sb, i, 12)
                tg.start_soon(root, sb, 12)
        assert _fs.mounts_under(str(path)) == []
