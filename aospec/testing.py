"""Small real implementations of the seams, shipped for tests and examples (no mocks).

- :class:`InMemorySandbox`: a tiny shell over an in-memory filesystem, with real
  copy-on-write-style forks and hash-chained versions (``H(parent, H(changes))``; a
  command that changes nothing keeps the version).
- :class:`ScriptedActor`: an actor that is a function of its history (losslessness needs
  exactly that), with a configurable decode delay.
- :class:`ScriptedObservationDrafter`, :class:`ScriptedActionDrafter`: drafters backed by
  plain functions, with a configurable drafting delay.
- :class:`FitRecorder`: a trainable observation drafter that proposes nothing and records
  which traces it was fit on (to check train/eval separation).

The shell understands commands joined by ``&&``: ``sleep S``, ``echo TEXT > PATH``,
``echo TEXT >> PATH``, ``cat PATH``, ``ls``, ``rm PATH``, ``true``. A command that fails
stops the chain (like ``&&``); the observation is ``<returncode>N</returncode>`` plus the
output, mini-swe-agent style.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import anyio
import xxhash

from aospec.errors import SandboxError
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.types import Action, History, Trace, canonical_json, version_hash

__all__ = [
    "FitRecorder",
    "InMemorySandbox",
    "ScriptedActionDrafter",
    "ScriptedActor",
    "ScriptedObservationDrafter",
]


class InMemorySandbox:
    """An in-memory filesystem sandbox with forks and hash-chained versions.

    ``op_delay_s`` is slept before each command runs (plus whatever ``sleep`` asks for), so
    executions take real (or virtual) time. ``stats`` of the root counts forks opened and
    released, so tests can check nothing leaks.
    """

    def __init__(self, files: Mapping[str, str] | None = None, *, op_delay_s: float = 0.0) -> None:
        self._files: dict[str, str] = dict(files or {})
        self._version = version_hash("root", canonical_json(sorted(self._files.items())))
        self.op_delay_s = op_delay_s
        self._root: InMemorySandbox = self
        self._closed = False
        self._busy = False
        self.forks_opened = 0
        self.forks_released = 0

    @property
    def version(self) -> str:
        return self._version

    @property
    def files(self) -> dict[str, str]:
        """A copy of the current filesystem."""
        return dict(self._files)

    @property
    def live_forks(self) -> int:
        """Forks of this (root) sandbox not yet committed or discarded."""
        return self._root.forks_opened - self._root.forks_released

    def _check(self) -> None:
        if self._closed:
            raise SandboxError("sandbox was discarded or committed")

    async def execute(self, action: Action) -> str:
        self._check()
        if self._busy:
            raise SandboxError("execute while another execute is in flight")
        self._busy = True
        try:
            if self.op_delay_s:
                await anyio.sleep(self.op_delay_s)
            if action.is_none:
                return "No tool call found in the reply."
            command = action.command
            if command is None:
                return f"<returncode>127</returncode>\n<output>\nunknown tool {action.tool}\n</output>"
            files = dict(self._files)
            out: list[str] = []
            code = 0
            for part in command.split("&&"):
                code = await self._run(part.strip(), files, out)
                if code:
                    break
            changes = sorted(
                (p, files.get(p)) for p in set(files) | set(self._files) if files.get(p) != self._files.get(p)
            )
            if changes:
                self._version = version_hash(self._version, canonical_json(changes))
                self._files = files
            return f"<returncode>{code}</returncode>\n<output>\n{''.join(out)}</output>"
        finally:
            self._busy = False

    async def _run(self, cmd: str, files: dict[str, str], out: list[str]) -> int:
        try:
            words = shlex.split(cmd)
        except ValueError as exc:
            out.append(f"parse error: {exc}\n")
            return 2
        if not words or words == ["true"]:
            return 0
        name, args = words[0], words[1:]
        if name == "sleep" and len(args) == 1:
            await anyio.sleep(float(args[0]))
            return 0
        if name == "ls" and not args:
            out.extend(f"{p}\n" for p in sorted(files))
            return 0
        if name == "cat" and len(args) == 1:
            if args[0] not in files:
                out.append(f"cat: {args[0]}: No such file or directory\n")
                return 1
            out.append(files[args[0]])
            return 0
        if name == "rm" and len(args) == 1:
            if files.pop(args[0], None) is None:
                out.append(f"rm: cannot remove '{args[0]}': No such file or directory\n")
                return 1
            return 0
        if name == "echo" and len(args) >= 3 and args[-2] in (">", ">>"):
            text = " ".join(args[:-2]) + "\n"
            path = args[-1]
            files[path] = (files.get(path, "") + text) if args[-2] == ">>" else text
            return 0
        out.append(f"{name}: command not found\n")
        return 127

    async def fork(self) -> InMemorySandbox:
        self._check()
        if self._busy:
            raise SandboxError("fork while an execute is in flight")
        child = InMemorySandbox.__new__(InMemorySandbox)
        child._files = dict(self._files)
        child._version = self._version
        child.op_delay_s = self.op_delay_s
        child._root = self._root
        child._closed = False
        child._busy = False
        child.forks_opened = child.forks_released = 0
        self._root.forks_opened += 1
        return child

    async def commit(self, fork: InMemorySandbox) -> None:
        self._check()
        fork._check()
        if fork._root is not self._root:
            raise SandboxError("commit of a fork from another sandbox")
        self._files = fork._files
        self._version = fork._version
        fork._closed = True
        self._root.forks_released += 1

    async def discard(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._root is not self:
            self._root.forks_released += 1


class ScriptedActor:
    """An actor whose next action is ``choose(history)``, after ``delay(history)`` seconds.

    ``choose`` must be a pure function of the history (the engine's losslessness relies on
    it). ``calls`` counts decodes started (including cancelled ones).
    """

    def __init__(self, choose: Callable[[History], Action], delay_s: float | Callable[[History], float] = 0.0) -> None:
        self.choose = choose
        self.delay_s = delay_s
        self.calls = 0

    @classmethod
    def hashing(
        cls, pool: Sequence[Action], *, seed: int = 0, delay_s: float | Callable[[History], float] = 0.0
    ) -> ScriptedActor:
        """An actor picking from ``pool`` by a hash of the whole history (so every drafted
        observation that differs from the real one leads somewhere else)."""
        actions = tuple(pool)
        if not actions:
            raise ValueError("pool must not be empty")

        def choose(history: History) -> Action:
            digest = xxhash.xxh3_64_intdigest(
                "\x1e".join(
                    [str(seed), history.task, *(f"{t.action.key}\x1f{t.observation}" for t in history.turns)]
                ).encode()
            )
            return actions[digest % len(actions)]

        return cls(choose, delay_s)

    async def decode(self, history: History) -> Action:
        self.calls += 1
        delay = self.delay_s(history) if callable(self.delay_s) else self.delay_s
        if delay:
            await anyio.sleep(delay)
        return self.choose(history)


class ScriptedObservationDrafter:
    """Candidate observations from ``propose(history, action)``, after ``delay_s``."""

    def __init__(self, propose: Callable[[History, Action], Sequence[ObservationDraft]], delay_s: float = 0.0) -> None:
        self.propose = propose
        self.delay_s = delay_s

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return list(self.propose(history, action))[:n]


class ScriptedActionDrafter:
    """Candidate target actions from ``propose(history)``, after ``delay_s``."""

    def __init__(self, propose: Callable[[History], Sequence[ActionDraft]], delay_s: float = 0.0) -> None:
        self.propose_fn = propose
        self.delay_s = delay_s

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        return [d for d in self.propose_fn(history) if d.offset < depth][:width]


class FitRecorder:
    """Trainable observation drafter that proposes nothing; ``FitRecorder.fits`` lists the
    trace ids of every ``fit`` call in this process."""

    fits: ClassVar[list[tuple[str, ...]]] = []

    def fit(self, traces: Sequence[Trace]) -> None:
        FitRecorder.fits.append(tuple(t.id for t in traces))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        return []
