"""Importer for the tb1 step files: mini-swe-agent 1.7 + Claude Sonnet 4 on Terminal-Bench.

Each ``<run>/<trial>.jsonl`` holds one JSON object per agent step, extracted from the
asciinema recording the terminal-bench leaderboard publishes; ``<trial>.results.json``
beside it is the harness's result file (see replay/data/tb1-sample/NOTICE for the fields).

Mapping to the canonical :class:`~aospec.types.Step`:

- ``action`` "" -> ``Action.none()``, else ``Action.bash(action)``;
- ``est_output_tokens`` -> ``output_tokens`` with ``output_tokens_estimated=True``
  (the source has no token counts: ceil(len(response_text) / 4));
- ``tool_duration_s`` as recorded (a slightly negative value, the terminal having shown
  the output before it finished printing a long reply, becomes 0.0 and the raw value is
  kept as ``extra["tool_duration_recorded_s"]``); null (the recording ended before the command
  finished) -> None and ``completed=False``;
- ``llm_latency_s`` -> ``model_latency_s``; ``response_text`` -> ``reply``;
  ``t_query_start`` -> ``started_at_s``; ``t_response``, ``t_obs``, ``cum_cost_usd`` ->
  ``extra``; ``state_changed`` unknown (None).

The trace id is the trial name, the task the results file's ``task_id`` (else parsed from
the file name), and ``meta`` keeps the results file's other fields (``is_resolved``,
``failure_mode``, ...), the run directory name and the recording's start.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from aospec.replay._input import (
    MAX_FILE_BYTES,
    MAX_OUTPUT_TOKENS,
    as_float,
    check_seconds,
    freeze_json,
    json_error,
    parse_json,
    read_text,
)

from aospec.errors import TraceFormatError
from aospec.types import Action, Step, Trace

__all__ = ["ACTOR_MODEL", "HARNESS", "NEGATIVE_TOLERANCE_S", "SOURCE", "parse_tb1_text", "read_tb1"]

HARNESS = "mini-swe-agent"
ACTOR_MODEL = "claude-sonnet-4"
SOURCE = (
    "github.com/laude-institute/terminal-bench-leaderboard@8e1925a3:"
    "results/terminal-bench-core@0.1.1/20250825_swe-agent-mini_claude-4-sonnet"
)

#: A recorded tool duration down to this much below zero is read as 0 s (the terminal showed
#: the output before it finished printing a long reply); the raw value stays in ``extra``.
NEGATIVE_TOLERANCE_S = 1.0

_FIELDS = {
    "step": int,
    "t_query_start": float,
    "t_response": float,
    "t_obs": float | None,
    "llm_latency_s": float,
    "tool_duration_s": float | None,
    "response_text": str,
    "action": str,
    "observation": str,
    "est_output_tokens": int,
    "cum_cost_usd": float,
    "cast_epoch_start": int,
}
_NULLABLE = frozenset(("t_obs", "tool_duration_s"))
_FLOATS = frozenset(k for k, t in _FIELDS.items() if t in (float, float | None))
_TIMESTAMPS = frozenset(("t_query_start", "t_response", "t_obs"))
_DURATIONS = frozenset(("llm_latency_s", "tool_duration_s"))
_TRIAL_RE = re.compile(r"^(?P<task>.+?)\.\d+-of-\d+\.(?P<run>[^/]+)$")


def _check(rec: Any, path: str, line: int) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise TraceFormatError("expected a JSON object per line", path=path, line=line)
    for key in rec:
        if key not in _FIELDS:
            raise TraceFormatError(f"unknown field (expected: {', '.join(_FIELDS)})", path=path, line=line, field=key)
    for key in _FIELDS:
        if key not in rec:
            raise TraceFormatError("missing field", path=path, line=line, field=key)
        v = rec[key]
        if v is None and key in _NULLABLE:
            continue
        if key in _FLOATS:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            want = "a number"
        elif _FIELDS[key] is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
            want = "an integer"
        else:
            ok = isinstance(v, str)
            want = "a string"
        if not ok:
            raise TraceFormatError(f"expected {want}, got {v!r:.40}", path=path, line=line, field=key)
        if key not in _FLOATS:
            continue
        if not math.isfinite(as_float(v)):
            raise TraceFormatError("must be a finite number", path=path, line=line, field=key)
        floor = -NEGATIVE_TOLERANCE_S if key == "tool_duration_s" else 0.0
        if v < floor and key not in _TIMESTAMPS:
            raise TraceFormatError(f"must be >= {floor:g}, got {v}", path=path, line=line, field=key)
        if key in _TIMESTAMPS or key in _DURATIONS:
            # A duration within the negative tolerance is read as 0 s (see the module doc).
            problem = check_seconds(float(v) if key in _TIMESTAMPS else max(float(v), 0.0), timestamp=key in _TIMESTAMPS)
            if problem:
                raise TraceFormatError(problem, path=path, line=line, field=key)
    if rec["est_output_tokens"] < 0:
        raise TraceFormatError("must be >= 0", path=path, line=line, field="est_output_tokens")
    if rec["est_output_tokens"] > MAX_OUTPUT_TOKENS:
        raise TraceFormatError(
            f"beyond the limit of {MAX_OUTPUT_TOKENS:,} tokens", path=path, line=line, field="est_output_tokens"
        )
    return rec


def _results(step_path: Path, max_file_bytes: int) -> dict[str, Any] | None:
    """The trial's results.json, or None when it is absent or empty (the harness wrote nothing)."""
    rpath = step_path.with_name(step_path.name[: -len(".jsonl")] + ".results.json")
    if not step_path.name.endswith(".jsonl") or not os.path.lexists(rpath):
        return None
    text = read_text(rpath, max_bytes=max_file_bytes)
    if not text.strip():
        return None
    try:
        obj = parse_json(text)
    except ValueError as exc:
        raise json_error(exc, path=str(rpath)) from None
    if not isinstance(obj, dict):
        raise TraceFormatError("expected a JSON object", path=str(rpath))
    for key in ("task_id", "trial_name", "instruction"):
        if key in obj and obj[key] is not None and not isinstance(obj[key], str):
            raise TraceFormatError("expected a string", path=str(rpath), field=key)
    return obj


