"""Core value types: actions, histories, steps and traces.

Everything here is immutable and cheap to compare. Two actions are equal exactly when
their canonical serialisations (``Action.key``) are equal: same tool name and the same
JSON arguments, with object keys sorted. A shell command is the tool ``bash`` with
arguments ``{"command": ...}``; the command text is kept byte for byte (never
normalised), because a reused speculative result must be for exactly the command the
actor emitted.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import xxhash

__all__ = [
    "NO_ACTION_TOOL",
    "SCHEMA_VERSION",
    "Action",
    "Effect",
    "History",
    "Step",
    "Trace",
    "Turn",
    "canonical_json",
    "version_hash",
]

#: Version of the canonical trace schema (docs/trace-format.md). Schema 2 added
#: ``tool_cpu_s``; a trace without it on any step is still written as schema 1.
SCHEMA_VERSION = 2

#: Tool name of a step whose reply held no tool call: the harness answered by itself
#: (e.g. a format-error message), nothing ran in the environment.
NO_ACTION_TOOL = "none"


def canonical_json(value: Any) -> str:
    """Serialise ``value`` so that equal JSON values give identical text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def version_hash(*parts: str) -> str:
    """A filesystem version id from its parts (a parent version and what changed): the
    xxh3-128 of the parts joined by a unit separator. The in-memory and replay sandboxes
    chain their versions with it (the runtime hashes real layers, runtime/versions.py)."""
    return xxhash.xxh3_128_hexdigest("\x1f".join(parts).encode())


def _freeze(value: Any, where: str) -> Any:
    """Validate a JSON value and return an immutable copy (dict -> MappingProxy, list -> tuple)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: non-finite number {value!r} is not valid JSON")
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: object key {k!r} is not a string")
            out[k] = _freeze(v, f"{where}.{k}")
        return MappingProxyType(out)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise ValueError(f"{where}: {type(value).__name__} is not a JSON value")


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


class Action:
    """A tool call: a tool name and JSON arguments, compared by canonical serialisation."""

    __slots__ = ("_hash", "args", "key", "tool")

    tool: str
    args: Mapping[str, Any]
    key: str

    def __init__(self, tool: str, args: Mapping[str, Any] | None = None) -> None:
        if not isinstance(tool, str) or not tool:
            raise ValueError(f"tool name must be a non-empty string, got {tool!r}")
        frozen = _freeze(dict(args or {}), "args")
        object.__setattr__(self, "tool", tool)
        object.__setattr__(self, "args", frozen)
        object.__setattr__(self, "key", canonical_json({"args": _thaw(frozen), "tool": tool}))
        object.__setattr__(self, "_hash", hash(self.key))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Action is immutable")

    @classmethod
    def bash(cls, command: str) -> Action:
        """The shell action that runs ``command``."""
        return cls("bash", {"command": command})

    @classmethod
    def none(cls) -> Action:
        """The non-action of a reply without a tool call."""
        return cls(NO_ACTION_TOOL)

    @property
    def command(self) -> str | None:
        """The shell command of a ``bash`` action, else None."""
        if self.tool == "bash":
            cmd = self.args.get("command")
            return cmd if isinstance(cmd, str) else None
        return None

    @property
    def is_none(self) -> bool:
        return self.tool == NO_ACTION_TOOL

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "args": _thaw(self.args)}

    @classmethod
    def from_json(cls, obj: Any) -> Action:
        if not isinstance(obj, Mapping):
            raise ValueError("action must be an object with 'tool' and 'args'")
        unknown = set(obj) - {"tool", "args"}
        if unknown:
            raise ValueError(f"action has unknown keys {sorted(unknown)}")
        args = obj.get("args", {})
        if not isinstance(args, Mapping):
            raise ValueError("action 'args' must be an object")
        return cls(obj.get("tool"), args)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self.key == other.key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if self.command is not None and len(self.args) == 1:
            cmd = self.command if len(self.command) <= 60 else self.command[:57] + "..."
            return f"Action.bash({cmd!r})"
        return f"Action({self.tool!r}, {_thaw(self.args)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Action, (self.tool, _thaw(self.args)))


@dataclass(frozen=True, slots=True)
class Turn:
    """One completed exchange of a history: the action and the observation it produced."""

    action: Action
    observation: str


@dataclass(frozen=True, slots=True)
class History:
    """What the actor conditions on: the task and the turns so far.

    A *provisional* history ends in a drafted observation; it is an ordinary History
    (the engine tracks provisionality, not the type).
    """

    task: str
    turns: tuple[Turn, ...] = ()

    def extend(self, action: Action, observation: str) -> History:
        return History(self.task, (*self.turns, Turn(action, observation)))

    def __len__(self) -> int:
        return len(self.turns)

    def __iter__(self) -> Iterator[Turn]:
        return iter(self.turns)

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(t.action for t in self.turns)


class Effect(enum.Enum):
    """What a step may do to the filesystem."""

    READ_ONLY = "read_only"
    MAY_CHANGE = "may_change"


@dataclass(frozen=True, slots=True)
class Step:
    """One recorded agent step: decode an action, execute it, observe.

    ``tool_duration_s`` is None when unknown (not recorded, or the recording ended before
    the tool finished; then ``completed`` is False). ``state_changed`` is True/False when
    the recorder knew, None when unknown. ``version_before``/``version_after`` are exact
    filesystem version hashes, present only in traces recorded by aospec itself.
    ``tool_cpu_s`` is the CPU time (user + system, all of the command's processes) the tool
    used, None when unknown; it can exceed ``tool_duration_s`` (several cores). Replay's
    contention model (docs/replay.md, "Contention") reads it.
    """

    action: Action
    observation: str
    output_tokens: int
    output_tokens_estimated: bool = False
    tool_duration_s: float | None = None
    model_latency_s: float | None = None
    state_changed: bool | None = None
    version_before: str | None = None
    version_after: str | None = None
    reply: str | None = None
    completed: bool = True
    started_at_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tool_cpu_s: float | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """One agent trajectory on one task."""

    id: str
    task: str
    harness: str
    actor_model: str
    source: str
    steps: tuple[Step, ...]
    instruction: str | None = None
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __len__(self) -> int:
        return len(self.steps)

    def history(self, upto: int | None = None) -> History:
        """The verified history before step ``upto`` (all steps when None)."""
        steps = self.steps if upto is None else self.steps[:upto]
        return History(self.instruction or self.task, tuple(Turn(s.action, s.observation) for s in steps))
