"""The committed root (overlay) forks while it runs a command: the fork is at the state
before the command, with that state's version, and the root's version moves only when
the command is done. A version always equals the state it names, also with forks taken
at every moment of a stream of writing commands, freezes and compactions."""

from __future__ import annotations

import random

import anyio
import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime.lossless import snapshot_tree

from aospec.types import Action

pytestmark = [pytest.mark.anyio, pytest.mark.root]


async def _content(fork: object) -> dict:
    return await anyio.to_thread.run_sync(snapshot_tree, fork.root_path)  # type: ignore[attr-defined]


async def test_a_fork_taken_while_the_root_runs_a_command_is_at_the_state_before_it(overlay: str) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        assert sb.forks_during_execute
        await sb.run("mkdir -p /w && echo one > /w/f")
        before = sb.version
        seen = {}

        async def during() -> None:
            await anyio.sleep(0.3)  # the command has written /w/g and sleeps
            seen["version"] = sb.version
            seen["fork"] = await sb.fork()

        async with anyio.create_task_group() as tg:
            tg.start_soon(during)
            out = await sb.execute(Action.bash("echo two > /w/g; echo three >> /w/f; sleep 1; echo done"))
        assert "done" in out
        fork = seen["fork"]
        assert seen["version"] == before  # the version does not move while the command runs
        assert fork.version == before
        assert sb.version != before
        assert (await fork.run("cat /w/f; ls /w")).output == "one\nf\n"
        assert (await sb.run("cat /w/f; ls /w")).output == "one\nthree\nf\ng\n"
        # the fork is a fork like any other: it runs, and its state can be committed
        await fork.run("echo four > /w/h")
        await sb.commit(fork)
        assert (await sb.run("ls /w")).output == "f\nh\n"


async def test_forks_at_every_moment_of_a_stream_of_writes_are_exactly_their_versions(overlay: str) -> None:
    # compact_at 4: the root compacts its stack every couple of commits, under the forks
    async with open_sandbox(SandboxConfig(backend=overlay, compact_at=4)) as sb:
        rng = random.Random(2212)
        reference: dict[str, dict] = {}
        taken: list[tuple[str, dict]] = []
        done = anyio.Event()

        async def forker() -> None:
            while not done.is_set():
                fork = await sb.fork()
                taken.append((fork.version, await _content(fork)))
                await fork.discard()
                await anyio.sleep(rng.random() * 0.02)

        async with anyio.create_task_group() as tg:
            ref = await sb.fork()
            reference[ref.version] = await _content(ref)
            await ref.discard()
            tg.start_soon(forker)
            for i in range(24):
                k = rng.randrange(6)
                command = rng.choice(
                    [
                        f"mkdir -p /d{k} && echo {i} > /d{k}/f{i % 3}",
                        f"rm -rf /d{k}",
                        f"echo {i} >> /log; sleep 0.0{rng.randrange(10)}",
                        "true",
                        f"ln -sf /d{k} /link{i % 2}",
                    ]
                )
                await sb.execute(Action.bash(command))
                # the state each version names, read once nothing runs
                ref = await sb.fork()
                reference.setdefault(ref.version, await _content(ref))
                await ref.discard()
            done.set()
        assert len(taken) > 10, "the forker hardly ran: nothing was checked"
        assert len({v for v, _ in taken}) > 3, "every fork saw the same state: nothing was checked"
        for version, content in taken:
            assert version in reference, "a fork's version is none of the root's"
            assert content == reference[version], f"a fork at {version} is not the state its version names"
