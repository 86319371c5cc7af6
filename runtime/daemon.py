"""The local Docker daemon: a client of it, and whether it could checkpoint processes.

Kept apart from the docker backend so that base building (``image:NAME`` bases exported
from a local image) reaches the daemon without importing the backend, which imports the
bases.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from aospec._lazy import require
from aospec.errors import SandboxUnavailableError

__all__ = ["checkpoint_support", "docker_client"]


def docker_client() -> Any:
    """A docker SDK client of a reachable daemon, or SandboxUnavailableError saying why."""
    docker = require("docker", "docker", purpose="the docker sandbox backend")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as exc:
        raise SandboxUnavailableError(
            f"no Docker daemon is reachable ({type(exc).__name__}: {exc}); start dockerd "
            "(or set DOCKER_HOST), or use the overlay backend"
        ) from None
    return client


def checkpoint_support(client: Any | None = None) -> tuple[bool, str]:
    """Whether process checkpoint/restore (``docker checkpoint``) can work here, and why not."""
    own = client is None
    client = client or docker_client()
    reasons = []
    try:
        experimental = client.info().get("ExperimentalBuild")
    finally:
        if own:
            client.close()
    if not experimental:
        reasons.append("the Docker daemon is not in experimental mode (docker checkpoint needs it)")
    if shutil.which("criu") is None:
        reasons.append("criu is not installed")
    else:
        proc = subprocess.run(["criu", "check"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
            reasons.append(f"`criu check` fails on this kernel ({lines[0] if lines else proc.returncode})")
    return (not reasons), "; ".join(reasons) or "criu check passed and the daemon is experimental"
