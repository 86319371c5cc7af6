"""Fixtures for the sandbox runtime tests: a private base cache and state root, and the
backends this host can run (a backend that cannot run skips with the reason)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aospec.runtime import SandboxConfig, open_sandbox
from aospec.runtime._fs import mounts_under
from aospec.runtime.host import host_support

from aospec.errors import SandboxUnavailableError

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session", autouse=True)
def runtime_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Bases are built into a per-session cache; private state dirs go to a session root."""
    cache = tmp_path_factory.mktemp("aospec-cache")
    state = tmp_path_factory.mktemp("aospec-state")
    mp = pytest.MonkeyPatch()
    mp.setenv("AOSPEC_CACHE_DIR", str(cache))
    mp.setenv("AOSPEC_STATE_ROOT", str(state))
    yield {"cache": cache, "state": state}
    mp.undo()
    leaked = mounts_under(str(state))
    assert not leaked, f"mounts leaked by the runtime tests: {leaked}"


@pytest.fixture(scope="session")
def probe_dir() -> Iterator[Path]:
    """tests/runtime/setid_probe.c built static (any base runs it), in a directory every user
    can reach (it is run on the host as nobody too)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (apt-get install gcc libc6-dev; .ci/run installs them)")
    d = Path(tempfile.mkdtemp(prefix="aospec-probe-", dir="/tmp"))
    d.chmod(0o755)
    proc = subprocess.run(
        [gcc, "-static", "-O1", "-o", str(d / "setid_probe"), str(HERE / "setid_probe.c")], capture_output=True, text=True
    )
    if proc.returncode != 0:
        shutil.rmtree(d)
        pytest.skip(f"cannot build a static test program (apt-get install libc6-dev): {proc.stderr.strip()[-300:]}")
    yield d
    shutil.rmtree(d)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def overlay_skip_reason() -> str | None:
    support, _ = host_support()
    problems = support.problems()
    return "; ".join(problems) if problems else None


_docker_reason: list[str | None] = []


def docker_skip_reason() -> str | None:
    if not _docker_reason:
        try:
            from aospec.runtime.daemon import docker_client

            client = docker_client()
            driver = client.info().get("Driver")
            reason = None if driver == "overlay2" else f"the Docker daemon uses storage driver {driver!r}, not overlay2"
            if os.geteuid() != 0:
                reason = "the docker backend reads container layers on the host and needs root"
        except SandboxUnavailableError as exc:
            reason = str(exc)
        _docker_reason.append(reason)
    return _docker_reason[0]


def skip_unless(backend: str) -> None:
    reason = overlay_skip_reason() if backend == "overlay" else docker_skip_reason()
    if reason:
        pytest.skip(f"{backend} backend cannot run here: {reason}")


@pytest.fixture(params=["overlay", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request: pytest.FixtureRequest) -> str:
    skip_unless(request.param)
    return str(request.param)


@pytest.fixture
def overlay() -> str:
    skip_unless("overlay")
    return "overlay"


@pytest.fixture
def docker_backend() -> str:
    skip_unless("docker")
    return "docker"


@pytest.fixture
async def sandbox(backend: str) -> AsyncIterator[object]:
    """A fresh committed sandbox of each backend with default isolation."""
    async with open_sandbox(SandboxConfig(backend=backend, timeout_s=20)) as sb:
        yield sb
