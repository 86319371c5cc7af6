"""Sandbox configuration: limits, binds and per-backend options (unknown keys rejected)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from aospec.config import from_mapping
from aospec.errors import ConfigError

__all__ = ["BIND_UNSAFE_CAPS", "DEFAULT_ENV", "Bind", "Limits", "SandboxConfig", "cap_name"]

GiB = 1 << 30
MiB = 1 << 20

#: The environment every sandbox command gets unless the configuration's ``env`` sets the
#: key (to ``""`` to unset its effect). ``PYTHONDONTWRITEBYTECODE=1``: Python writes no
#: ``__pycache__`` when a command merely imports or runs code, so a read-style command (a
#: test run, a script) leaves the version unchanged and speculative forks of later steps
#: stay reusable; timestamp-based bytecode would also make versions depend on when files
#: were edited, so serial and speculative runs of the same trajectory would end on
#: different versions (measured: scripts/bench_live.py, docs/runtime.md).
DEFAULT_ENV: Mapping[str, str] = MappingProxyType({"PYTHONDONTWRITEBYTECODE": "1"})


#: Capabilities a sandbox with a writable bind may not keep: with them a command could
#: still put privilege on the host through the bind, which the seccomp filter cannot
#: see (file capabilities are an extended attribute: CAP_SETFCAP; CAP_FSETID keeps the
#: set-ID bits of a file written to; CAP_SYS_ADMIN, or ALL of them).
BIND_UNSAFE_CAPS = frozenset({"CAP_SETFCAP", "CAP_FSETID", "CAP_SYS_ADMIN", "ALL"})


def cap_name(cap: str) -> str:
    """``sys_admin``, ``SYS_ADMIN``, ``CAP_SYS_ADMIN`` -> ``CAP_SYS_ADMIN`` (``ALL`` stays)."""
    upper = cap.strip().upper()
    return upper if upper == "ALL" or upper.startswith("CAP_") else f"CAP_{upper}"


@dataclass(frozen=True, slots=True)
class Limits:
    """Resource limits of every command (None: not limited).

    ``memory_bytes``, ``cpus`` and ``pids`` need a writable cgroup (v1 or v2) for the
    overlay backend; ``aospec sandbox info`` says which are enforced here. ``disk_bytes``
    caps what one sandbox may write (its upper directory lives on a tmpfs of that size,
    so what a command writes also counts toward its memory limit; None puts the upper on
    disk, unlimited). ``file_size_bytes`` (RLIMIT_FSIZE), ``open_files`` and
    ``cpu_time_s`` are rlimits.
    """

    memory_bytes: int | None = 4 * GiB
    cpus: float | None = 2.0
    pids: int | None = 512
    disk_bytes: int | None = 8 * GiB
    file_size_bytes: int | None = 2 * GiB
    open_files: int | None = 4096
    cpu_time_s: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None and v <= 0:
                raise ValueError(f"limits.{f.name} must be positive or null, got {v!r}")

    @classmethod
    def unlimited(cls) -> Limits:
        return cls(None, None, None, None, None, None, None)


@dataclass(frozen=True, slots=True)
class Bind:
    """A host path made visible inside the sandbox at ``target`` (read-only unless
    ``writable``). Nothing of the host is visible unless declared here."""

    source: str
    target: str
    writable: bool = False

    def __post_init__(self) -> None:
        if not self.target.startswith("/"):
            raise ValueError(f"bind target {self.target!r} must be an absolute path")

    @classmethod
    def parse(cls, spec: str) -> Bind:
        """``SRC:DST[:rw|ro]``"""
        parts = spec.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("rw", "ro")):
            raise ConfigError(f"bind {spec!r}: expected SRC:DST[:rw|ro]")
        return cls(parts[0], parts[1], len(parts) == 3 and parts[2] == "rw")


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """How to build a sandbox session.

    ``state_dir``: where layers, HEAD and mounts live. None: a private directory removed
    on close. Given: a persistent store reopened (and recovered) by the next open.
    ``timeout_s`` is the default per-command timeout; ``formatter`` turns a bash result
    into the text ``execute`` returns: ``raw`` (the default: the output alone, favouring
    no harness), ``mini-swe-agent`` (a harness's template, see
    ``aospec.runtime.observation``) or a dotted path.
    ``compact_at`` bounds the depth of a layer stack; frozen changes stay in memory
    (tmpfs) until they exceed ``memory_layers_bytes`` (0: always on disk); ``durable``
    keeps the committed state on disk and fsyncs it (survives power loss, slower).
    ``docker_fork``: how the docker backend forks (``auto`` picks copy-upper).

    ``env`` is added to :data:`DEFAULT_ENV` (``PYTHONDONTWRITEBYTECODE=1``), which it
    may override.

    ``memory_budget_bytes`` bounds the host memory the whole session (the root and all
    its forks, across commands) holds: their processes and every in-memory layer they
    wrote (uppers on tmpfs, frozen memory layers). ``sandbox_memory_budget_bytes`` bounds
    one sandbox the same way (None: only the session's budget). A write past a budget
    fails: the command is killed (``limits_hit`` names ``memory``). Overlay backend, with
    a writable memory cgroup. ``seccomp``: the overlay backend's syscall filter,
    ``default``, ``none`` or the path of a JSON profile (``aospec.runtime.seccomp``).

    ``read_sets``: ``auto`` (default) records what speculative forks read where the tracer
    works (strace; not with ``network``), so the engine can reuse a fork across commits that
    did not touch it (docs/engine.md, "Read sets"); ``off``; ``all`` also traces every other
    command, the committed steps' included (for recordings: it slows them). Overlay backend.
    """

    backend: str = "overlay"
    base: str = "busybox"
    state_dir: str | None = None
    network: bool = False
    limits: Limits = field(default_factory=Limits)
    timeout_s: float = 30.0
    workdir: str = "/"
    env: Mapping[str, str] = field(default_factory=lambda: DEFAULT_ENV)
    binds: tuple[Bind, ...] = ()
    cap_add: tuple[str, ...] = ()
    formatter: str = "raw"
    max_output_bytes: int = 8 * MiB
    durable: bool = False
    compact_at: int = 16
    memory_layers_bytes: int = 512 * MiB
    docker_fork: str = "auto"
    memory_budget_bytes: int | None = 8 * GiB
    sandbox_memory_budget_bytes: int | None = None
    seccomp: str = "default"
    read_sets: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.env, Mapping):
            raise ValueError(f"env must be a mapping, got {type(self.env).__name__}")
        object.__setattr__(self, "env", MappingProxyType({**DEFAULT_ENV, **self.env}))
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir {self.workdir!r} must be an absolute path")
        if self.compact_at < 4:
            raise ValueError("compact_at must be at least 4")
        if self.memory_layers_bytes < 0:
            raise ValueError("memory_layers_bytes must be >= 0")
        for name in ("memory_budget_bytes", "sandbox_memory_budget_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive number of bytes or null, got {v!r}")
        if self.memory_budget_bytes is not None and self.memory_layers_bytes >= self.memory_budget_bytes:
            raise ValueError(
                f"memory_layers_bytes ({self.memory_layers_bytes}) must be below memory_budget_bytes "
                f"({self.memory_budget_bytes}): frozen changes spill to disk past the first, the second is a hard cap"
            )
        if not isinstance(self.seccomp, str) or not self.seccomp:
            raise ValueError("seccomp must be default, none or the path of a JSON profile")
        if self.read_sets not in ("auto", "off", "all"):
            raise ValueError(f"read_sets must be auto, off or all, got {self.read_sets!r}")
        if self.docker_fork not in ("auto", "commit", "copy-upper"):
            raise ValueError(f"docker_fork must be auto, commit or copy-upper, got {self.docker_fork!r}")
        if self.writable_binds:
            # what a command writes on a writable bind is on the host at once: the seccomp
            # filter is what keeps set-ID bits and device nodes off it (docs/runtime.md)
            unsafe = sorted({cap_name(c) for c in self.cap_add} & BIND_UNSAFE_CAPS)
            if unsafe:
                raise ValueError(
                    f"cap_add {', '.join(unsafe)} with a writable bind would let a command put privileged files "
                    "on the host (file capabilities, set-ID bits); drop it or make the binds read-only"
                )
            if self.seccomp == "none":
                raise ValueError(
                    "seccomp: none with a writable bind: the filter is what keeps set-ID bits and device nodes "
                    "off the host; keep the filter or make the binds read-only"
                )

    @property
    def writable_binds(self) -> bool:
        """Whether any bind is writable (the sandbox then runs under the bind rules of
        :func:`aospec.runtime.seccomp.bind_rules`)."""
        return any(b.writable for b in self.binds)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = "sandbox") -> SandboxConfig:
        """Build from plain data (YAML/JSON); nested ``limits`` and ``binds`` included."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        if "limits" in data and not isinstance(data["limits"], Limits):
            data["limits"] = from_mapping(Limits, data["limits"], where=f"{where}.limits")
        if "binds" in data:
            binds = []
            for i, b in enumerate(data["binds"]):
                if isinstance(b, Bind):
                    binds.append(b)
                elif isinstance(b, str):
                    binds.append(Bind.parse(b))
                else:
                    binds.append(from_mapping(Bind, b, where=f"{where}.binds[{i}]"))
            data["binds"] = tuple(binds)
        if "env" in data:
            if not isinstance(data["env"], Mapping):
                raise ConfigError(f"{where}: key 'env' must be a mapping")
            data["env"] = MappingProxyType({str(k): str(v) for k, v in data["env"].items()})
        return from_mapping(cls, data, where=where)

    def replace(self, **changes: Any) -> SandboxConfig:
        return dataclasses.replace(self, **changes)
