"""Canonical trace JSONL (docs/trace-format.md) and loading traces of any supported format.

A canonical file holds one or more traces. Each trace is a header record
``{"type": "trace", "schema": 2, ...}`` followed by one ``{"type": "step", ...}`` record
per step. ``write_jsonl`` always writes every field of the trace's schema in a fixed order,
so ``write_jsonl(read_jsonl(p))`` reproduces a file written by ``write_jsonl`` byte for byte.
Schema 2 added the step field ``tool_cpu_s``; a trace none of whose steps has it is written
(and read) as schema 1, exactly as before, so it stays readable by an older aospec.

``load_traces`` accepts files and directories of every supported format (canonical
JSONL, tb1 step files, mini-swe-agent ``*.traj.json``, tau-bench trajectory JSON),
detects the format of each file, and returns the traces sorted by id. A file that fails
to import never yields partial results: every bad file is reported in one
:class:`~aospec.errors.TraceImportError` (or, with ``import_traces(..., skip_invalid=True)``,
skipped and named in the result).

Every input is untrusted: only regular files are read (a FIFO or a device is refused, not
opened for reading), at most ``max_file_bytes`` each; JSON must be strict (no NaN or
Infinity, no number that overflows a float, no lone UTF-16 surrogate, no duplicate key, at
most ``MAX_JSON_DEPTH`` levels); durations and token counts must lie within the bounds
below, which keep a replay's virtual time exact.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aospec.replay._input import (
    MAX_DURATION_S,
    MAX_FILE_BYTES,
    MAX_OUTPUT_TOKENS,
    MAX_TIME_S,
    as_float,
    check_seconds,
    freeze_json,
    json_error,
    parse_json,
    read_text,
    thaw_json,
)

from aospec._files import new_file_mode
from aospec.errors import TraceFormatError, TraceImportError
from aospec.types import SCHEMA_VERSION, Action, Step, Trace

#: The schemas this module reads; a trace is written as the oldest one that holds it.
SCHEMAS = (1, 2)

__all__ = [
    "FORMATS",
    "MAX_DURATION_S",
    "MAX_FILE_BYTES",
    "MAX_OUTPUT_TOKENS",
    "MAX_TIME_S",
    "LoadedTraces",
    "dump_jsonl",
    "freeze_json",
    "import_traces",
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
_STEP_FIELDS_V1 = (
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
#: Schema 2: ``tool_cpu_s`` after ``tool_duration_s``.
_STEP_FIELDS = (*_STEP_FIELDS_V1[:6], "tool_cpu_s", *_STEP_FIELDS_V1[6:])
_STEP_REQUIRED = frozenset(("type", "action", "observation", "output_tokens"))



def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------- writing


def _schema_of(trace: Trace) -> int:
    """The oldest schema that holds ``trace``: 2 when a step has ``tool_cpu_s``, else 1."""
    return SCHEMA_VERSION if any(s.tool_cpu_s is not None for s in trace.steps) else 1


def _header_record(trace: Trace, schema: int) -> dict[str, Any]:
    return {
        "type": "trace",
        "schema": schema,
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


def _step_record(step: Step, schema: int) -> dict[str, Any]:
    record: dict[str, Any] = {
        "type": "step",
        "action": thaw_json(step.action.to_json()),
        "observation": step.observation,
        "output_tokens": step.output_tokens,
        "output_tokens_estimated": step.output_tokens_estimated,
        "tool_duration_s": _float_or_none(step.tool_duration_s),
    }
    if schema >= 2:
        record["tool_cpu_s"] = _float_or_none(step.tool_cpu_s)
    return record | {
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
        schema = _schema_of(trace)
        lines.append(_dumps(_header_record(trace, schema)))
        lines.extend(_dumps(_step_record(s, schema)) for s in trace.steps)
    return "".join(line + "\n" for line in lines)


def write_jsonl(traces: Iterable[Trace], path: str | os.PathLike[str]) -> Path:
    """Write ``traces`` as canonical JSONL to ``path`` atomically (a temp file renamed into place)."""
    text = dump_jsonl(traces)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, new_file_mode())  # mkstemp makes it 0600; the file is not a secret
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

    def int(self, name: str, *, maximum: int) -> int:
        v = self.rec.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(name, f"expected an integer, got {_kind(v)}")
        if v < 0:
            raise self.error(name, f"must be >= 0, got {v}")
        if v > maximum:
            raise self.error(name, f"{_short_number(v)} is beyond the limit of {maximum:,}")
        return v

    def seconds(self, name: str, *, timestamp: bool = False) -> float | None:
        """A duration (>= 0, at most MAX_DURATION_S) or, with ``timestamp``, a time of either
        sign (magnitude at most MAX_TIME_S); null is None."""
        v = self.rec.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(name, f"expected a number of seconds or null, got {_kind(v)}")
        v = as_float(v)
        problem = check_seconds(v, timestamp=timestamp)
        if problem:
            raise self.error(name, problem)
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


def _short_number(v: int) -> str:
    return str(v) if v.bit_length() <= 64 else f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"


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


def _parse_header(f: _Fields) -> tuple[int, dict[str, Any]]:
    f.check_keys(_HEADER_FIELDS, _HEADER_REQUIRED)
    schema = f.rec["schema"]
    if schema not in SCHEMAS or isinstance(schema, bool):
        raise f.error(
            "schema", f"unsupported schema {schema!r}; this aospec reads schemas {', '.join(map(str, SCHEMAS))}"
        )
    return schema, {
        "id": f.str("id", nonempty=True),
        "task": f.str("task"),
        "harness": f.str("harness"),
        "actor_model": f.str("actor_model"),
        "source": f.str("source"),
        "instruction": f.str("instruction", optional=True),
        "meta": f.mapping("meta"),
    }


def _parse_step(f: _Fields, schema: int) -> Step:
    if schema < 2 and "tool_cpu_s" in f.rec:
        raise f.error("tool_cpu_s", 'this field needs "schema": 2 in the trace header')
    f.check_keys(_STEP_FIELDS if schema >= 2 else _STEP_FIELDS_V1, _STEP_REQUIRED)
    try:
        action = Action.from_json(f.rec["action"])
    except (ValueError, TypeError) as exc:
        raise f.error("action", str(exc)) from None
    return Step(
        action=action,
        observation=f.str("observation"),  # type: ignore[arg-type]
        output_tokens=f.int("output_tokens", maximum=MAX_OUTPUT_TOKENS),
        output_tokens_estimated=f.bool("output_tokens_estimated", False),  # type: ignore[arg-type]
        tool_duration_s=f.seconds("tool_duration_s"),
        tool_cpu_s=f.seconds("tool_cpu_s"),
        model_latency_s=f.seconds("model_latency_s"),
        state_changed=f.bool("state_changed", None, optional=True),
        version_before=f.str("version_before", optional=True),
        version_after=f.str("version_after", optional=True),
        reply=f.str("reply", optional=True),
        completed=f.bool("completed", True),  # type: ignore[arg-type]
        started_at_s=f.seconds("started_at_s", timestamp=True),
        extra=f.mapping("extra"),
    )


def parse_jsonl_text(text: str, path: str) -> list[Trace]:
    """Parse canonical JSONL ``text`` (``path`` only names it in errors)."""
    traces: list[Trace] = []
    header: dict[str, Any] | None = None
    schema = SCHEMA_VERSION
    steps: list[Step] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = parse_json(line)
        except ValueError as exc:
            raise json_error(exc, path=path, line=lineno) from None
        if not isinstance(rec, dict):
            raise TraceFormatError(f"expected a JSON object, got {_kind(rec)}", path=path, line=lineno)
        f = _Fields(rec, path, lineno)
        kind = rec.get("type")
        if kind == "trace":
            if header is not None:
                traces.append(Trace(steps=tuple(steps), **header))
            (schema, header), steps = _parse_header(f), []
        elif kind == "step":
            if header is None:
                raise f.error("type", "step record before any trace header")
            steps.append(_parse_step(f, schema))
        else:
            raise f.error("type", f"expected 'trace' or 'step', got {kind!r}")
    if header is None:
        raise TraceFormatError("no trace header record (empty file?)", path=path)
    traces.append(Trace(steps=tuple(steps), **header))
    return traces


def read_jsonl(path: str | os.PathLike[str], *, max_file_bytes: int = MAX_FILE_BYTES) -> list[Trace]:
    """Read a canonical JSONL file. Raises TraceFormatError naming the path, line and field."""
    p = Path(path)
    return parse_jsonl_text(read_text(p, max_bytes=max_file_bytes), str(p))


# ---------------------------------------------------------------- any format


def _import_with(fmt: str, path: Path, text: str, max_file_bytes: int) -> list[Trace]:
    if fmt == "aospec":
        return parse_jsonl_text(text, str(path))
    if fmt == "tb1":
        from aospec.replay.importers.tb1 import parse_tb1_text

        return parse_tb1_text(path, text, max_file_bytes=max_file_bytes)
    if fmt == "mini-swe-agent":
        from aospec.replay.importers.minisweagent import parse_traj_text

        return parse_traj_text(path, text)
    from aospec.replay.importers.taubench import parse_taubench_text

    return parse_taubench_text(path, text)


def detect_format(path: Path, text: str) -> str:
    """Which importer reads ``text`` (the content of ``path``); TraceFormatError when none."""
    stripped = text.lstrip()
    if not stripped:
        raise TraceFormatError("empty file", path=str(path))
    first_line = stripped.split("\n", 1)[0]
    try:
        first = parse_json(first_line)
    except ValueError as exc:
        first, problem = None, exc
    if isinstance(first, dict):
        if first.get("type") in ("trace", "step"):
            return "aospec"
        if "step" in first and "action" in first and "response_text" in first:
            return "tb1"
    if path.name.endswith(".jsonl"):
        line = text[: len(text) - len(stripped)].count("\n") + 1
        if first is None:
            # Say what is wrong with the record rather than that no importer knows it.
            raise json_error(problem, path=str(path), line=line)
        raise TraceFormatError(
            "unrecognised JSONL: the first record is neither an aospec trace header "
            '({"type": "trace", ...}) nor a tb1 step ({"step": 1, "action": ..., "response_text": ...})',
            path=str(path),
            line=line,
        )
    if stripped.startswith("["):
        return "tau-bench"
    if stripped.startswith("{"):
        return "mini-swe-agent"
    raise TraceFormatError("unrecognised trace file (neither JSON nor JSONL)", path=str(path))


_TRACE_SUFFIXES = (".jsonl", ".json")


def _walk(root: Path, errors: list[TraceFormatError]) -> list[Path]:
    """Trace files under ``root`` in a fixed order; symlinked directories are not followed
    (so a symlink loop among directories cannot recur), an unreadable directory is an error."""

    def unreadable(exc: OSError) -> None:
        errors.append(TraceFormatError(f"cannot list directory: {exc.strerror or exc}", path=str(exc.filename)))

    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or not name.endswith(_TRACE_SUFFIXES):
                continue
            p = Path(dirpath) / name
            if name.endswith(".results.json") and (Path(dirpath) / (name[: -len(".results.json")] + ".jsonl")).exists():
                continue  # a tb1 step file's companion, read with it
            files.append(p)
    return files


@dataclass(frozen=True, slots=True)
class LoadedTraces:
    """What :func:`import_traces` read: the traces (sorted by id), how many files they came
    from, one error per file skipped as invalid (``skip_invalid=True`` only), and the file
    each trace came from (``paths[trace.id]``, so errors about a trace can name its file)."""

    traces: tuple[Trace, ...]
    files: int
    skipped: tuple[TraceFormatError, ...] = ()
    paths: Mapping[str, str] = field(default_factory=dict, compare=False)


def _file_key(p: Path) -> Any:
    try:
        st = os.stat(p)
    except OSError:
        return os.path.abspath(p)
    return (st.st_dev, st.st_ino)


def import_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    format: str = "auto",
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
    skip_invalid: bool = False,
    keep: Callable[[Trace, Path], Any] | None = None,
) -> LoadedTraces:
    """Import every trace under ``paths`` (files and directories, searched recursively).

    ``format`` is ``"auto"`` (detect each file) or one of ``FORMATS``; each file may hold at
    most ``max_file_bytes``. Trace ids must be unique. By default any bad file raises one
    TraceImportError listing every bad file (and nothing is returned). With
    ``skip_invalid``, a bad file (unreadable, malformed, or repeating a trace id of an
    earlier file) is left out whole and its error kept in ``skipped``; the paths themselves
    (missing, a directory without trace files, an unknown format) must still be right, and
    an import that leaves no trace at all still raises.

    ``keep(trace, file)``, when given, is what is kept of each trace instead of the trace
    (anything with its ``id``, e.g. a :class:`aospec.replay.sweep.TraceRef`), so that importing
    many files holds one file's traces at a time (``aospec sweep``'s evaluation traces).
    """
    if format not in FORMATS:
        raise TraceImportError([TraceFormatError(f"unknown format {format!r}; choose from {', '.join(FORMATS)}")])
    if max_file_bytes < 1:
        raise TraceImportError([TraceFormatError(f"max_file_bytes must be >= 1, got {max_file_bytes}")])
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    fatal: list[TraceFormatError] = []
    bad: list[TraceFormatError] = []
    files: list[Path] = []
    seen: set[Any] = set()
    for raw in paths:
        p = Path(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(p).st_mode)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not os.path.islink(p):
                fatal.append(TraceFormatError("no such file or directory", path=str(p)))
                continue
            is_dir = False  # a symlink loop or a dangling link: reported when read, as a bad file
        if is_dir:
            unlisted = len(bad)
            found = _walk(p, bad)
            if not found and len(bad) == unlisted:
                fatal.append(TraceFormatError("no trace files (*.jsonl, *.json) in this directory", path=str(p)))
        else:
            found = [p]
        for f in found:
            key = _file_key(f)
            if key not in seen:
                seen.add(key)
                files.append(f)
    if fatal:
        raise TraceImportError(fatal + bad)
    traces: list[Any] = []
    origin: dict[str, Path] = {}
    imported = 0
    for f in files:
        try:
            text = read_text(f, max_bytes=max_file_bytes)
            fmt = detect_format(f, text) if format == "auto" else format
            loaded = _import_with(fmt, f, text, max_file_bytes)
        except TraceFormatError as exc:
            bad.append(exc)
            continue
        ids: dict[str, Path] = {}
        clash = None
        for t in loaded:
            if t.id in origin or t.id in ids:
                clash = TraceFormatError(
                    f"duplicate trace id {t.id!r} (also in {origin.get(t.id, f)})", path=str(f)
                )
                break
            ids[t.id] = f
        if clash is not None:
            bad.append(clash)
            continue
        origin.update(ids)
        traces.extend(loaded if keep is None else (keep(t, f) for t in loaded))
        del loaded
        imported += 1
    if bad and not skip_invalid:
        others = len(files) > len(bad)
        raise TraceImportError(bad, hint="--skip-invalid (skip_invalid=True) imports the rest" if others else None)
    if bad and not traces:
        raise TraceImportError(bad, hint="no file was valid")
    traces.sort(key=lambda t: t.id)
    return LoadedTraces(tuple(traces), imported, tuple(bad), {i: str(f) for i, f in origin.items()})


def load_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    format: str = "auto",
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> list[Trace]:
    """Load every trace under ``paths`` (files and directories, searched recursively).

    ``format`` is ``"auto"`` (detect each file) or one of ``FORMATS``. Traces are returned
    sorted by id; ids must be unique. Any failure raises one TraceImportError listing every
    bad file (and nothing is returned). See :func:`import_traces` to skip bad files instead.
    """
    return list(import_traces(paths, format, max_file_bytes=max_file_bytes).traces)
