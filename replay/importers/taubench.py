"""Importer for tau-bench historical trajectories (a JSON list of ``{task_id, reward, info,
traj, trial}`` records whose ``traj`` is an OpenAI chat transcript).

Mapping to canonical steps:

- every tool call of an assistant message is one step: ``Action(name, arguments)``, its
  observation the ``tool`` message with the same ``tool_call_id`` (a call without an
  answer, or an answer without a call, is an error). Parallel calls keep call order; the
  message's text, if any, is the first call's ``reply``;
- an assistant message without tool calls is a reply to the user:
  ``Action("respond", {"content": text})``, whose observation is the next user message
  (``""`` and ``completed=False`` when the transcript ends there);
- the first user message is the trace's ``instruction``; the system prompt (the domain
  policy) is kept as ``meta["system_prompt"]``;
- no timings (tool calls are in-memory functions): ``tool_duration_s`` and
  ``model_latency_s`` are None; ``output_tokens`` is estimated as ceil(characters / 4) of
  the text and the calls' names and argument JSON (``output_tokens_estimated=True``).

A record's problems are reported as ``TraceFormatError`` with ``line`` the 1-based record
number and ``field`` the JSON path inside it (e.g. ``traj[6].tool_calls[0].id``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from aospec.replay._input import MAX_FILE_BYTES, freeze_json, json_error, parse_json, read_text

from aospec.errors import TraceFormatError
from aospec.types import Action, Step, Trace

__all__ = ["HARNESS", "RESPOND_TOOL", "parse_taubench_text", "read_taubench"]

HARNESS = "tau-bench"
RESPOND_TOOL = "respond"
_RECORD_KEYS = frozenset(("task_id", "reward", "info", "traj", "trial"))
_NAME_RE = re.compile(r"^(?P<model>.+?)-(?P<domain>airline|retail)(?:\.|$)")


def _estimate(chars: int) -> int:
    return math.ceil(chars / 4)


class _Record:
    def __init__(self, path: str, number: int) -> None:
        self.path = path
        self.number = number

    def error(self, field: str | None, message: str) -> TraceFormatError:
        return TraceFormatError(message, path=self.path, line=self.number, field=field)

    def text(self, msg: dict[str, Any], where: str, *, optional: bool = False) -> str | None:
        v = msg.get("content")
        if v is None and optional:
            return None
        if not isinstance(v, str):
            raise self.error(f"{where}.content", "expected a string")
        return v


def _parse_call(rec: _Record, call: Any, where: str) -> tuple[str, Action, int]:
    if not isinstance(call, dict):
        raise rec.error(where, "expected a tool call object")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise rec.error(f"{where}.id", "expected a non-empty string")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise rec.error(f"{where}.function", "expected an object with name and arguments")
    name, raw_args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise rec.error(f"{where}.function.name", "expected a non-empty string")
    if not isinstance(raw_args, str):
        raise rec.error(f"{where}.function.arguments", "expected a JSON string")
    try:
        args = parse_json(raw_args) if raw_args.strip() else {}
    except ValueError as exc:
        raise json_error(exc, path=rec.path, line=rec.number, field=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise rec.error(f"{where}.function.arguments", "expected a JSON object")
    try:
        action = Action(name, args)
    except ValueError as exc:
        raise rec.error(f"{where}.function.arguments", str(exc)) from None
    return call_id, action, _estimate(len(name) + len(raw_args))


def _parse_record(obj: Any, path: Path, rec: _Record) -> Trace:
    if not isinstance(obj, dict):
        raise rec.error(None, "expected an object with task_id and traj")
    for key in obj:
        if key not in _RECORD_KEYS:
            raise rec.error(key, f"unknown field (expected: {', '.join(sorted(_RECORD_KEYS))})")
    task_id, trial, traj = obj.get("task_id"), obj.get("trial", 0), obj.get("traj")
    if isinstance(task_id, bool) or not isinstance(task_id, (int, str)):
        raise rec.error("task_id", "expected an integer or string")
    if isinstance(trial, bool) or not isinstance(trial, (int, str)):
        raise rec.error("trial", "expected an integer or string")
    if not isinstance(traj, list):
        raise rec.error("traj", "expected a list of messages")
    info = obj.get("info", {})
    if not isinstance(info, dict):
        raise rec.error("info", "expected an object")

    system_prompt: str | None = None
    instruction: str | None = None
    steps: list[Step] = []
    i = 0
    while i < len(traj):
        msg, where = traj[i], f"traj[{i}]"
        if not isinstance(msg, dict):
            raise rec.error(where, "expected a message object")
        role = msg.get("role")
        if role == "system":
            if steps or instruction is not None or system_prompt is not None:
                raise rec.error(f"{where}.role", "a system message is only allowed first")
            system_prompt = rec.text(msg, where)
            i += 1
        elif role == "user":
            if instruction is not None or steps:
                raise rec.error(f"{where}.role", "a user message must answer an assistant reply")
            instruction = rec.text(msg, where)
            i += 1
        elif role == "tool":
            raise rec.error(f"{where}.tool_call_id", "tool message answers no pending tool call")
        elif role == "assistant":
            content = rec.text(msg, where, optional=True)
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise rec.error(f"{where}.tool_calls", "expected a list")
            if not calls:
                if content is None:
                    raise rec.error(f"{where}.content", "an assistant message needs text or tool calls")
                answer = traj[i + 1] if i + 1 < len(traj) else None
                if isinstance(answer, dict) and answer.get("role") == "user":
                    observation, completed, i = rec.text(answer, f"traj[{i + 1}]"), True, i + 2
                elif answer is None:
                    observation, completed, i = "", False, i + 1
                else:
                    raise rec.error(f"traj[{i + 1}].role", "a reply to the user must be answered by a user message")
                steps.append(
                    Step(
                        action=Action(RESPOND_TOOL, {"content": content}),
                        observation=observation or "",
                        output_tokens=_estimate(len(content)),
                        output_tokens_estimated=True,
                        reply=content,
                        completed=completed,
                    )
                )
                continue
            parsed = [_parse_call(rec, c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
            pending = {cid: None for cid, _, _ in parsed}
            if len(pending) != len(parsed):
                raise rec.error(f"{where}.tool_calls", "duplicate tool call id")
            names = {cid: a.tool for cid, a, _ in parsed}
            answers: dict[str, str] = {}
            j = i + 1
            while j < len(traj) and isinstance(traj[j], dict) and traj[j].get("role") == "tool":
                ans, awhere = traj[j], f"traj[{j}]"
                cid = ans.get("tool_call_id")
                if cid not in pending:
                    raise rec.error(f"{awhere}.tool_call_id", f"answers no pending tool call ({cid!r})")
                if cid in answers:
                    raise rec.error(f"{awhere}.tool_call_id", f"tool call {cid!r} answered twice")
                if "name" in ans and ans["name"] != names[cid]:
                    raise rec.error(f"{awhere}.name", f"{ans['name']!r} answers a call of {names[cid]!r}")
                answers[cid] = rec.text(ans, awhere)  # type: ignore[assignment]
                j += 1
            for k, (cid, action, tokens) in enumerate(parsed):
                if cid not in answers:
                    raise rec.error(
                        f"{where}.tool_calls[{k}].id", f"tool call {cid!r} has no tool message answering it"
                    )
                first = k == 0
                steps.append(
                    Step(
                        action=action,
                        observation=answers[cid],
                        output_tokens=tokens + (_estimate(len(content)) if first and content else 0),
                        output_tokens_estimated=True,
                        reply=content if first else None,
                        extra=freeze_json({"tool_call_id": cid}),
                    )
                )
            i = j
        else:
            raise rec.error(f"{where}.role", f"unknown role {role!r}")
    m = _NAME_RE.match(path.name)
    domain = m.group("domain") if m else "tau-bench"
    meta = {"task_id": task_id, "trial": trial, "reward": obj.get("reward"), "info": info}
    if system_prompt is not None:
        meta["system_prompt"] = system_prompt
    stem = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
    return Trace(
        id=f"{stem}/task-{task_id}/trial-{trial}",
        task=f"{domain}/{task_id}",
        harness=HARNESS,
        actor_model=m.group("model") if m else "unknown",
        source=f"tau-bench historical trajectories {path.name}, record {rec.number}",
        steps=tuple(steps),
        instruction=instruction,
        meta=freeze_json(meta),
    )


_RECORD_INDEX = re.compile(r"^\[(\d+)\]\.?")


def parse_taubench_text(path: Path, text: str) -> list[Trace]:
    """Parse a tau-bench trajectory file's content ``text``: one trace per record."""
    try:
        obj = parse_json(text)
    except ValueError as exc:
        inner = getattr(exc, "field", None)
        m = _RECORD_INDEX.match(inner or "")
        if m:  # name the record as its line, the rest as the field, like every other record error
            exc.field = inner[m.end() :] or None  # type: ignore[attr-defined]
            raise json_error(exc, path=str(path), line=int(m.group(1)) + 1) from None
        raise json_error(exc, path=str(path)) from None
    if isinstance(obj, dict):
        hint = (
            "this looks like one record: wrap it in [ ] to make a file of records"
            if "traj" in obj or "task_id" in obj
            else "this looks like a mini-swe-agent trajectory (read it with --input-format mini-swe-agent)"
            if "messages" in obj
            else f"got an object with keys {', '.join(sorted(obj)[:8]) or '(none)'}"
        )
        raise TraceFormatError(f"expected a JSON list of tau-bench trajectory records; {hint}", path=str(path))
    if not isinstance(obj, list):
        raise TraceFormatError("expected a JSON list of trajectory records", path=str(path))
    if not obj:
        raise TraceFormatError("no trajectory records (empty list)", path=str(path))
    if isinstance(obj[0], dict) and "role" in obj[0] and "traj" not in obj[0]:
        raise TraceFormatError(
            "a list of chat messages, not of tau-bench records (a bare mini-swe-agent message list? "
            "read it with --input-format mini-swe-agent)",
            path=str(path),
            line=1,
        )
    return [_parse_record(r, path, _Record(str(path), n)) for n, r in enumerate(obj, start=1)]


def read_taubench(path: str | Path, *, max_file_bytes: int = MAX_FILE_BYTES) -> list[Trace]:
    """Read a tau-bench historical trajectory file."""
    p = Path(path)
    return parse_taubench_text(p, read_text(p, max_bytes=max_file_bytes))
