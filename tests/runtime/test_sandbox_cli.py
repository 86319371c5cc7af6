"""``aospec sandbox``: exec, build-base, info, gc, and its one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from aospec.runtime._fs import mounts_under

ROOT = Path(__file__).resolve().parents[2]


def aospec(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_exec_prints_the_output_and_exits_with_the_commands_status(backend: str) -> None:
    proc = aospec("exec", "--backend", backend, "--", "echo", "hello world")
    assert (proc.returncode, proc.stdout) == (0, "hello world\n")
    assert f"[{backend}: exit 0" in proc.stderr
    proc = aospec("exec", "--backend", backend, "--format", "json", "--", "echo out; exit 3")
    assert proc.returncode == 3
    data = json.loads(proc.stdout)
    assert (data["output"], data["returncode"], data["version_before"]) == ("out\n", 3, data["version_after"])


def test_exec_applies_the_isolation_defaults_and_options(overlay: str) -> None:
    proc = aospec("exec", "--command-timeout", "1", "--", "sleep 10")
    assert proc.returncode == 124 and "timed out" in proc.stderr
    proc = aospec(
        "exec", "--pids", "16", "--memory", "64M", "--env", "A=b", "--workdir", "/tmp", "--", "echo $A $(pwd)"
    )
    assert proc.stdout == "b /tmp\n"
    proc = aospec("exec", "--", "cat /proc/net/dev | grep -c :")
    assert proc.stdout == "1\n"  # loopback only


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["exec", "--backend", "nope", "--", "true"], "unknown sandbox backend 'nope'"),
        (["exec", "--base", "/no/such/base", "--", "true"], "base directory '/no/such/base' does not exist"),
        (["exec"], "no command given"),
        (["exec", "--env", "NOEQUALS", "--", "true"], "expected K=V"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(overlay: str, args: list[str], message: str) -> None:
    proc = aospec(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith("aospec: error: ") and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_build_base_and_info(overlay: str) -> None:
    proc = aospec("build-base", "busybox", "--format", "json")
    assert proc.returncode == 0
    base = json.loads(proc.stdout)
    assert Path(base["path"], "bin", "busybox").exists() and len(base["version"]) == 32
    info = json.loads(aospec("info", "--format", "json").stdout)
    assert info["overlay_backend"] == "ok" and info["root"] is True
    assert "docker_checkpoint" in info or info["docker"].startswith("unavailable")


def test_gc_removes_what_a_killed_session_left(backend: str, runtime_dirs: dict[str, Path]) -> None:
    code = (
        "import anyio\nfrom runtime import open_sandbox\n"
        "async def main():\n"
        f"    async with open_sandbox(backend={backend!r}) as sb:\n"
        "        f = await sb.fork()\n        print('READY', sb.store.path, flush=True)\n"
        "        await f.run('sleep 600', timeout=900)\n"
        "anyio.run(main)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    state = Path(line.split()[1])
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert state.exists() and mounts_under(str(state))
    report = json.loads(aospec("gc", "--format", "json").stdout)
    assert str(state) in report["state_dirs"]
    assert not state.exists() and not mounts_under(str(state))
    if backend == "docker":
        assert len(report["containers"]) == 2
    assert json.loads(aospec("gc", "--format", "json").stdout)["state_dirs"] == []


def test_an_unreachable_docker_daemon_is_one_clear_error(overlay: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DOCKER_HOST="unix:///nonexistent/docker.sock")
    proc = subprocess.run(
        [sys.executable, "-m", "aospec", "sandbox", "exec", "--backend", "docker", "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("aospec: error: no Docker daemon is reachable")
    assert "start dockerd" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.docker
def test_a_docker_image_can_become_a_base(docker_backend: str) -> None:
    from aospec.runtime import open_base
    from aospec.runtime.daemon import docker_client
    from aospec.runtime.docker import ensure_base_image

    client = docker_client()
    image = ensure_base_image(client, open_base("busybox"))
    tag = client.images.get(image).tags[0]
    client.close()
    proc = aospec("build-base", f"image:{tag}", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(proc.stdout)
    assert Path(exported["path"], "bin", "busybox").exists()
    proc = aospec("exec", "--base", f"image:{tag}", "--", "cat /etc/os-release")
    assert "aospec busybox base" in proc.stdout


@pytest.mark.anyio
async def test_gc_of_another_state_root_never_kills_a_running_command(overlay: str, tmp_path: Path) -> None:
    # found by scripts/check_lossless.py: gc of root B removed the cgroups of a live
    # session under root A, SIGKILLing its command (exit 137, no output)
    from aospec.runtime import open_sandbox
    from aospec.runtime.gc import collect_garbage

    other_root = tmp_path / "other-root"
    other_root.mkdir()
    async with open_sandbox(backend="overlay") as sb:
        async with anyio.create_task_group() as tg:
            results = []

            async def command() -> None:
                results.append(await sb.run("touch /tmp/started; sleep 1; echo survived", timeout=60))

            tg.start_soon(command)
            with anyio.fail_after(60):
                while not (sb.root_path / "tmp" / "started").exists():
                    await anyio.sleep(0.02)
            await anyio.to_thread.run_sync(lambda: collect_garbage(other_root, docker=False))
        assert results[0].returncode == 0 and results[0].output == "survived\n"


@pytest.mark.anyio
async def test_gc_of_another_state_root_keeps_an_idle_live_stores_cgroup(overlay: str, tmp_path: Path) -> None:
    # found by a concurrent check_lossless + CI run: between two commands a live store's
    # cgroup holds no process, so gc of another root took it for a crashed store's and
    # removed it; a command starting at that moment was SIGKILLed (exit 137)
    from aospec.runtime import open_sandbox
    from aospec.runtime._state import store_alive
    from aospec.runtime.gc import collect_garbage
    from aospec.runtime.host import host_support

    _, cgroups = host_support()
    if cgroups is None:
        pytest.skip("no cgroups on this host")
    other_root = tmp_path / "other-root"
    other_root.mkdir()
    async with open_sandbox(backend="overlay") as sb:
        assert (await sb.run("true", timeout=60)).returncode == 0
        store_id = sb.store.id
        assert store_alive(store_id) is True
        dirs = [root / f"aospec-{store_id}" for root in set(cgroups.roots.values())]
        assert any(d.exists() for d in dirs)
        report = await anyio.to_thread.run_sync(lambda: collect_garbage(other_root, docker=False))
        assert not any(f"aospec-{store_id}" in c for c in report.cgroups)
        assert all(d.exists() for d in dirs if d.parent.exists()) and any(d.exists() for d in dirs)
        assert (await sb.run("echo still", timeout=60)).output == "still\n"
    assert store_alive(store_id) is None  # unregistered when it closed
