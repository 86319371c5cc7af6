"""Issue 20, Medium #9: in a Docker sandbox no process may outlive its command, and a
dead container is a SandboxError, never an observation made of the OCI runtime's error
text. The kept processes (the container's init and its idle child) run as a user of
their own, the commands as root without CAP_KILL, CAP_SYS_PTRACE, CAP_SETUID or
CAP_FOWNER: a command can neither ptrace, write the memory of, nor signal them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import anyio
import pytest
from aospec.runtime import Bind, SandboxConfig, open_sandbox

from aospec.errors import ConfigError, SandboxError

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


def _config(docker_backend: str, probe_dir: Path, **kw: object) -> SandboxConfig:
    return SandboxConfig(backend=docker_backend, binds=(Bind(str(probe_dir), "/probe"),), timeout_s=60, **kw)


async def test_a_command_cannot_reach_the_containers_init(docker_backend: str, probe_dir: Path) -> None:
    """The container's init cannot be ptraced, its memory cannot be opened, it cannot be
    signalled; after kill -9 1 and kill -9 -1 (which once left a dying container whose
    next exec "ran" with the OCI runtime's error as output) the container is the same
    one, with the same init, answering the next command."""
    async with open_sandbox(_config(docker_backend, probe_dir)) as sb:
        kept = sorted(sb._box.keep)
        assert len(kept) == 2  # docker-init and the idle process
        r = await sb.run("/probe/setid_probe reach 1")
        assert r.output.splitlines() == ["ptrace-1 errno 1", "mem-1 errno 13", "signal-1 errno 1"], r.output
        init = sb._box.init_fd
        killed = await sb.run("kill -9 1; kill -9 -1; echo after")
        assert "after" in killed.output
        assert (await sb.run("echo hi")).output == "hi\n"
        assert sb._box.init_fd == init and not sb._box.died()
        assert sorted(sb._box.keep) == kept


async def test_the_idle_process_is_out_of_reach(docker_backend: str, probe_dir: Path) -> None:
    """The issue's attack: ptrace the idle process (or write its /proc/PID/mem) to make it
    run a loop that writes between commands; PTRACE_ATTACH used to succeed. Now it cannot
    be ptraced, its memory cannot be opened, it cannot be signalled."""
    async with open_sandbox(_config(docker_backend, probe_dir)) as sb:
        ps = await sb.run("for p in /proc/[0-9]*; do echo ${p#/proc/} $(cat $p/comm) $(stat -c %u $p); done")
        idle = [line.split()[0] for line in ps.output.splitlines() if line.split()[1:2] == ["sleep"]]
        assert len(idle) == 1, ps.output
        r = await sb.run(f"/probe/setid_probe reach {idle[0]}")
    assert r.output.splitlines() == [f"ptrace-{idle[0]} errno 1", f"mem-{idle[0]} errno 13", f"signal-{idle[0]} errno 1"]


async def test_a_container_killed_under_a_command_is_a_sandbox_error(docker_backend: str, probe_dir: Path) -> None:
    """The container dies while a command runs (killed from outside): no observation (the
    OCI runtime's error text once came back as output with rc 126), a SandboxError; the
    next command runs in the restarted container and the version still names the state."""
    async with open_sandbox(_config(docker_backend, probe_dir)) as sb:
        await sb.run("echo kept > /tmp/k")
        cid = sb.container_id

        started = sb._box.merged / "tmp" / "started"

        async def kill_once_started() -> None:
            while not started.exists():  # the command runs (a loaded host can take seconds)
                await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(lambda: subprocess.run(["docker", "kill", cid], capture_output=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_once_started)
            with pytest.raises(SandboxError, match="died while running the command"):
                await sb.run("touch /tmp/started; sleep 300; echo done", timeout=600)
        version = sb.version
        r = await sb.run("cat /tmp/k; rm /tmp/started")
        assert r.output == "kept\n" and r.returncode == 0
        assert sb.version != version  # the removal moved it: the restarted container is tracked


async def test_capabilities_that_reach_the_kept_processes_are_refused(docker_backend: str) -> None:
    """A capability that would let a command become the kept processes' user or ptrace
    them is one clear error; others (CAP_DAC_OVERRIDE, ...) still work."""
    for cap in ("CAP_SYS_PTRACE", "setuid", "FOWNER", "ALL"):
        with pytest.raises(ConfigError, match="kept processes"):
            async with open_sandbox(SandboxConfig(backend=docker_backend, cap_add=(cap,))):
                pass


async def test_added_capabilities_still_reach_the_command(docker_backend: str) -> None:
    async with open_sandbox(SandboxConfig(backend=docker_backend, cap_add=("CAP_DAC_OVERRIDE", "CAP_CHOWN"))) as sb:
        r = await sb.run("grep CapEff /proc/self/status; echo s > /tmp/f && chmod 000 /tmp/f && cat /tmp/f")
        assert r.output == "CapEff:\t0000000000000003\ns\n", r.output
