"""What the overlay and docker sandboxes share: the bash-action entry point, the checks
around commit, and the ``async with`` lifecycle. Backend state lives in the subclasses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import anyio
from aospec.runtime._files import check_path
from aospec.runtime._state import new_id
from aospec.runtime.isolation import DEFAULT_PATH
from aospec.runtime.observation import CommandResult, ObservationFormatter
from aospec.runtime.versions import EMPTY_LAYER, Layer

from aospec.errors import SandboxError
from aospec.types import Action


class SandboxSession:
    """Base of the concrete sandbox classes (not a protocol: the Sandbox seam stays
    structural). Subclasses set ``store``, ``sid``, ``_lineage``, ``_formatter``,
    ``_closed``, ``_lock``, ``is_root`` and implement ``run``, ``_close_root`` and ``_release``."""

    backend = "sandbox"
    store: Any
    sid: str
    _lineage: tuple[str, ...]
    _formatter: ObservationFormatter
    _closed: bool
    _lock: anyio.Lock
    is_root: bool

    def _init_session(
        self, store: Any, *, version: str, is_root: bool, formatter: ObservationFormatter, lineage: tuple[str, ...]
    ) -> None:
        """Set the fields every sandbox has; the subclass registers in ``store.live`` last."""
        self.store = store
        self.sid = new_id()
        self.is_root = is_root
        self._version = version
        self._formatter = formatter
        self._lineage = lineage  # sids of the sandboxes this one was forked from
        self._lock = anyio.Lock()
        self._closed = False
        self.last_layer: Layer = EMPTY_LAYER

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run ``command`` with bash in the sandbox; returns its CommandResult. ``timeout``
        (seconds), ``env`` and ``cwd`` default to the sandbox's configuration."""
        self._check_open()
        cfg = self.store.config
        full_env = self._command_env(env)
        _check_no_nul(command, full_env, cwd)
        async with self._lock:
            self._check_open()
            timeout_s = timeout if timeout is not None else cfg.timeout_s
            return await self._run_locked(command, timeout_s=timeout_s, env=full_env, cwd=cwd or cfg.workdir)

    async def _run_locked(self, command: str, *, timeout_s: float, env: dict[str, str], cwd: str) -> CommandResult:
        """The backend's run, with the sandbox's lock held and the defaults filled in."""
        raise NotImplementedError

    def _command_env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        """A command's environment: PATH and HOME, then the sandbox's, then the call's."""
        return {"PATH": DEFAULT_PATH, "HOME": "/root", **self.store.config.env, **(env or {})}

    async def aclose(self) -> None:
        """Close: a fork is discarded; the root discards its live forks, then releases the
        whole store (shielded: a close interrupted halfway would leak them)."""
        if not self.is_root:
            await self.discard()
            return
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            for child in list(self.store.live.values()):
                if child is not self:
                    await child.discard()
            self._stop_paused_command()
            async with self._lock:
                self._closed = True
                await anyio.to_thread.run_sync(self._close_root)

    def _close_root(self) -> None:
        """Release the root's backend resources and the store (blocking, in a worker thread)."""
        raise NotImplementedError

    async def _release(self) -> None:
        """Free a discarded fork's backend resources (called once, shielded, under its lock)."""
        raise NotImplementedError

    def _stop_paused_command(self) -> None:
        """Before a discard or close waits for the sandbox's lock: kill a command frozen in
        it (a paused sandbox's command would never end, and the discard wait forever)."""

    async def discard(self) -> None:
        """Throw this sandbox (a fork) and its own forks away; the root closes the session."""
        if self._closed:
            return
        if self.is_root:
            await self.aclose()
            return
        # shielded: a discard interrupted halfway would leak mounts or containers
        with anyio.CancelScope(shield=True):
            for child in [sb for sb in self.store.live.values() if self.sid in sb._lineage]:
                await child.discard()
            self._stop_paused_command()
            async with self._lock:
                if self._closed:
                    return
                self._closed = True
                self.store.live.pop(self.sid, None)
                await self._release()

    async def execute(self, action: Action) -> str:
        """Run a ``bash`` action; the observation text comes from the formatter.

        A command that ran at background priority (a guess: starved of CPU by design, in
        the host's speculation budget) and ran into its timeout or a memory limit raises
        SandboxError instead: serial execution, in the foreground, might not have, so the
        result is not one the engine may reuse (it runs the step itself instead)."""
        if action.is_none:
            return ""  # a reply without a tool call: nothing runs, the state is unchanged
        command = action.command
        if command is None:
            raise SandboxError(f"the {self.backend} sandbox runs bash actions only, not tool {action.tool!r}")
        background = self._in_background()
        result = await self.run(command)
        background = background or self._in_background()
        starved = [what for what in ("timeout", "memory") if what in result.limits_hit]
        if background and starved:
            raise SandboxError(
                f"the command ran into its {' and '.join(starved)} limit at background priority: not necessarily "
                "what it does in the foreground (serial execution), so this speculative result is not used"
            )
        return self._formatter.format(action, result)

    def _in_background(self) -> bool:
        """Whether this sandbox's commands run at background priority now."""
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox was already discarded, committed or closed")

    def _check_fork_committable(self, fork: object) -> None:
        """Raise unless ``fork`` is a live fork (at any depth) of this sandbox."""
        if type(fork) is not type(self) or fork.store is not self.store:  # type: ignore[attr-defined]
            raise SandboxError("commit: the fork does not belong to this sandbox's store")
        self._check_fork_live(fork)
        if self.sid not in fork._lineage:  # type: ignore[attr-defined]
            raise SandboxError("commit: the sandbox was not forked from this one")

    @staticmethod
    def _check_fork_live(fork: Any) -> None:
        if fork._closed:
            raise SandboxError("commit: the fork was already committed or discarded")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _check_no_nul(command: str, env: Mapping[str, str], cwd: str | None) -> None:
    """SandboxError when a command, environment entry or working directory holds a NUL
    byte: no command line, environment or path can carry one (the kernel would cut it)."""
    if "\0" in command:
        raise SandboxError("the command contains a NUL byte, which no command line can carry")
    for k, v in env.items():
        if "\0" in k or "\0" in v or "=" in k:
            raise SandboxError(f"environment variable {k!r}: a name or value with a NUL byte (or a name with '=')")
    if cwd is not None:
        check_path(cwd, "working directory")
