"""aospec: co-speculation of tool actions and observations for LLM agents.

The public API is what this module exports.
"""

from aospec.errors import (
    AospecError,
    ConfigError,
    DrafterError,
    EngineError,
    FailedAfterCommitError,
    FileTooLargeError,
    MissingDependencyError,
    SandboxError,
    SandboxUnavailableError,
    StateUnknownError,
    TraceFormatError,
    TraceImportError,
)
from aospec.protocols import (
    ActionDraft,
    ActionDrafter,
    Actor,
    Clock,
    Kernel,
    ObservationDraft,
    ObservationDrafter,
    Sandbox,
    StreamingObservationDrafter,
    Trainable,
)
from aospec.types import SCHEMA_VERSION, Action, Effect, History, Step, Trace, Turn, canonical_json
from aospec.wrappers import SandboxWrapper

__version__ = "0.1.0"

# The engine pulls in numpy; it is exported lazily so that `aospec --help` stays fast.
_LAZY = {
    "Engine": "aospec.engine",
    "EngineConfig": "aospec.engine_config",
    "EngineStatistics": "aospec.ledger",
    "Session": "aospec.session",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aospec' has no attribute {name!r}")


__all__ = [
    "SCHEMA_VERSION",
    "Action",
    "ActionDraft",
    "ActionDrafter",
    "Actor",
    "AospecError",
    "Clock",
    "ConfigError",
    "DrafterError",
    "Effect",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStatistics",
    "FailedAfterCommitError",
    "FileTooLargeError",
    "History",
    "Kernel",
    "MissingDependencyError",
    "ObservationDraft",
    "ObservationDrafter",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailableError",
    "SandboxWrapper",
    "Session",
    "StateUnknownError",
    "Step",
    "StreamingObservationDrafter",
    "Trace",
    "TraceFormatError",
    "TraceImportError",
    "Trainable",
    "Turn",
    "__version__",
    "canonical_json",
]
