"""One conformance suite for every sandbox backend: execute, fork isolation, commit,
discard, versions, and file access. Limits and escape attempts: test_isolation.py."""

from __future__ import annotations

import pytest

from aospec.errors import SandboxError
from aospec.protocols import Sandbox
from aospec.types import Action
from runtime import SandboxConfig, open_sandbox

pytestmark = pytest.mark.anyio


async def test_sandbox_satisfies_the_protocol(sandbox: Sandbox) -> None:
    assert isinstance(sandbox, Sandbox)
    fork = await sandbox.fork()
    assert isinstance(fork, Sandbox)
    await fork.discard()


async def test_execute_returns_the_mini_swe_agent_observation(sandbox) -> None:
    obs = await sandbox.execute(Action.bash("echo out; echo err >&2; exit 3"))
    assert obs == "<returncode>3</returncode>\n<output>\nout\nerr\n</output>"


async def test_run_reports_returncode_output_and_duration(sandbox) -> None:
    result = await sandbox.run("printf 'a\\nb'; exit 7")
    assert (result.returncode, result.output, result.timed_out) == (7, "a\nb", False)
    assert result.duration_s > 0


async def test_run_uses_env_and_cwd(sandbox) -> None:
    result = await sandbox.run('echo "$GREETING $(pwd)"', env={"GREETING": "hello"}, cwd="/tmp")
    assert result.output == "hello /tmp\n"


async def test_non_bash_actions_are_rejected_clearly(sandbox) -> None:
    with pytest.raises(SandboxError, match="bash actions only"):
        await sandbox.execute(Action("search", {"q": "x"}))


async def test_a_reply_without_a_tool_call_runs_nothing(sandbox) -> None:
    before = sandbox.version
    assert await sandbox.execute(Action.none()) == ""
    assert sandbox.version == before


async def test_timeout_kills_the_command_and_says_so(sandbox) -> None:
    result = await sandbox.run("echo started; sleep 30 & sleep 31", timeout=1)
    assert result.timed_out and "timeout" in result.limits_hit
    assert result.output == "started\n"
    assert result.duration_s < 15
    left = await sandbox.run("ps -o comm,args | grep 'sleep 3[01]' || true")
    assert left.output == ""


async def test_timeout_observation_matches_mini_swe_agent(backend: str) -> None:
    async with open_sandbox(SandboxConfig(backend=backend, timeout_s=1)) as sb:
        obs = await sb.execute(Action.bash("echo partial; sleep 20"))
    assert obs == (
        "The last command <command>echo partial; sleep 20</command> timed out and has been killed.\n"
        "The output of the command was:\n <output>\npartial\n\n</output>\n"
        "Please try another command and make sure to avoid those requiring interactive input."
    )


async def test_a_fork_starts_at_its_parents_version_and_state(sandbox) -> None:
    await sandbox.run("echo base > /tmp/f")
    fork = await sandbox.fork()
    assert fork.version == sandbox.version
    assert (await fork.run("cat /tmp/f")).output == "base\n"
    await fork.discard()


async def test_fork_changes_are_invisible_to_parent_and_siblings(sandbox) -> None:
    v0 = sandbox.version
    a = await sandbox.fork()
    b = await sandbox.fork()
    await a.run("echo from-a > /tmp/a; rm -f /etc/passwd; mkdir -p /srv/a")
    assert a.version != v0
    assert b.version == v0 and sandbox.version == v0
    for other in (b, sandbox):
        out = (
            await other.run("cat /tmp/a 2>/dev/null; test -f /etc/passwd && echo P; test -d /srv/a && echo D")
        ).output
        assert out == "P\n"
    await a.discard()
    await b.discard()


async def test_parent_changes_after_a_fork_are_invisible_to_the_fork(sandbox) -> None:
    fork = await sandbox.fork()
    await sandbox.run("echo later > /tmp/later")
    assert (await fork.run("test -e /tmp/later && echo yes || echo no")).output == "no\n"
    await fork.discard()


async def test_commit_makes_the_forks_state_and_version_the_parents(sandbox) -> None:
    fork = await sandbox.fork()
    await fork.run("echo committed > /tmp/c; rm /etc/profile")
    expected = fork.version
    await sandbox.commit(fork)
    assert sandbox.version == expected
    out = (await sandbox.run("cat /tmp/c; test -e /etc/profile && echo hosts")).output
    assert out == "committed\n"
    with pytest.raises(SandboxError):
        await fork.run("true")
    with pytest.raises(SandboxError):
        await sandbox.commit(fork)


async def test_commit_of_a_fork_of_a_fork_is_allowed(sandbox) -> None:
    first = await sandbox.fork()
    await first.run("echo 1 > /tmp/one")
    second = await first.fork()
    await second.run("echo 2 > /tmp/two")
    await sandbox.commit(first)
    await sandbox.commit(second)
    assert (await sandbox.run("cat /tmp/one /tmp/two")).output == "1\n2\n"


async def test_commit_rejects_a_sandbox_that_is_not_a_descendant(backend: str) -> None:
    async with open_sandbox(SandboxConfig(backend=backend)) as one:
        fork = await one.fork()
        other = await one.fork()
        with pytest.raises(SandboxError, match="not forked from"):
            await other.commit(fork)
        await fork.discard()
        await other.discard()


