"""Sandboxes for aospec: copy-on-write forks versioned by a content root hash.

::

    from aospec.runtime import open_sandbox

    async with open_sandbox(backend="overlay", base="busybox") as sb:   # the committed root
        obs = await sb.execute(Action.bash("echo hi > /tmp/x"))           # observation text
        fork = await sb.fork()                                            # isolated CoW child
        result = await fork.run("cat /tmp/x", timeout=5)                  # CommandResult
        if fork.version != sb.version: ...                                # one comparison
        await sb.commit(fork)        # or: await fork.discard()

Backends (``backend=``, or a dotted path): ``overlay`` (overlayfs layers + bubblewrap,
the default) and ``docker`` (containers of a local daemon). Both satisfy
:class:`aospec.protocols.Sandbox`. See docs/runtime.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from aospec.runtime._state import RecoveryReport, default_state_root
from aospec.runtime.bases import BaseFS, build_base, cache_dir, open_base
from aospec.runtime.budget import (
    KernelBudget,
    clear_speculation_budget,
    set_speculation_budget,
    speculation_budget,
)
from aospec.runtime.config import Bind, Limits, SandboxConfig
from aospec.runtime.observation import (
    CommandResult,
    MiniSweAgentFormatter,
    ObservationFormatter,
    RawFormatter,
    SandboxStatistics,
    get_formatter,
)
from aospec.runtime.versions import EMPTY_LAYER, Layer, UpperTracker, base_version, chain_version, hash_file, tree_layer

from aospec._lazy import import_object
from aospec.errors import ConfigError

__all__ = [
    "BACKENDS",
    "EMPTY_LAYER",
    "BaseFS",
    "Bind",
    "CommandResult",
    "Layer",
    "Limits",
    "MiniSweAgentFormatter",
    "ObservationFormatter",
    "RawFormatter",
    "RecoveryReport",
    "SandboxConfig",
    "SandboxStatistics",
    "KernelBudget",
    "UpperTracker",
    "base_version",
    "build_base",
    "cache_dir",
    "chain_version",
    "clear_speculation_budget",
    "default_state_root",
    "get_formatter",
    "hash_file",
    "open_base",
    "open_sandbox",
    "set_speculation_budget",
    "speculation_budget",
    "tree_layer",
]

#: Sandbox backends by short name (any "package.module:function" works too); each value
#: is an async context manager factory taking a SandboxConfig.
BACKENDS = {
    "overlay": "aospec.runtime.overlay:open_overlay",
    "docker": "aospec.runtime.docker:open_docker",
}


def open_sandbox(
    config: SandboxConfig | Mapping[str, Any] | None = None, **overrides: Any
) -> AbstractAsyncContextManager[Any]:
    """Open a sandbox session of ``config.backend``; use as ``async with``.

    ``config`` may be a SandboxConfig or plain data (unknown keys are rejected); keyword
    arguments override single fields. The yielded object is the committed sandbox.
    """
    if config is None:
        config = SandboxConfig()
    elif not isinstance(config, SandboxConfig):
        config = SandboxConfig.from_mapping(config)
    if overrides:
        config = SandboxConfig.from_mapping(
            {**{f: getattr(config, f) for f in config.__dataclass_fields__}, **overrides}
        )
    opener = import_object(config.backend, BACKENDS, "sandbox backend")
    if not callable(opener):
        raise ConfigError(f"sandbox backend {config.backend!r} is not a callable opener (it is {type(opener).__name__})")
    try:
        session = opener(config)
    except TypeError as exc:
        raise ConfigError(f"sandbox backend {config.backend!r} cannot be called with a SandboxConfig: {exc}") from None
    if not isinstance(session, AbstractAsyncContextManager):
        # a dotted path to anything else (os:system ran with the configuration as its
        # argument): not a sandbox
        raise ConfigError(
            f"sandbox backend {config.backend!r} returned {type(session).__name__}, not an async context manager: "
            "a backend is a function of a SandboxConfig that `async with` opens (see BACKENDS)"
        )
    return session
