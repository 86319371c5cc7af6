"""Reading untrusted trace input, shared by :mod:`aospec.replay.io` and the importers.

Only regular files are read, at most ``max_bytes`` each (:func:`read_bytes`,
:func:`read_text`); JSON is strict (:func:`parse_json`); durations, timestamps and token
counts must lie within the bounds below, which keep a replay's virtual time exact
(:func:`check_seconds`). :mod:`aospec.replay.io` re-exports the public names.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from aospec.errors import TraceFormatError

__all__ = [
    "MAX_DURATION_S",
    "MAX_FILE_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_OUTPUT_TOKENS",
    "MAX_TIME_S",
    "JSONValueError",
    "as_float",
    "check_seconds",
    "freeze_json",
    "json_error",
    "parse_json",
    "read_bytes",
    "read_text",
    "thaw_json",
]

#: Largest trace file read by default (``--max-file-mb`` / ``max_file_bytes`` raise it).
MAX_FILE_BYTES = 256 * 2**20
#: Largest accepted step duration (tool time, model latency): about 116 days.
MAX_DURATION_S = 1e7
#: Largest accepted magnitude of a timestamp (``started_at_s`` and the like): about 317 years.
MAX_TIME_S = 1e10
#: Largest accepted output token count of one step.
MAX_OUTPUT_TOKENS = 10_000_000


# ---------------------------------------------------------------- JSON helpers


class JSONValueError(ValueError):
    """Strict-JSON violation; ``field`` is the JSON path of the offending value when known
    (``meta.x``, ``traj[3].content``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


_decoder = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)


#: Deeper JSON is rejected (deep nesting would exhaust the recursion of later processing).
MAX_JSON_DEPTH = 100


_SURROGATE = re.compile("[\ud800-\udfff]")
_NON_FINITE = "a number too large for a 64-bit float (it overflows to infinity)"
_LONE_SURROGATE = "a lone UTF-16 surrogate (e.g. \\ud800) is not Unicode text"


def _json_path(node: Any) -> str | None:
    """The JSON path of a node of parse_json's walk: a (parent, key) chain, None at the root."""
    keys: list[Any] = []
    while node is not None:
        node, key = node
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None


