"""Pausing a sandbox's commands (PausableSandbox) and metering their CPU (MeteredSandbox),
on both backends: a paused command takes no CPU and loses no time from its timeout, a
command started while paused starts frozen, and no way of giving up on a paused sandbox
(discard, session close, a killed session and gc) leaves a frozen process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime.gc import collect_garbage
from aospec.runtime.host import host_support
from aospec.runtime.processes import marked_processes

from aospec.errors import SandboxError
from aospec.protocols import MeteredSandbox, PausableSandbox, SandboxCapabilities
from aospec.types import Action

pytestmark = [pytest.mark.anyio, pytest.mark.root]

#: a busy loop of about a second of CPU in busybox's shell (no sleep: CPU-bound)
_SPIN = "i=0; while [ $i -lt 150000 ]; do i=$((i+1)); done; echo spun $i"


def _needs_freezer() -> None:
    _, cgroups = host_support()
    if cgroups is None or not cgroups.freezer:
        pytest.skip("no writable freezer cgroup on this host")


async def _until(predicate, what: str, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(timeout_s):
        while not predicate():
            await anyio.sleep(0.02)


async def test_both_backends_are_pausable_and_metered(backend: str) -> None:
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        caps = SandboxCapabilities.of(fork)
        assert caps.pausable and caps.metered
        assert isinstance(sb, PausableSandbox) and isinstance(sb, MeteredSandbox)
        # with no command running: flags only, idempotent, and nothing breaks after
        assert not fork.paused
        await fork.pause()
        await fork.pause()
        assert fork.paused
        await fork.resume()
        await fork.resume()
        assert not fork.paused
        assert fork.cpu_ns == 0
        assert (await fork.run("echo after")).output == "after\n"
        await fork.discard()


async def test_a_paused_command_takes_no_cpu_and_ends_normally_once_resumed(backend: str) -> None:
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        result = {}

        async def run() -> None:
            result["r"] = await fork.run(_SPIN, timeout=120)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await _until(lambda: fork.cpu_ns > 20_000_000, "the command uses CPU")
            await fork.pause()
            frozen_at = fork.cpu_ns
            await anyio.sleep(1.0)
            # not one scheduler tick more while frozen (a tick is at most 10 ms)
            assert fork.cpu_ns - frozen_at < 10_000_000
            assert "r" not in result
            await fork.resume()
        assert result["r"].output == "spun 150000\n"
        assert result["r"].returncode == 0
        assert fork.cpu_ns >= frozen_at  # the finished command's CPU stays counted
        assert (await sb.fork()).cpu_ns == 0  # a fork starts from 0
        await fork.discard()


async def test_paused_time_does_not_count_against_the_timeout(backend: str) -> None:
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        result = {}

        async def run() -> None:
            result["r"] = await fork.run("sleep 0.6; echo finished", timeout=1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.3)
            await fork.pause()
            await anyio.sleep(3.0)  # three times the timeout, paused
            await fork.resume()
        assert not result["r"].timed_out, result["r"]
        assert result["r"].output == "finished\n"
        # and the timeout still works once resumed
        assert (await fork.run("sleep 5", timeout=1)).timed_out
        await fork.discard()


async def test_a_command_started_while_paused_starts_frozen(backend: str) -> None:
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        await fork.pause()
        result = {}

        async def run() -> None:
            result["r"] = await fork.run("echo ran > /tmp/ran; echo ran", timeout=1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(2.0)  # twice its timeout
            assert "r" not in result
            probe = await sb.fork()  # the paused fork has written nothing yet
            await fork.resume()
        assert result["r"].output == "ran\n" and not result["r"].timed_out
        assert fork.version != probe.version
        await probe.discard()
        await fork.discard()


async def test_discarding_a_paused_fork_leaves_no_frozen_process(backend: str) -> None:
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fork.run, "sleep 300 & sleep 300; wait")
            await _until(lambda: fork.cpu_ns > 0 or _stray(sb, fork), "the command started")
            await fork.pause()
            # as the engine gives up on a running guess: cancel its task, then discard
            tg.cancel_scope.cancel()
        with anyio.fail_after(15):
            await fork.discard()
        assert not _stray(sb, fork)
        # and a paused fork discarded between commands, with the session closed after
        other = await sb.fork()
        await other.pause()
    assert not _stray(sb, other)
    assert not _store_cgroups(sb)


async def test_discarding_a_paused_fork_whose_command_waits_to_start_ends_the_command(backend: str) -> None:
    # the command's task is not cancelled: the discard alone must end it (Docker: it waits
    # for a resume before its exec exists; overlay: it is frozen before its first instruction)
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        await fork.pause()
        outcome: dict[str, object] = {}

        async def run() -> None:
            try:
                outcome["result"] = await fork.run("echo ran > /tmp/ran; echo ran", timeout=5)
            except SandboxError as exc:
                outcome["error"] = exc

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.sleep(0.5)
                await fork.discard()
        assert outcome, "the command neither returned nor raised"
        assert "result" not in outcome or outcome["result"].output != "ran\n"  # type: ignore[attr-defined]
        assert not _stray(sb, fork)
        assert (await sb.run("cat /tmp/ran 2>/dev/null || echo none")).output == "none\n"


def _stray(sb: object, fork: object) -> bool:
    """Whether a process of ``fork``'s commands is still on the host."""
    if getattr(sb, "backend", "") == "overlay":
        return bool(marked_processes(f"aospec-{sb.store.id}-{fork.sid}-"))  # type: ignore[attr-defined]
    box = fork._box  # type: ignore[attr-defined]
    try:
        return bool(box.stray_pids())
    except Exception:
        return False