def parse_tb1_text(path: Path, text: str, *, max_file_bytes: int = MAX_FILE_BYTES) -> list[Trace]:
    """Parse one tb1 step file (its content ``text``), reading the results.json beside it
    (a regular file of at most ``max_file_bytes``)."""
    spath = str(path)
    name = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.stem
    steps: list[Step] = []
    epoch: int | None = None
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rec = _check(parse_json(line), spath, lineno)
        except ValueError as exc:
            raise json_error(exc, path=spath, line=lineno) from None
        if rec["step"] != len(steps) + 1:
            raise TraceFormatError(
                f"step numbers must run 1, 2, ...; expected {len(steps) + 1}, got {rec['step']}",
                path=spath,
                line=lineno,
                field="step",
            )
        if epoch is None:
            epoch = rec["cast_epoch_start"]
        elif rec["cast_epoch_start"] != epoch:
            raise TraceFormatError("differs from the first step's", path=spath, line=lineno, field="cast_epoch_start")
        duration = rec["tool_duration_s"]
        extra: dict[str, Any] = {
            "cum_cost_usd": float(rec["cum_cost_usd"]),
            "t_obs": None if rec["t_obs"] is None else float(rec["t_obs"]),
            "t_response": float(rec["t_response"]),
        }
        if duration is not None and duration < 0:
            extra["tool_duration_recorded_s"] = float(duration)
            duration = 0.0
        cmd = rec["action"]
        steps.append(
            Step(
                action=Action.bash(cmd) if cmd else Action.none(),
                observation=rec["observation"],
                output_tokens=rec["est_output_tokens"],
                output_tokens_estimated=True,
                tool_duration_s=None if duration is None else float(duration),
                model_latency_s=float(rec["llm_latency_s"]),
                reply=rec["response_text"],
                completed=duration is not None,
                started_at_s=float(rec["t_query_start"]),
                extra=freeze_json(extra),
            )
        )
    if not steps:
        raise TraceFormatError("no steps (empty step file)", path=spath)
    for i, s in enumerate(steps[:-1]):
        if not s.completed:
            raise TraceFormatError(
                "tool_duration_s is null before the last step (only a trial's last command can be cut off)",
                path=spath,
                line=i + 1,
                field="tool_duration_s",
            )
    results = _results(path, max_file_bytes)
    m = _TRIAL_RE.match(name)
    meta: dict[str, Any] = {"cast_epoch_start": epoch, "run": path.parent.name}
    if results is None:
        meta["results_missing"] = True
        task = m.group("task") if m else name
        instruction = None
    else:
        if results.get("trial_name") not in (None, name):
            raise TraceFormatError(
                f"results file is for trial {results['trial_name']!r}, not {name!r}",
                path=str(path.with_name(name + ".results.json")),
                field="trial_name",
            )
        task = results.get("task_id") or (m.group("task") if m else name)
        instruction = results.get("instruction")
        for k, v in results.items():
            if k not in ("task_id", "trial_name", "instruction"):
                meta["results_id" if k == "id" else k] = v
    return [
        Trace(
            id=name,
            task=task,
            harness=HARNESS,
            actor_model=ACTOR_MODEL,
            source=f"{SOURCE}/{path.parent.name}/{name}",
            steps=tuple(steps),
            instruction=instruction,
            meta=freeze_json(meta),
        )
    ]


def read_tb1(path: str | Path, *, max_file_bytes: int = MAX_FILE_BYTES) -> Trace:
    """Read one tb1 trial (``<trial>.jsonl`` and the ``<trial>.results.json`` beside it)."""
    p = Path(path)
    return parse_tb1_text(p, read_text(p, max_bytes=max_file_bytes), max_file_bytes=max_file_bytes)[0]
