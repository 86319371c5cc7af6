"""Canonical trace JSONL (docs/trace-format.md) and loading traces of any supported format.

A canonical file holds one or more traces. Each trace is a header record
``{"type": "trace", "schema": 1, ...}`` followed by one ``{"type": "step", ...}`` record
per step. ``write_jsonl`` always writes every field in a fixed order, so
``write_jsonl(read_jsonl(p))`` reproduces a file written by ``write_jsonl`` byte for byte.

``load_traces`` accepts files and directories of every supported format (canonical
JSONL, tb1 step files, mini-swe-agent ``*.traj.json``, tau-bench trajectory JSON),
detects the format of each file, and returns the traces sorted by id. A file that fails
to import never yields partial results: every bad file is reported in one
:class:`~aospec.errors.TraceImportError`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from aospec.errors import TraceFormatError, TraceImportError
from aospec.types import SCHEMA_VERSION, Action, Step, Trace

__all__ = [
    "FORMATS",
    "dump_jsonl",
    "freeze_json",
    "load_traces",
    "parse_json",
    "read_jsonl",
    "thaw_json",
    "write_jsonl",
]

#: Names accepted by ``load_traces(format=...)``.
FORMATS = ("auto", "aospec", "tb1", "mini-swe-agent", "tau-bench")

_HEADER_FIELDS = ("type", "schema", "id", "task", "harness", "actor_model", "source", "instruction", "meta")
_HEADER_REQUIRED = frozenset(("type", "schema", "id", "task", "harness", "actor_model", "source"))
_STEP_FIELDS = (
    "type",
    "action",
    "observation",
    "output_tokens",
    "output_tokens_estimated",
    "tool_duration_s",
    "model_latency_s",
    "state_changed",
    "version_before",
    "version_after",
    "reply",
    "completed",
    "started_at_s",
    "extra",
)
_STEP_REQUIRED = frozenset(("type", "action", "observation", "output_tokens"))


# ---------------------------------------------------------------- JSON helpers


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


def parse_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate object keys, at most MAX_JSON_DEPTH levels
    of nesting. Raises ValueError."""
    try:
        value = _decoder.decode(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return value


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


def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------- writing


def _header_record(trace: Trace) -> dict[str, Any]:
    return {
        "type": "trace",
        "schema": SCHEMA_VERSION,
        "id": trace.id,
        "task": trace.task,
        "harness": trace.harness,
        "actor_model": trace.actor_model,
        "source": trace.source,
        "instruction": trace.instruction,
        "meta": thaw_json(trace.meta),
    }


def _float_or_none(value: float | None) -> float | None:
    return None if value is None else float(value)


def _step_record(step: Step) -> dict[str, Any]:
    return {
        "type": "step",
        "action": thaw_json(step.action.to_json()),
        "observation": step.observation,
        "output_tokens": step.output_tokens,
        "output_tokens_estimated": step.output_tokens_estimated,
        "tool_duration_s": _float_or_none(step.tool_duration_s),
        "model_latency_s": _float_or_none(step.model_latency_s),
        "state_changed": step.state_changed,
        "version_before": step.version_before,
        "version_after": step.version_after,
        "reply": step.reply,
        "completed": step.completed,
        "started_at_s": _float_or_none(step.started_at_s),
        "extra": thaw_json(step.extra),
    }


def dump_jsonl(traces: Iterable[Trace]) -> str:
    """The canonical JSONL text of ``traces`` (what ``write_jsonl`` writes)."""
    lines: list[str] = []
    for trace in traces:
        lines.append(_dumps(_header_record(trace)))
        lines.extend(_dumps(_step_record(s)) for s in trace.steps)
    return "".join(line + "\n" for line in lines)


def write_jsonl(traces: Iterable[Trace], path: str | os.PathLike[str]) -> Path:
    """Write ``traces`` as canonical JSONL to ``path`` atomically (a temp file renamed into place)."""
    text = dump_jsonl(traces)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# ---------------------------------------------------------------- reading


class _Fields:
    """Typed access to one record's fields, raising TraceFormatError with path/line/field."""

    __slots__ = ("line", "path", "rec")

    def __init__(self, rec: Mapping[str, Any], path: str, line: int) -> None:
        self.rec = rec
        self.path = path
        self.line = line

    def error(self, field: str | None, message: str) -> TraceFormatError:
        return TraceFormatError(message, path=self.path, line=self.line, field=field)

    def str(self, name: str, *, optional: bool = False, nonempty: bool = False) -> str | None:
        v = self.rec.get(name)
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise self.error(name, f"expected a string, got {_kind(v)}")
        if nonempty and not v:
            raise self.error(name, "must not be empty")
        return v

    def bool(self, name: str, default: bool | None, *, optional: bool = False) -> bool | None:
        if name not in self.rec:
            return default
        v = self.rec[name]
        if v is None and optional:
            return None
        if not isinstance(v, bool):
            raise self.error(name, f"expected true or false{' or null' if optional else ''}, got {_kind(v)}")
        return v

    def int(self, name: str) -> int:
        v = self.rec.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(name, f"expected an integer, got {_kind(v)}")
        if v < 0:
            raise self.error(name, f"must be >= 0, got {v}")
        return v

    def seconds(self, name: str, *, allow_negative: bool = False) -> float | None:
        v = self.rec.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(name, f"expected a number of seconds or null, got {_kind(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise self.error(name, "must be finite")
        if v < 0 and not allow_negative:
            raise self.error(name, f"must be >= 0, got {v}")
        return v

    def mapping(self, name: str) -> Mapping[str, Any]:
        v = self.rec.get(name, {})
        if not isinstance(v, Mapping):
            raise self.error(name, f"expected an object, got {_kind(v)}")
        return freeze_json(v)

    def check_keys(self, allowed: Sequence[str], required: frozenset[str]) -> None:
        unknown = [k for k in self.rec if k not in allowed]
        if unknown:
            raise self.error(unknown[0], f"unknown field (allowed: {', '.join(allowed)})")
        missing = [k for k in allowed if k in required and k not in self.rec]
        if missing:
            raise self.error(missing[0], "missing required field")


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, Mapping):
        return "an object"
    if isinstance(v, list):
        return "an array"
    return type(v).__name__


def _parse_header(f: _Fields) -> dict[str, Any]:
    f.check_keys(_HEADER_FIELDS, _HEADER_REQUIRED)
    schema = f.rec["schema"]
    if schema != SCHEMA_VERSION or isinstance(schema, bool):
        raise f.error("schema", f"unsupported schema {schema!r}; this aospec reads schema {SCHEMA_VERSION}")
    return {
        "id": f.str("id", nonempty=True),
        "task": f.str("task"),
        "harness": f.str("harness"),
        "actor_model": f.str("actor_model"),
        "source": f.str("source"),
        "instruction": f.str("instruction", optional=True),
        "meta": f.mapping("meta"),
    }


def _parse_step(f: _Fields) -> Step:
    f.check_keys(_STEP_FIELDS, _STEP_REQUIRED)
    try:
        action = Action.from_json(f.rec["action"])
    except (ValueError, TypeError) as exc:
        raise f.error("action", str(exc)) from None
    return Step(
        action=action,
        observation=f.str("observation"),  # type: ignore[arg-type]
        output_tokens=f.int("output_tokens"),
        output_tokens_estimated=f.bool("output_tokens_estimated", False),  # type: ignore[arg-type]
        tool_duration_s=f.seconds("tool_duration_s"),
        model_latency_s=f.seconds("model_latency_s"),
        state_changed=f.bool("state_changed", None, optional=True),
        version_before=f.str("version_before", optional=True),
        version_after=f.str("version_after", optional=True),
        reply=f.str("reply", optional=True),
        completed=f.bool("completed", True),  # type: ignore[arg-type]
        started_at_s=f.seconds("started_at_s", allow_negative=True),
        extra=f.mapping("extra"),
    )


def parse_jsonl_text(text: str, path: str) -> list[Trace]:
    """Parse canonical JSONL ``text`` (``path`` only names it in errors)."""
    traces: list[Trace] = []
    header: dict[str, Any] | None = None
    steps: list[Step] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = parse_json(line)
        except ValueError as exc:
            raise TraceFormatError(f"invalid JSON: {exc}", path=path, line=lineno) from None
        if not isinstance(rec, dict):
            raise TraceFormatError(f"expected a JSON object, got {_kind(rec)}", path=path, line=lineno)
        f = _Fields(rec, path, lineno)
        kind = rec.get("type")
        if kind == "trace":
            if header is not None:
                traces.append(Trace(steps=tuple(steps), **header))
            header, steps = _parse_header(f), []
        elif kind == "step":
            if header is None:
                raise f.error("type", "step record before any trace header")
            steps.append(_parse_step(f))
        else:
            raise f.error("type", f"expected 'trace' or 'step', got {kind!r}")
    if header is None:
        raise TraceFormatError("no trace header record (empty file?)", path=path)
    traces.append(Trace(steps=tuple(steps), **header))
    return traces


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; TraceFormatError (naming the line) when unreadable."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"cannot read: {exc.strerror or exc}", path=str(path)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TraceFormatError(f"not UTF-8 text (byte offset {exc.start})", path=str(path), line=line) from None


def read_jsonl(path: str | os.PathLike[str]) -> list[Trace]:
    """Read a canonical JSONL file. Raises TraceFormatError naming the path, line and field."""
    p = Path(path)
    return parse_jsonl_text(read_text(p), str(p))


# ---------------------------------------------------------------- any format


def _import_with(fmt: str, path: Path, text: str) -> list[Trace]:
    if fmt == "aospec":
        return parse_jsonl_text(text, str(path))
    if fmt == "tb1":
        from replay.importers.tb1 import parse_tb1_text

        return parse_tb1_text(path, text)
    if fmt == "mini-swe-agent":
        from replay.importers.minisweagent import parse_traj_text

        return parse_traj_text(path, text)
    from replay.importers.taubench import parse_taubench_text

    return parse_taubench_text(path, text)


def detect_format(path: Path, text: str) -> str:
    """Which importer reads ``text`` (the content of ``path``); TraceFormatError when none."""
    stripped = text.lstrip()
    if not stripped:
        raise TraceFormatError("empty file", path=str(path))
    try:
        first = parse_json(stripped.split("\n", 1)[0])
    except ValueError:
        first = None
    if isinstance(first, dict):
        if first.get("type") in ("trace", "step"):
            return "aospec"
        if "step" in first and "action" in first and "response_text" in first:
            return "tb1"
    if path.name.endswith(".jsonl"):
        raise TraceFormatError(
            "unrecognised JSONL: the first record is neither an aospec trace header nor a tb1 step",
            path=str(path),
            line=1,
        )
    if stripped.startswith("["):
        return "tau-bench"
    if stripped.startswith("{"):
        return "mini-swe-agent"
    raise TraceFormatError("unrecognised trace file (neither JSON nor JSONL)", path=str(path))


_TRACE_SUFFIXES = (".jsonl", ".json")


def _walk(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or not name.endswith(_TRACE_SUFFIXES):
                continue
            p = Path(dirpath) / name
            if name.endswith(".results.json") and (Path(dirpath) / (name[: -len(".results.json")] + ".jsonl")).exists():
                continue  # a tb1 step file's companion, read with it
            files.append(p)
    return files


def load_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    format: str = "auto",
) -> list[Trace]:
    """Load every trace under ``paths`` (files and directories, searched recursively).

    ``format`` is ``"auto"`` (detect each file) or one of ``FORMATS``. Traces are returned
    sorted by id; ids must be unique. Any failure raises one TraceImportError listing every
    bad file (and nothing is returned).
    """
    if format not in FORMATS:
        raise TraceImportError([TraceFormatError(f"unknown format {format!r}; choose from {', '.join(FORMATS)}")])
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    errors: list[TraceFormatError] = []
    files: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = _walk(p)
            if not found:
                errors.append(TraceFormatError("no trace files (*.jsonl, *.json) in this directory", path=str(p)))
        elif p.exists():
            found = [p]
        else:
            errors.append(TraceFormatError("no such file or directory", path=str(p)))
            continue
        for f in found:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                files.append(f)
    traces: list[Trace] = []
    origin: dict[str, Path] = {}
    for f in files:
        try:
            text = read_text(f)
            fmt = detect_format(f, text) if format == "auto" else format
            loaded = _import_with(fmt, f, text)
        except TraceFormatError as exc:
            errors.append(exc)
            continue
        for t in loaded:
            if t.id in origin:
                errors.append(TraceFormatError(f"duplicate trace id {t.id!r} (also in {origin[t.id]})", path=str(f)))
            else:
                origin[t.id] = f
                traces.append(t)
    if errors:
        raise TraceImportError(errors)
    traces.sort(key=lambda t: t.id)
    return traces