def _store_cgroups(sb: object) -> list[str]:
    if getattr(sb, "backend", "") != "overlay":
        return []
    _, cgroups = host_support()
    if cgroups is None:
        return []
    store = sb.store  # type: ignore[attr-defined]
    found = []
    for root in set(cgroups.roots.values()):
        found += [str(p) for p in (root / store.cgroup).rglob("aospec-*")]
    return found


async def test_closing_the_session_during_a_paused_command_leaves_nothing(overlay: str) -> None:
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=overlay)) as sb:
        marker = f"aospec-{sb.store.id}-"
        fork = await sb.fork()
        with anyio.move_on_after(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fork.run, "sleep 300")
                await _until(lambda: bool(marked_processes(marker)), "the command started")
                await fork.pause()
                await anyio.sleep_forever()
    await _until(lambda: not marked_processes(marker), "no process of the session is left", 15)


_CHILD = textwrap.dedent(
    """
    import anyio, sys
    from aospec.runtime import open_sandbox

    async def main():
        async with open_sandbox(backend="overlay") as sb:
            fork = await sb.fork()
            async with anyio.create_task_group() as tg:
                tg.start_soon(fork.run, "sleep 300 & sleep 300; wait")
                await anyio.sleep(1.0)
                await fork.pause()
                print(f"aospec-{sb.store.id}-", flush=True)
                await anyio.sleep_forever()

    anyio.run(main)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_session_leaves_frozen_processes_that_gc_removes(overlay: str, sig: int, tmp_path: Path) -> None:
    _needs_freezer()
    state_root = Path(os.environ["AOSPEC_STATE_ROOT"]) / f"killed-{sig}"
    env = {**os.environ, "AOSPEC_STATE_ROOT": str(state_root)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        marker = proc.stdout.readline().strip()
        assert marker.startswith("aospec-"), marker
        assert marked_processes(marker)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        time.sleep(0.5)
        # bubblewrap died with its session; the frozen command cannot die until thawed
        assert marked_processes(marker), "the frozen command died by itself: nothing left to test"
        deadline = time.monotonic() + 30
        while marked_processes(marker) and time.monotonic() < deadline:
            collect_garbage(state_root, docker=False)
            time.sleep(0.2)
        assert not marked_processes(marker), "frozen sandbox processes outlived gc"
        assert not collect_garbage(state_root, docker=False).state_dirs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_guess_that_times_out_at_background_priority_is_no_result(overlay: str) -> None:
    async with open_sandbox(SandboxConfig(backend=overlay, timeout_s=0.5)) as sb:
        fork = await sb.fork()
        await fork.set_priority(foreground=False)
        with pytest.raises(SandboxError, match="background priority"):
            await fork.execute(Action.bash("sleep 5"))
        # the same command in the foreground (the verified path) is an observation
        await fork.set_priority(foreground=True)
        assert "timed out" in (await fork.execute(Action.bash("sleep 5"))).lower()
        await fork.discard()


async def test_a_pause_at_any_moment_of_a_commands_start_neither_hangs_nor_loses_it(backend: str) -> None:
    # Docker: a container paused while its exec starts freezes runc init, and dockerd then
    # waits on it forever with the container locked; the pause must wait for the exec
    _needs_freezer()
    async with open_sandbox(SandboxConfig(backend=backend)) as sb:
        fork = await sb.fork()
        results: list[object] = []

        async def run() -> None:
            results.append(await fork.run("echo started", timeout=10))

        for delay in (0.0, 0.005, 0.02, 0.05, 0.1):
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    await anyio.sleep(delay)
                    await fork.pause()
                    await anyio.sleep(0.2)
                    await fork.resume()
            assert results[-1].output == "started\n", (delay, results[-1])  # type: ignore[attr-defined]
            assert not fork.paused
            if backend == "docker":  # no container left paused once its command ended
                assert not fork._box.frozen  # type: ignore[attr-defined]
        await fork.discard()
