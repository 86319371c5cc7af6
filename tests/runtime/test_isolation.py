"""Limits and escape attempts, on every backend: each must be contained and reported,
and nothing may be lost in the committed state."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aospec.runtime import Limits, SandboxConfig, open_sandbox
from aospec.runtime.host import host_support

pytestmark = pytest.mark.anyio

MiB = 1 << 20
SMALL = Limits(memory_bytes=96 * MiB, cpus=0.5, pids=48, disk_bytes=24 * MiB, file_size_bytes=8 * MiB, open_files=256)


@pytest.fixture
async def limited(backend: str) -> AsyncIterator[object]:
    async with open_sandbox(SandboxConfig(backend=backend, limits=SMALL, timeout_s=20)) as sb:
        yield sb


def _pids_enforced(backend: str) -> bool:
    return backend == "docker" or "pids" in host_support()[0].cgroup_controllers


def _memory_cgroup(backend: str) -> bool:
    return backend == "docker" or "memory" in host_support()[0].cgroup_controllers


def _host_processes(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(f"{pid}: {cmd}")
    return found


async def test_memory_limit_stops_a_memory_hog(limited, backend: str) -> None:
    result = await limited.run("a=$(head -c 400000000 /dev/zero | tr '\\0' x); echo survived ${#a}")
    assert "survived" not in result.output
    if _memory_cgroup(backend):
        assert "memory" in result.limits_hit, result
    assert (await limited.run("echo alive")).output == "alive\n"


async def test_process_limit_contains_a_fork_bomb(limited, backend: str) -> None:
    if not _pids_enforced(backend):
        pytest.skip("no pids cgroup controller here: a fork bomb could not be contained (root ignores RLIMIT_NPROC)")
    result = await limited.run("bomb() { bomb | bomb & }; bomb; sleep 1; echo done", timeout=4)
    assert "pids" in result.limits_hit, result
    assert not _host_processes("bomb()")
    assert (await limited.run("echo alive")).output == "alive\n"


async def test_file_size_limit_stops_a_huge_file(limited) -> None:
    result = await limited.run("head -c 20000000 /dev/zero > /tmp/big")
    assert result.returncode != 0
    assert "file_size" in result.limits_hit, result
    size = (await limited.run("wc -c < /tmp/big")).output.strip()
    assert int(size) <= 8 * MiB


async def test_disk_limit_contains_filling_the_disk(limited, backend: str) -> None:
    if backend == "docker":
        pytest.skip("Docker's overlay2 on ext4 cannot cap a container's disk use (needs xfs with pquota)")
    v0 = limited.version
    fork = await limited.fork()
    result = await fork.run(
        "i=0; while head -c 4000000 /dev/zero > /tmp/fill$i; do i=$((i+1)); done; echo stopped at $i"
    )
    assert "disk" in result.limits_hit, result
    assert "stopped at" in result.output
    await fork.discard()
    assert limited.version == v0
    assert (await limited.run("ls /tmp")).output == ""
    # the committed sandbox itself: filling it is contained too, and it recovers
    result = await limited.run("i=0; while head -c 4000000 /dev/zero > /tmp/fill$i; do i=$((i+1)); done")
    assert "disk" in result.limits_hit
    assert (await limited.run("rm /tmp/fill*; echo ok > /tmp/after; cat /tmp/after")).output == "ok\n"


async def test_cpu_limit_throttles_a_busy_loop(backend: str) -> None:
    limits = Limits(cpus=0.25)
    if backend == "overlay" and "cpu" not in host_support()[0].cgroup_controllers:
        pytest.skip("no cpu cgroup controller here")
    async with open_sandbox(SandboxConfig(backend=backend, limits=limits)) as sb:
        result = await sb.run("time -p timeout 2 sh -c 'while :; do :; done' 2>&1; true")
    used = {
        k: float(v) for k, v in (line.split() for line in result.output.splitlines() if line[:4] in ("user", "sys "))
    }
    assert used["user"] + used["sys"] < 1.2, result.output  # unthrottled: ~2 s


async def test_host_files_are_neither_readable_nor_writable(sandbox, tmp_path: Path) -> None:
    token = secrets.token_hex(8)
    secret = tmp_path / f"secret-{token}"
    secret.write_text(f"host-secret-{token}")
    target = Path(f"/root/aospec-escape-{token}")
    result = await sandbox.run(
        f"cat {secret} /root/.bash_history /etc/shadow 2>&1; ls {tmp_path} 2>&1; "
        f"echo pwned > {target}; echo pwned > {tmp_path}/pwned; mkdir -p {tmp_path}; echo pwned > {tmp_path}/pwned2"
    )
    assert f"host-secret-{token}" not in result.output
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [secret.name]


async def test_host_environment_and_processes_are_hidden(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    token = f"secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("AOSPEC_ESCAPE_TEST", token)
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        result = await sb.run("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; ps -o pid,args")
    assert token not in result.output
    assert "pytest" not in result.output and "python" not in result.output


class _Listener:
    """A TCP server on every host address; records whether anyone connected."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connected = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connected = True
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[_Listener]:
    server = _Listener()
    yield server
    server.close()


def _host_addresses() -> list[str]:
    addrs = {"127.0.0.1"}
    for line in Path("/proc/net/fib_trie").read_text().splitlines() if Path("/proc/net/fib_trie").exists() else []:
        line = line.strip()
        if line.startswith("|-- "):
            addrs.add(line[4:])
    return sorted(a for a in addrs if not a.endswith((".0", ".255")))