def parse_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity, no number that overflows a float, no lone surrogate in a
    string or key, no duplicate object keys, at most MAX_JSON_DEPTH levels of nesting.
    Raises ValueError (a JSONValueError naming the value's path where it can)."""
    try:
        value = _decoder.decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    # Only a \u escape (or text that already held one) can produce a lone surrogate.
    surrogates = "\\u" in text or _SURROGATE.search(text) is not None
    if isinstance(value, float) and not math.isfinite(value):
        raise JSONValueError(_NON_FINITE)
    if surrogates and isinstance(value, str) and _SURROGATE.search(value):
        raise JSONValueError(_LONE_SURROGATE)
    stack: list[tuple[Any, int, Any]] = [(value, 1, None)]
    while stack:
        v, depth, node = stack.pop()
        if isinstance(v, dict):
            items: Iterable[tuple[Any, Any]] = v.items()
        elif isinstance(v, list):
            items = enumerate(v)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        for k, c in items:
            if surrogates and isinstance(k, str) and _SURROGATE.search(k):
                raise JSONValueError(f"{_LONE_SURROGATE} (in a key)", _json_path(node))
            if isinstance(c, (dict, list)):
                stack.append((c, depth + 1, (node, k)))
            elif isinstance(c, float):
                if not math.isfinite(c):
                    raise JSONValueError(_NON_FINITE, _json_path((node, k)))
            elif surrogates and isinstance(c, str) and _SURROGATE.search(c):
                raise JSONValueError(_LONE_SURROGATE, _json_path((node, k)))
    return value


def json_error(exc: ValueError, *, path: str, line: int | None = None, field: str | None = None) -> TraceFormatError:
    """The TraceFormatError for a parse_json failure: ``field`` (the path of the record the text
    was) prefixes the JSON path of the offending value."""
    if not isinstance(exc, JSONValueError):
        return TraceFormatError(f"invalid JSON: {exc}", path=path, line=line, field=field)
    inner = exc.field
    if inner is not None:
        field = f"{field}.{inner}" if field and not inner.startswith("[") else f"{field or ''}{inner}"
    return TraceFormatError(str(exc), path=path, line=line, field=field)


def freeze_json(value: Any) -> Any:
    """An immutable copy of a JSON value: objects become read-only mappings, arrays tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze_json(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze_json(v) for v in value)
    return value


def thaw_json(value: Any) -> Any:
    """A plain JSON value (dicts with sorted keys, lists) from a frozen one."""
    if isinstance(value, Mapping):
        return {k: thaw_json(value[k]) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [thaw_json(v) for v in value]
    return value


# ---------------------------------------------------------------- numbers


def as_float(v: int | float) -> float:
    """``float(v)``, infinite (of ``v``'s sign) for an integer too large for a float."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def check_seconds(v: float, *, timestamp: bool = False) -> str | None:
    """Why ``v`` seconds cannot be replayed (None when it can): non-finite, negative for a
    duration, or beyond MAX_DURATION_S (MAX_TIME_S in magnitude for a timestamp)."""
    if not math.isfinite(v):
        return "out of range (not a finite number of seconds)"
    if timestamp:
        return None if abs(v) <= MAX_TIME_S else f"{v:g} s is beyond the limit of +-{MAX_TIME_S:g} s"
    if v < 0:
        return f"must be >= 0, got {v}"
    return None if v <= MAX_DURATION_S else f"{v:g} s is beyond the limit of {MAX_DURATION_S:g} s (about 116 days)"


# ---------------------------------------------------------------- files


def _not_regular(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"{kind}, not a regular file: only regular files are read"


def _os_problem(exc: OSError, path: str | os.PathLike[str]) -> str:
    if exc.errno == errno.ELOOP:
        return "symlink loop (too many levels of symbolic links)"
    if exc.errno == errno.ENOENT and os.path.islink(path):
        return f"dangling symlink (to {os.readlink(path)!r})"
    return f"cannot read: {exc.strerror or exc}"


def _too_large(size: int, max_bytes: int) -> str:
    mib = 2**20
    return (
        f"{'over ' if size > max_bytes else ''}{size / mib:,.1f} MiB, larger than the {max_bytes / mib:g} MiB "
        "limit for one trace file; raise it with --max-file-mb (max_file_bytes=)"
    )


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The content of the regular file ``path`` (symlinks followed), at most ``max_bytes``.

    Anything else (a FIFO, a device, a directory, a symlink loop) or a larger file is a
    TraceFormatError naming the path, raised without reading (a FIFO is never opened for
    reading, so this never blocks).
    """
    spath = str(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise TraceFormatError(_os_problem(exc, path), path=spath) from None
    if not stat.S_ISREG(st.st_mode):
        raise TraceFormatError(_not_regular(st.st_mode), path=spath)
    if st.st_size > max_bytes:
        raise TraceFormatError(_too_large(st.st_size, max_bytes), path=spath)
    try:
        # O_NONBLOCK: should the path have been swapped for a FIFO since the stat, opening
        # it must not wait for a writer; fstat below then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TraceFormatError(_os_problem(exc, path), path=spath) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise TraceFormatError(_not_regular(st.st_mode), path=spath)
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise TraceFormatError(_os_problem(exc, path), path=spath) from None
    if len(data) > max_bytes:
        raise TraceFormatError(_too_large(len(data), max_bytes), path=spath)
    return data


def read_text(path: str | os.PathLike[str], *, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of the regular file ``path`` (see :func:`read_bytes`); a leading
    byte-order mark is dropped. TraceFormatError (naming the line) when not UTF-8."""
    data = read_bytes(path, max_bytes=max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceFormatError(f"not UTF-8 text (byte offset {exc.start})", path=str(path), line=line) from None
    return text[1:] if text.startswith("\ufeff") else text