async def test_discard_releases_the_fork_and_leaves_the_parent_alone(sandbox) -> None:
    v0 = sandbox.version
    fork = await sandbox.fork()
    await fork.run("echo x > /tmp/x")
    await fork.discard()
    await fork.discard()  # idempotent
    with pytest.raises(SandboxError):
        await fork.run("true")
    assert sandbox.version == v0
    assert (await sandbox.run("test -e /tmp/x && echo yes || echo no")).output == "no\n"


async def test_same_changes_give_the_same_version_and_different_ones_differ(sandbox) -> None:
    a, b, c = await sandbox.fork(), await sandbox.fork(), await sandbox.fork()
    await a.run("mkdir -p /w && echo same > /w/f && ln -s /w/f /w/l")
    await b.run("mkdir -p /w; echo same > /w/f; ln -s /w/f /w/l; echo extra >/dev/null")
    await c.run("mkdir -p /w && echo other > /w/f && ln -s /w/f /w/l")
    assert a.version == b.version != sandbox.version
    assert c.version != a.version
    for f in (a, b, c):
        await f.discard()


@pytest.mark.parametrize(
    "command",
    [
        "ls -la / > /dev/null; cat /etc/passwd",  # read only
        "touch /etc/passwd",  # mtime only
        "cp -p /etc/profile /tmp/h && rm /tmp/h",  # created and removed again
        "cat /etc/profile > /tmp/h && cat /tmp/h > /etc/profile && rm /tmp/h",  # rewritten identically
    ],
)
async def test_commands_that_change_nothing_keep_the_version(sandbox, command: str) -> None:
    v0 = sandbox.version
    result = await sandbox.run(command)
    assert result.returncode == 0, result.output
    assert sandbox.version == v0


@pytest.mark.parametrize(
    "command",
    [
        "chmod 600 /etc/profile",
        "echo x >> /etc/profile",
        "rm /etc/profile",
        "mkdir /newdir",
        "ln -s /nowhere /tmp/link",
        "rm -rf /usr/sbin && mkdir /usr/sbin",
    ],
)
async def test_each_kind_of_change_moves_the_version(sandbox, command: str) -> None:
    v0 = sandbox.version
    assert (await sandbox.run(command)).returncode == 0
    assert sandbox.version != v0


async def test_serial_and_forked_execution_reach_the_same_version(backend: str) -> None:
    steps = [
        "mkdir -p /app && echo v1 > /app/main",
        "rm -rf /app && mkdir /app && echo v2 > /app/main",
        "chmod 700 /app",
    ]
    async with open_sandbox(SandboxConfig(backend=backend)) as serial:
        for s in steps:
            await serial.run(s)
        async with open_sandbox(SandboxConfig(backend=backend)) as forked:
            for s in steps:
                fork = await forked.fork()
                await fork.run(s)
                await forked.commit(fork)
            assert forked.version == serial.version


async def test_files_can_be_read_and_written_from_the_host(sandbox) -> None:
    v0 = sandbox.version
    await sandbox.write_file("/tmp/in.txt", "hello\n")
    assert sandbox.version != v0
    assert (await sandbox.run("cat /tmp/in.txt")).output == "hello\n"
    await sandbox.run("echo made-inside > /tmp/out.txt")
    assert await sandbox.read_file("/tmp/out.txt") == b"made-inside\n"
    with pytest.raises(SandboxError, match="cannot read"):
        await sandbox.read_file("/no/such/file")


async def test_host_file_access_resolves_symlinks_inside_the_sandbox(sandbox) -> None:
    await sandbox.run("ln -s / /tmp/root && ln -s ../../../../../etc /tmp/dots && echo sandbox-hosts > /etc/profile")
    assert await sandbox.read_file("/tmp/root/etc/profile") == b"sandbox-hosts\n"
    assert await sandbox.read_file("/tmp/dots/profile") == b"sandbox-hosts\n"
    assert await sandbox.read_file("/../../../etc/profile") == b"sandbox-hosts\n"


async def test_cancelling_a_command_kills_it_and_keeps_the_version_true(sandbox) -> None:
    import time

    import anyio

    fork = await sandbox.fork()
    v0 = fork.version
    started = time.monotonic()
    with anyio.move_on_after(1.5):
        await fork.run("echo before > /tmp/before; sleep 30; echo after > /tmp/after", timeout=60)
    assert time.monotonic() - started < 15
    # what the command did before it was cancelled is in the version
    assert fork.version != v0
    assert (await fork.run("cat /tmp/before; ls /tmp/after 2>&1 | grep -c 'No such'")).output == "before\n1\n"
    assert (await fork.run("ps -o args | grep -c '^sleep 30' || true")).output == "0\n"
    await fork.discard()


@pytest.mark.slow
async def test_a_command_may_run_longer_than_idle_worker_threads_live(backend: str) -> None:
    # anyio retires idle worker threads after 10 s; a sandbox must not die with the
    # thread that happened to start it
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        result = await sb.run("sleep 12; echo survived", timeout=60)
    assert (result.returncode, result.output) == (0, "survived\n")
