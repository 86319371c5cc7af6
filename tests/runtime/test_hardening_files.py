"""Issue 20, High #2, Medium #7 (runtime side) and the NUL-path item: the file API of both
backends never blocks on a FIFO (or any file that is not a regular one), checks a size
limit before reading, and refuses a path, command or working directory with a NUL byte
instead of cutting it short."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest
from aospec.runtime import Limits, SandboxConfig, open_sandbox

from aospec import errors
from aospec.errors import SandboxError

pytestmark = pytest.mark.anyio

GiB = 1 << 30


async def test_file_calls_on_a_fifo_fail_at_once(backend: str) -> None:
    """Before: read_file, write_file (and so the MCP read_file/write_file/edit_file/
    export_file tools) on a FIFO blocked forever, even under a cancel scope. Now each is
    one SandboxError at once, and the session goes on."""
    cfg = SandboxConfig(backend=backend, timeout_s=30)
    async with open_sandbox(cfg) as sb:
        await sb.run("mkfifo /tmp/fifo && mkdir /tmp/dir")
        with anyio.move_on_after(20) as scope:
            for call in (lambda: sb.read_file("/tmp/fifo"), lambda: sb.write_file("/tmp/fifo", b"x")):
                with pytest.raises(SandboxError, match=r"it is a FIFO, not a regular file|is not a regular file"):
                    await call()
            with pytest.raises(SandboxError, match="it is a directory, not a regular file"):
                await sb.read_file("/tmp/dir")
            with pytest.raises(SandboxError, match="not a regular file"):
                await sb.write_file("/tmp/dir", b"x")
        assert not scope.cancelled_caught
        assert (await sb.run("ls -l /tmp/fifo | cut -c1")).output == "p\n"
        assert (await sb.run("echo still here")).output == "still here\n"


async def test_a_fifo_with_a_reader_is_refused_without_writing(overlay: str) -> None:
    """A FIFO someone reads (its open for writing would succeed): refused by its type
    before a byte goes in; and a symlink to a FIFO the same."""
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        await sb.run("mkfifo /tmp/fifo && ln -s /tmp/fifo /tmp/link")
        await sb.read_file("/etc/passwd")  # the root is mounted again
        fd = os.open(sb.root_path / "tmp/fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            for path in ("/tmp/fifo", "/tmp/link"):
                with pytest.raises(SandboxError, match="it is a FIFO"):
                    await sb.write_file(path, b"payload")
            assert os.read(fd, 100) == b""
        finally:
            os.close(fd)


@pytest.mark.docker
async def test_a_device_node_is_refused(docker_backend: str) -> None:
    """A device node (a Docker sandbox with cap_add CAP_MKNOD can make one; an overlay
    sandbox cannot, its user namespace forbids it) is not read or written through."""
    async with open_sandbox(SandboxConfig(backend=docker_backend, cap_add=("CAP_MKNOD",))) as sb:
        assert (await sb.run("mknod /tmp/zero c 1 5 && echo made")).output == "made\n"
        for call in (lambda: sb.read_file("/tmp/zero"), lambda: sb.write_file("/tmp/zero", b"x")):
            with pytest.raises(SandboxError, match="/tmp/zero"):
                await call()


async def test_a_size_limit_is_checked_before_reading(backend: str) -> None:
    """Medium #7: read_file of a 2 GiB sparse file returned its "over 1 MiB" error after
    reading all of it (16.7 s, 4.2 GB RSS). With max_bytes the file's size comes from
    fstat: FileTooLargeError names the real size and the limit, nothing was read (the
    file's access time is unchanged), and a file at the limit still reads."""
    cfg = SandboxConfig(backend=backend, limits=Limits(file_size_bytes=None), timeout_s=60)
    async with open_sandbox(cfg) as sb:
        r = await sb.run("dd if=/dev/zero of=/tmp/big bs=1 count=0 seek=2147483648 2>/dev/null; printf 12345 > /tmp/five")
        assert r.returncode == 0, r.output
        atime = (await sb.run("stat -c %X /tmp/big")).output
        with pytest.raises(errors.FileTooLargeError) as err:
            await sb.read_file("/tmp/big", max_bytes=1 << 20)
        assert (err.value.size, err.value.limit) == (2 * GiB, 1 << 20)
        assert str(err.value) == f"/tmp/big is {2 * GiB} bytes, over the {1 << 20}-byte limit"
        await anyio.sleep(1.1)
        assert (await sb.run("stat -c %X /tmp/big")).output == atime
        assert await sb.read_file("/tmp/five", max_bytes=5) == b"12345"
        with pytest.raises(errors.FileTooLargeError):
            await sb.read_file("/tmp/five", max_bytes=4)


async def test_a_nul_byte_is_an_error_never_a_shorter_path(backend: str) -> None:
    """``/etc/passwd\\0x`` read /etc/passwd: the kernel stops at the NUL. Paths, commands,
    working directories and environment entries with a NUL are one SandboxError."""
    async with open_sandbox(SandboxConfig(backend=backend, timeout_s=30)) as sb:
        assert await sb.read_file("/etc/passwd")
        with pytest.raises(SandboxError, match="contains a NUL byte"):
            await sb.read_file("/etc/passwd\0x")
        with pytest.raises(SandboxError, match="contains a NUL byte"):
            await sb.write_file("/tmp/a\0b", b"x")
        assert (await sb.run("ls /tmp")).output == ""
        with pytest.raises(SandboxError, match="NUL byte"):
            await sb.run("echo a\0b")
        with pytest.raises(SandboxError, match="NUL byte"):
            await sb.run("pwd", cwd="/tmp\0/x")
        with pytest.raises(SandboxError, match="NUL byte"):
            await sb.run("true", env={"A": "b\0c"})


def test_a_lookup_in_the_root_survives_renames_elsewhere_on_the_host(tmp_path: Path) -> None:
    """openat2's RESOLVE_IN_ROOT fails with EAGAIN when any rename or mount on the host
    races a lookup through ``..`` (a host mounting forks does both all the time): read_file
    reported "Resource temporarily unavailable" for a symlink escape under load.
    open_in_root tries again (without the retries: ~350 of 20,000 lookups failed here)."""
    import threading

    from aospec.runtime import _fs

    root, churn = tmp_path / "root", tmp_path / "churn"
    (root / "a").mkdir(parents=True)
    (root / "b").write_text("x")
    churn.mkdir()
    (churn / "x0").write_text("")
    stop = threading.Event()

    def rename_forever() -> None:
        i = 0
        while not stop.is_set():
            os.rename(churn / f"x{i % 2}", churn / f"x{(i + 1) % 2}")
            i += 1

    thread = threading.Thread(target=rename_forever)
    thread.start()
    failed = []
    try:
        for _ in range(20_000):
            try:
                os.close(_fs.open_in_root(str(root), "a/../../../b", os.O_RDONLY))
            except OSError as exc:
                failed.append(exc.errno)
    finally:
        stop.set()
        thread.join()
    assert failed == []
