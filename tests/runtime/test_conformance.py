"""Conformance suites for sandboxes.

The first part pins the protocol-level behaviour (``aospec.protocols.Sandbox``: version,
execute, fork, commit, discard, and the concurrency contract) on every sandbox: the
overlay and docker backends, ``aospec.testing.InMemorySandbox`` and replay's
``ReplaySandbox``. The second part pins what the runtime backends add (shell semantics,
``run``, timeouts, file access). Limits and escape attempts: test_isolation.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
import pytest
from aospec.replay.actor import VirtualClock
from aospec.replay.sandbox import ReplayWorld
from aospec.runtime import SandboxConfig, open_sandbox

from aospec.errors import SandboxError
from aospec.protocols import Sandbox
from aospec.testing import InMemorySandbox
from aospec.types import Action, Step, Trace

pytestmark = pytest.mark.anyio

# ---------------------------------------------------------------------- every sandbox: the protocol

WRITE_1 = Action.bash("echo 1 > /tmp/f1")
READ_1 = Action.bash("cat /tmp/f1")
WRITE_2 = Action.bash("echo 2 > /tmp/f2")
OK = "<returncode>0</returncode>\n<output>\n</output>"


def _recording() -> Trace:
    """What the replay sandbox replays: the actions the protocol tests run, in order."""
    read = "<returncode>0</returncode>\n<output>\n1\n</output>"
    steps = (
        Step(WRITE_1, OK, 1, tool_duration_s=0.0, state_changed=True),
        Step(READ_1, read, 1, tool_duration_s=0.0, state_changed=False),
        Step(WRITE_2, OK, 1, tool_duration_s=0.0, state_changed=True),
        Step(READ_1, read, 1, tool_duration_s=0.0, state_changed=False),
    )
    return Trace("conformance", "task", "test", "none", "tests", steps)


@asynccontextmanager
async def _held(sandbox: Sandbox) -> AsyncIterator[Sandbox]:
    yield sandbox


Opener = Callable[[], AbstractAsyncContextManager[Sandbox]]


@pytest.fixture(params=["overlay", pytest.param("docker", marks=pytest.mark.docker), "memory", "replay"])
def opener(request: pytest.FixtureRequest) -> Opener:
    """Opens a fresh committed sandbox of one kind (the same base each time)."""
    kind = request.param
    if kind in ("overlay", "docker"):
        request.getfixturevalue("overlay" if kind == "overlay" else "docker_backend")  # skips when unavailable
        return lambda: open_sandbox(SandboxConfig(backend=kind, timeout_s=20, formatter="mini-swe-agent"))
    if kind == "memory":
        return lambda: _held(InMemorySandbox())
    world = ReplayWorld(_recording(), VirtualClock())
    return lambda: _held(world.sandbox())


@pytest.fixture
async def any_sandbox(opener: Opener) -> AsyncIterator[Sandbox]:
    async with opener() as sb:
        yield sb


async def test_every_sandbox_and_its_forks_satisfy_the_protocol(any_sandbox: Sandbox) -> None:
    assert isinstance(any_sandbox, Sandbox)
    fork = await any_sandbox.fork()
    assert isinstance(fork, Sandbox) and fork.version == any_sandbox.version
    await fork.discard()


async def test_a_change_moves_the_version_and_a_read_keeps_it(any_sandbox: Sandbox) -> None:
    v0 = any_sandbox.version
    await any_sandbox.execute(WRITE_1)
    v1 = any_sandbox.version
    assert v1 != v0
    assert "1" in await any_sandbox.execute(READ_1)
    assert any_sandbox.version == v1


async def test_a_forks_changes_are_invisible_to_its_parent_and_siblings(any_sandbox: Sandbox) -> None:
    v0 = any_sandbox.version
    a, b = await any_sandbox.fork(), await any_sandbox.fork()
    await a.execute(WRITE_1)
    assert a.version != v0 and b.version == v0 and any_sandbox.version == v0
    assert await b.execute(READ_1) != await a.execute(READ_1)
    await a.discard()
    await b.discard()


async def test_the_same_action_from_the_same_version_gives_the_same_result(any_sandbox: Sandbox) -> None:
    a, b = await any_sandbox.fork(), await any_sandbox.fork()
    assert await a.execute(WRITE_1) == await b.execute(WRITE_1)
    assert a.version == b.version != any_sandbox.version
    assert await a.execute(READ_1) == await b.execute(READ_1)
    await a.discard()
    await b.discard()


async def test_commit_makes_the_forks_state_the_parents_and_consumes_the_fork(any_sandbox: Sandbox) -> None:
    fork = await any_sandbox.fork()
    await fork.execute(WRITE_1)
    expected = fork.version
    await any_sandbox.commit(fork)
    assert any_sandbox.version == expected
    assert "1" in await any_sandbox.execute(READ_1)
    with pytest.raises(SandboxError):
        await fork.execute(READ_1)
    with pytest.raises(SandboxError):
        await any_sandbox.commit(fork)


async def test_a_fork_of_a_fork_can_be_committed(any_sandbox: Sandbox) -> None:
    first = await any_sandbox.fork()
    await first.execute(WRITE_1)
    second = await first.fork()
    read = await second.execute(READ_1)
    await second.execute(WRITE_2)
    expected = second.version
    await any_sandbox.commit(first)
    await any_sandbox.commit(second)
    assert any_sandbox.version == expected
    assert await any_sandbox.execute(READ_1) == read


async def test_discard_is_idempotent_and_leaves_the_parent_alone(any_sandbox: Sandbox) -> None:
    v0 = any_sandbox.version
    fork = await any_sandbox.fork()
    await fork.execute(WRITE_1)
    await fork.discard()
    await fork.discard()
    with pytest.raises(SandboxError):
        await fork.execute(READ_1)
    assert any_sandbox.version == v0


async def test_serial_and_forked_execution_of_actions_reach_the_same_version(opener: Opener) -> None:
    async with opener() as serial, opener() as forked:
        for action in (WRITE_1, READ_1, WRITE_2):
            await serial.execute(action)
            fork = await forked.fork()
            await fork.execute(action)
            await forked.commit(fork)
        assert forked.version == serial.version


async def test_forks_and_commits_of_one_sandbox_may_overlap(any_sandbox: Sandbox) -> None:
    # The concurrency contract: fork, commit and discard of one sandbox may be called from
    # several tasks at once (the engine forks targets while it commits a step).
    v0 = any_sandbox.version
    ready = await any_sandbox.fork()
    await ready.execute(WRITE_1)
    v1 = ready.version
    forks: list[Sandbox] = []

    async def fork_one() -> None:
        forks.append(await any_sandbox.fork())

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(fork_one)
        tg.start_soon(any_sandbox.commit, ready)
        for _ in range(3):
            tg.start_soon(fork_one)
    assert any_sandbox.version == v1
    assert len(forks) == 6 and {f.version for f in forks} <= {v0, v1}

    async def run_in(fork: Sandbox, action: Action) -> None:
        await fork.execute(action)

    async with anyio.create_task_group() as tg:  # different sandboxes execute side by side
        for k, fork in enumerate(forks):
            tg.start_soon(run_in, fork, WRITE_2 if k % 2 else READ_1)
    async with anyio.create_task_group() as tg:
        for fork in forks:
            tg.start_soon(fork.discard)
    assert any_sandbox.version == v1


# ---------------------------------------------------------------------- runtime backends


async def test_sandbox_satisfies_the_protocol(sandbox: Sandbox) -> None:
    assert isinstance(sandbox, Sandbox)
    fork = await sandbox.fork()
    assert isinstance(fork, Sandbox)
    await fork.discard()


async def test_execute_returns_the_raw_output_by_default(sandbox) -> None:
    assert await sandbox.execute(Action.bash("echo out; echo err >&2; exit 3")) == "out\nerr\n"


async def test_execute_returns_the_mini_swe_agent_observation_when_asked(backend: str) -> None:
    async with open_sandbox(SandboxConfig(backend=backend, formatter="mini-swe-agent")) as sb:
        obs = await sb.execute(Action.bash("echo out; echo err >&2; exit 3"))
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
    async with open_sandbox(SandboxConfig(backend=backend, timeout_s=1, formatter="mini-swe-agent")) as sb:
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
    async with open_sandbox(SandboxConfig(backend=backend, formatter="mini-swe-agent")) as one:
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


async def test_serial_and_forked_shell_changes_reach_the_same_version(backend: str) -> None:
    steps = [
        "mkdir -p /app && echo v1 > /app/main",
        "rm -rf /app && mkdir /app && echo v2 > /app/main",
        "chmod 700 /app",
    ]
    async with open_sandbox(SandboxConfig(backend=backend, formatter="mini-swe-agent")) as serial:
        for s in steps:
            await serial.run(s)
        async with open_sandbox(SandboxConfig(backend=backend, formatter="mini-swe-agent")) as forked:
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
    async with open_sandbox(SandboxConfig(backend=backend, formatter="mini-swe-agent")) as sb:
        result = await sb.run("sleep 12; echo survived", timeout=60)
    assert (result.returncode, result.output) == (0, "survived\n")
