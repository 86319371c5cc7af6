"""Configuration records that reject unknown keys with a clear message."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from aospec.errors import ConfigError

__all__ = ["from_mapping"]

T = TypeVar("T")


def _check_type(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_check_type(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list):
        return isinstance(value, (tuple, list))
    if origin in (dict, Mapping) or annotation in (dict, Mapping):
        return isinstance(value, Mapping)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def from_mapping(cls: type[T], data: Mapping[str, Any], *, where: str = "config") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and ill-typed values raise
    ConfigError naming the key (and the closest known key for typos)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
    for key, value in data.items():
        if not _check_type(value, hints.get(key, Any)):
            raise ConfigError(f"{where}: key {key!r} has invalid value {value!r} (expected {hints[key]})")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
