"""The one exception tree of aospec.

::

    AospecError                      base of everything aospec raises on purpose
    ├── ConfigError                  unknown or invalid configuration keys/values
    ├── TraceFormatError             a malformed trace file or record (names file, line, field)
    │   └── TraceImportError         several files failed to import (carries every error)
    ├── MissingDependencyError       an optional extra is not installed (names the pip command);
    │                                also an ImportError
    ├── SandboxError                 a sandbox operation failed
    │   ├── SandboxUnavailableError  the backend cannot run here (privileges, overlayfs,
    │   │                            dockerd, base image) and says what to do
    │   ├── FileTooLargeError        read_file(path, max_bytes=) refused a larger file
    │   │                            (``path``, ``size``, ``limit``), before reading it
    │   ├── NodeLostError            the Ray node holding a sandbox session died (``node_id``)
    │   └── ClusterFullError         no Ray node had room for a session or fork in time
    ├── DrafterError                 a drafter backend failed or is misconfigured
    ├── ActorError                   a model endpoint or local model failed (``url``, ``status``,
    │                                ``body``)
    ├── EngineError                  an engine invariant broke (e.g. losslessness), or a call
    │   │                            out of order
    │   ├── FailedAfterCommitError   a step was committed, then something failed: the verified
    │   │                            history holds the step; do not retry it
    │   └── StateUnknownError        the committed sandbox's state is unknown, or not the
    │                                verified history's: retrying the step is unsafe
    ├── SweepTaskError               a sweep item failed on every try (names trace, policies, TPOTs)
    ├── CommandLoadError             an ``aospec.commands`` entry point failed to load
    └── TransportError               an artifact transport request failed
        ├── UnknownTokenError        no live artifact has that token; also a LookupError
        └── ProducerGoneError        the producer's server cannot be reached; also a ConnectionError

Each class is defined beside the code that raises it, and imports from there:
``NodeLostError``, ``ClusterFullError`` in :mod:`aospec.runtime.ray_backend`;
``ActorError`` in :mod:`aospec.live.chat`; ``SweepTaskError`` in
:mod:`aospec.replay.executors`; ``CommandLoadError`` in :mod:`aospec.cli`; the
``TransportError`` family in :mod:`aospec.specbox.transport`; the rest here.

An error on the engine's verified path (docs/engine.md, Faults) is raised as itself, with a
note naming the step, when the verified history and the committed sandbox still agree (the
step may be retried); as :class:`FailedAfterCommitError` or :class:`StateUnknownError`
(the original error as ``__cause__``) when they do not.

A command-line run turns any of these into one line on stderr and exit status 2.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AospecError",
    "ConfigError",
    "DrafterError",
    "EngineError",
    "FailedAfterCommitError",
    "FileTooLargeError",
    "MissingDependencyError",
    "SandboxError",
    "SandboxUnavailableError",
    "StateUnknownError",
    "TraceFormatError",
    "TraceImportError",
    "single_leaf",
]


class AospecError(Exception):
    """Base class of every error aospec raises on purpose."""


class ConfigError(AospecError):
    """A configuration has an unknown key or an invalid value."""


class TraceFormatError(AospecError):
    """A trace file or record is malformed.

    ``path``, ``line`` (1-based line or record number) and ``field`` locate the problem;
    any of them may be ``None`` when it does not apply.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = self.path or "<input>"
        if self.line is not None:
            where += f":{self.line}"
        if self.field is not None:
            where += f": field {self.field!r}"
        return f"{where}: {self.message}"


class TraceImportError(TraceFormatError):
    """Importing files failed; ``errors`` holds one TraceFormatError per bad file.

    The message is the one error on one line, or a count followed by the first
    ``MAX_LISTED`` errors and the number left out; ``hint`` (optional) says what to do.
    """

    MAX_LISTED = 20

    def __init__(self, errors: Sequence[TraceFormatError], *, hint: str | None = None) -> None:
        self.errors = tuple(errors)
        self.hint = hint
        note = f" ({hint})" if hint else ""
        if len(self.errors) == 1:
            lines = [f"{self.errors[0]}{note}"]
        else:
            lines = [f"{len(self.errors)} file(s) could not be imported{note}:"]
            lines += [f"  {e}" for e in self.errors[: self.MAX_LISTED]]
            if len(self.errors) > self.MAX_LISTED:
                lines.append(f"  ... and {len(self.errors) - self.MAX_LISTED} more")
        self.message = "\n".join(lines)
        self.path = self.line = self.field = None
        Exception.__init__(self, self.message)

    def _render(self) -> str:
        return self.message


class MissingDependencyError(AospecError, ImportError):
    """An optional dependency is missing; the message names the install command."""


class SandboxError(AospecError):
    """A sandbox operation failed."""


class SandboxUnavailableError(SandboxError):
    """The sandbox backend cannot run on this host; the message says what to do."""


class FileTooLargeError(SandboxError):
    """A file read from a sandbox with a size limit is larger than the limit (found from
    its ``fstat`` before any byte was read). ``path``, ``size`` and ``limit`` let a caller
    word its own message."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        self.path, self.size, self.limit = path, size, limit
        super().__init__(f"{path} is {size} bytes, over the {limit}-byte limit")

    def __reduce__(self) -> tuple[type[FileTooLargeError], tuple[str, int, int]]:
        return type(self), (self.path, self.size, self.limit)  # picklable (Ray, processes)


class DrafterError(AospecError):
    """A drafter backend failed or is misconfigured."""


class EngineError(AospecError):
    """An engine invariant was violated, or the engine was called out of order."""


class FailedAfterCommitError(EngineError):
    """A step was committed, then something failed: the backend's ``commit`` raised after it
    took effect, or the engine's own work after the commit did (adopting a continuation,
    the ledger). The verified history holds the step and the committed sandbox is at its
    state, so the step must not be executed again. ``step`` is its index in the verified
    history; the error that was raised is ``__cause__``."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class StateUnknownError(EngineError):
    """The committed sandbox's state is unknown, or known to differ from the verified
    history's: a failed commit left it at a version that is neither the one before nor the
    fork's (or its version cannot be read), or, without forks, the step failed on the
    committed sandbox itself after changing it. Retrying the step is unsafe. ``step`` is
    the index of the step that failed; the error that was raised is ``__cause__``."""

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


def single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception a task group failed with (None when there were several): what a
    caller raises instead of the group, so errors keep their own type."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc
