"""Issue 20, High #1 and the AF_VSOCK item: nothing a sandboxed command writes on a
writable bind may carry privilege out to the host (set-ID bits, file capabilities,
device nodes, root-owned files the bind's owner could not have made), on both backends,
and a sandbox without network cannot open a vsock socket. The probe is a real program
that calls setuid(0); the host runs what the sandbox planted as an unprivileged user."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from aospec.runtime import Bind, SandboxConfig, open_sandbox

from aospec.errors import ConfigError

pytestmark = pytest.mark.anyio

METHODS = ["chmod", "fchmod", "fchmodat", "fchmodat2", "creat", "open", "openat", "mknod", "openat2", "sgid"]
NOBODY = 65534


@pytest.fixture
def project() -> Iterator[Path]:
    """A project directory as a user would bind it: root's, and reachable by everyone."""
    d = Path(tempfile.mkdtemp(prefix="aospec-proj-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def _as_nobody(program: Path) -> str:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    proc = subprocess.run(
        [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(program), "whoami"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.stdout.strip() + proc.stderr.strip()


def _binds(probe_dir: Path, project: Path) -> tuple[Bind, ...]:
    return (Bind(str(probe_dir), "/probe"), Bind(str(project), "/work", writable=True))


async def test_a_writable_bind_never_gets_a_setuid_root_binary(backend: str, probe_dir: Path, project: Path) -> None:
    """The issue's attack: copy a program that calls setuid(0) onto the bind, chmod 4755,
    run it on the host as nobody. Before: euid=0 (it read /etc/shadow). Every way of
    making a set-ID file (chmod, fchmod, fchmodat, fchmodat2, a set-ID mode given to
    creat/open/openat/mknod, openat2, setgid) fails inside, and what lands on the host is
    an ordinary file that runs as the caller."""
    cfg = SandboxConfig(backend=backend, binds=_binds(probe_dir, project), timeout_s=60)
    async with open_sandbox(cfg) as sb:
        shell = await sb.run("cp /probe/setid_probe /work/.helper && chmod 4755 /work/.helper; echo rc=$?")
        assert "rc=0" not in shell.output, shell.output
        planted = await sb.run(" ; ".join(f"/probe/setid_probe plant {m} /work/h-{m}" for m in METHODS))
        lines = dict(line.split(" ", 1) for line in planted.output.splitlines())
        assert set(lines) == set(METHODS), planted.output
        for m in METHODS:
            assert lines[m] in ("errno 1", "errno 38"), (m, lines[m])  # EPERM; ENOSYS for openat2
        assert lines["openat2"] == "errno 38"
    for f in project.iterdir():
        st = f.lstat()
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), (f.name, oct(st.st_mode))
        if stat.S_ISREG(st.st_mode) and st.st_size and st.st_mode & 0o001:
            out = _as_nobody(f)
            assert "euid=0" not in out and "egid=0" not in out, (f.name, out)
            assert out == f"euid={NOBODY} egid={NOBODY}", (f.name, out)


async def test_the_probe_really_gives_root_when_set_id(probe_dir: Path, project: Path) -> None:
    """The check above could not pass by accident: the same program made setuid root on
    the host, outside any sandbox, gives euid 0 to nobody (what the sandbox did before)."""
    target = project / "helper"
    shutil.copy(probe_dir / "setid_probe", target)
    target.chmod(0o4755)
    assert _as_nobody(target).startswith("euid=0")


async def test_a_device_node_never_reaches_a_writable_bind(backend: str, probe_dir: Path, project: Path) -> None:
    """Even with cap_add CAP_MKNOD, a command cannot make a device node while a bind is
    writable (the filter refuses character and block devices)."""
    cfg = SandboxConfig(backend=backend, binds=_binds(probe_dir, project), cap_add=("CAP_MKNOD",), timeout_s=60)
    async with open_sandbox(cfg) as sb:
        r = await sb.run("/probe/setid_probe mknod_dev /work/null; /probe/setid_probe mknod_dev /tmp/null")
    assert r.output.splitlines() == ["mknod_dev errno 1", "mknod_dev errno 1"], r.output
    assert not (project / "null").exists()


def test_capabilities_that_could_bypass_the_filter_are_refused_with_writable_binds(project: Path) -> None:
    """File capabilities are an extended attribute no filter can see, CAP_FSETID keeps
    set-ID bits on a written file, CAP_SYS_ADMIN is everything: with a writable bind each
    is one clear error, as is turning the filter off. Read-only binds keep them."""
    rw = (Bind(str(project), "/work", writable=True),)
    for cap in ("CAP_SETFCAP", "fsetid", "SYS_ADMIN", "ALL"):
        with pytest.raises(ConfigError, match="writable bind"):
            SandboxConfig.from_mapping({"binds": [f"{project}:/work:rw"], "cap_add": [cap]})
    with pytest.raises(ValueError, match="seccomp: none with a writable bind"):
        SandboxConfig(binds=rw, seccomp="none")
    SandboxConfig(binds=(Bind(str(project), "/work"),), cap_add=("CAP_SETFCAP",), seccomp="none")


async def test_files_a_command_makes_on_a_users_bind_belong_to_that_user(backend: str, project: Path) -> None:
    """A bind owned by another user: what the sandbox's root creates there is given to the
    bind's owner after the command (a root-owned file is one that user could not have
    made), symlinks included; set-ID bits could not be set at all."""
    os.chown(project, NOBODY, NOBODY)
    project.chmod(0o777)
    cfg = SandboxConfig(backend=backend, binds=(Bind(str(project), "/work", writable=True),), timeout_s=60)
    async with open_sandbox(cfg) as sb:
        r = await sb.run("echo x > /work/f && mkdir -p /work/d/e && echo y > /work/d/e/g && ln -s f /work/l && echo ok")
        assert r.output == "ok\n"
        assert (await sb.run("cat /work/d/e/g")).output == "y\n"
    for p in (project / "f", project / "d", project / "d" / "e", project / "d" / "e" / "g", project / "l"):
        st = p.lstat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), (p, st.st_uid, st.st_gid)


async def test_no_vsock_socket_without_network(backend: str, probe_dir: Path) -> None:
    """vsock is not network-namespaced (on a VM it reaches the hypervisor): a sandbox
    without network gets EAFNOSUPPORT; with network it is what the host allows."""
    cfg = SandboxConfig(backend=backend, binds=(Bind(str(probe_dir), "/probe"),), timeout_s=60)
    async with open_sandbox(cfg) as sb:
        off = await sb.run("/probe/setid_probe vsock")
    assert off.output == "vsock errno 97\n", off.output
    async with open_sandbox(cfg.replace(network=True)) as sb:
        on = await sb.run("/probe/setid_probe vsock")
    assert on.output != "vsock errno 97\n" or not Path("/proc/net/vsock").exists()