async def test_network_is_unreachable_by_default(sandbox, listener: _Listener) -> None:
    tries = " ".join(
        f"(echo hi > /dev/tcp/{a}/{listener.port}) 2>/dev/null && echo CONNECTED {a};" for a in _host_addresses()
    )
    result = await sandbox.run(f"{tries} cat /proc/net/dev", timeout=15)
    assert "CONNECTED" not in result.output
    assert not listener.connected
    interfaces = [line.split(":")[0].strip() for line in result.output.splitlines() if ":" in line]
    assert interfaces == ["lo"]


async def test_network_can_be_enabled_explicitly(overlay: str, listener: _Listener) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay, network=True)) as sb:
        result = await sb.run(f"echo hi > /dev/tcp/127.0.0.1/{listener.port} && echo CONNECTED")
    assert "CONNECTED" in result.output


async def test_capabilities_are_dropped(sandbox) -> None:
    result = await sandbox.run(
        "grep CapEff /proc/self/status; mknod /tmp/dev c 1 3 2>&1 || echo mknod-denied; "
        "mount -t tmpfs none /mnt 2>&1 || echo mount-denied; touch /tmp/f; chown 1000 /tmp/f 2>&1 || echo chown-denied"
    )
    assert "CapEff:\t0000000000000000" in result.output
    for denied in ("mknod-denied", "mount-denied", "chown-denied"):
        assert denied in result.output


async def test_capabilities_can_be_added_explicitly(backend: str) -> None:
    probe = "echo secret > /tmp/f && chmod 000 /tmp/f && cat /tmp/f"
    async with open_sandbox(SandboxConfig(backend=backend, cap_add=("CAP_DAC_OVERRIDE",))) as sb:
        assert (await sb.run(probe)).output == "secret\n"
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        assert "Permission denied" in (await sb.run(probe)).output


async def test_host_kernel_settings_are_read_only(sandbox) -> None:
    # writes back the value just read, so even a failure of the test changes nothing
    result = await sandbox.run(
        "for f in /proc/sys/vm/overcommit_memory /proc/sys/kernel/printk_ratelimit /proc/sys/kernel/hostname; do "
        "v=$(cat $f) && (echo $v > $f) 2>/dev/null && echo WROTE $f; done; "
        "test -w /proc/sysrq-trigger && echo WRITABLE-SYSRQ; true"
    )
    assert "WROTE" not in result.output and "WRITABLE" not in result.output, result.output


async def test_symlinks_and_dotdot_stay_inside_the_sandbox(sandbox) -> None:
    token = secrets.token_hex(6)
    result = await sandbox.run(
        "ln -s / /tmp/hostroot; ln -s /etc/shadow /tmp/shadow; cd /../../../..; pwd; "
        "cat /tmp/hostroot/etc/passwd; ls /proc/1/root/ 2>&1 | head -3"
    )
    assert result.output.startswith("/\n")
    assert "root:x:0:0:root:/root:/bin/bash" in result.output  # the base's passwd, not the host's
    # the version hashes the symlinks themselves, never what they point to on the host
    assert ("/tmp/shadow", "symlink") in sandbox.last_layer.describe()
    await sandbox.run("ln -s /etc /tmp/etclink")
    await sandbox.write_file(f"/tmp/etclink/aospec-{token}", "inside")
    assert not Path(f"/etc/aospec-{token}").exists()
    assert (await sandbox.run(f"cat /etc/aospec-{token}")).output == "inside"


async def test_background_processes_do_not_outlive_their_command(sandbox) -> None:
    marker = str(4000 + secrets.randbelow(900))
    result = await sandbox.run(
        f"(sleep {marker}1 &); nohup sleep {marker}2 >/dev/null 2>&1 & setsid sleep {marker}3 & echo started"
    )
    assert result.output == "started\n" and not result.timed_out
    assert not _host_processes(f"sleep {marker}")
    assert (await sandbox.run(f"ps -o args | grep -c '^sleep {marker}' || true")).output.strip() == "0"


async def test_escape_attempts_in_forks_lose_nothing_in_the_committed_state(limited, backend: str) -> None:
    await limited.run("mkdir -p /data && echo precious > /data/keep")
    v0 = limited.version
    attempts = [
        "rm -rf /data /etc /bin/busybox 2>/dev/null; true",
        "head -c 20000000 /dev/zero > /data/keep",
        "a=$(head -c 400000000 /dev/zero | tr '\\0' x)",
        "kill -9 -1",
        "sleep 30 &  sleep 30",
    ]
    if _pids_enforced(backend):
        attempts.append("bomb() { bomb | bomb & }; bomb")
    for cmd in attempts:
        fork = await limited.fork()
        await fork.run(cmd, timeout=3)
        await fork.discard()
    assert limited.version == v0
    assert (await limited.run("cat /data/keep")).output == "precious\n"


async def test_declared_binds_are_the_only_host_paths_visible(backend: str, tmp_path: Path) -> None:
    from aospec.runtime import Bind

    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "data").write_text("shared")
    cfg = SandboxConfig(backend=backend, binds=(Bind(str(ro), "/mnt/ro"), Bind(str(rw), "/srv", writable=True)))
    async with open_sandbox(cfg) as sb:
        result = await sb.run(
            "cat /mnt/ro/data; echo; (echo x > /mnt/ro/new) 2>/dev/null || echo ro-denied; echo out > /srv/made; "
            f"ls {tmp_path} 2>&1 | grep -c 'No such' || true"
        )
    assert result.output == "shared\nro-denied\n1\n"
    assert (rw / "made").read_text() == "out\n"
    assert not (ro / "new").exists()
