"""Importer for mini-swe-agent trajectory files (``*.traj.json``).

Two message layouts exist:

- **v1** (``trajectory_format: "mini-swe-agent-1"``, mini-swe-agent 1.x): chat messages
  ``{role, content, timestamp}``; the assistant's reply holds one fenced bash block
  (parsed with the run's ``action_regex``), and the next ``user`` message is its
  observation (command output, format error, timeout notice, or the submission);
- **v2** (``"mini-swe-agent-1.1"``, mini-swe-agent 2.x): the assistant message lists
  its parsed commands in ``extra.actions``; text-based models answer with ``user``
  messages in order, tool-calling models with ``tool`` messages paired by
  ``tool_call_id`` (OpenAI Responses-API items ``function_call``/``function_call_output``
  are read too). A reply that could not be parsed appears as a ``user`` message with
  ``extra.interrupt_type == "FormatError"``; the run ends with an ``exit`` message.

Each executed command is one step (``Action.bash``); a reply without a command is one
step with ``Action.none()`` whose observation is the format-error message. Timings come
from the messages' timestamps when present: tool time = observation time minus the time
the reply (or the previous parallel command's output) arrived; model latency = reply
time minus the previous message's time; a missing or negative difference is None.
Output tokens come from the stored model response's usage (``completion_tokens`` or
``output_tokens``) when present, else are estimated as ceil(characters / 4) of the reply
and its tool calls (``output_tokens_estimated=True``). Several commands from one reply
share one decode: the first step carries the reply's tokens and latency, the rest 0 and
None. The last command of a submitted run has no observation (``""``, duration None).

Only the trajectory formats in ``TRAJECTORY_FORMATS`` are read. The v1 ``action_regex`` a
file carries is untrusted input: it runs on the ``regex`` engine with a time budget of
``ACTION_REGEX_BUDGET_S`` per file (as does the default pattern), and a pattern that
exceeds it (catastrophic backtracking, e.g. ``(a|aa)+$``) is an error naming the field,
never a hang and never a silent fallback to another pattern.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import regex
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

__all__ = [
    "ACTION_REGEX_BUDGET_S",
    "DEFAULT_ACTION_REGEX",
    "HARNESS",
    "TRAJECTORY_FORMATS",
    "parse_traj_text",
    "read_traj",
]

HARNESS = "mini-swe-agent"
DEFAULT_ACTION_REGEX = r"```bash\s*\n(.*?)\n```"
#: ``trajectory_format`` values this importer reads (mini-swe-agent 1.x and 2.x).
TRAJECTORY_FORMATS = ("mini-swe-agent-1", "mini-swe-agent-1.1")
#: Time all action-regex matching of one file may take, in seconds.
ACTION_REGEX_BUDGET_S = 2.0
_REGEX_FIELD = "info.config.agent.action_regex"


class _Msg:
    """One message normalised: role, text, tool calls [(id, name, args_json)], extra, time."""

    __slots__ = ("call_id", "calls", "extra", "index", "role", "text", "ts")

    def __init__(
        self,
        index: int,
        role: str,
        text: str | None,
        *,
        calls: Sequence[tuple[str, str, str]] = (),
        call_id: str | None = None,
        extra: dict[str, Any] | None = None,
        ts: float | None = None,
    ) -> None:
        self.index = index
        self.role = role
        self.text = text
        self.calls: tuple[tuple[str, str, str], ...] = tuple(calls)
        self.call_id: str | None = call_id
        self.extra: dict[str, Any] = extra or {}
        self.ts: float | None = ts


class _Ctx:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.regex_deadline = time.monotonic() + ACTION_REGEX_BUDGET_S

    def error(self, field: str, message: str) -> TraceFormatError:
        return TraceFormatError(message, path=self.path, field=field)

    def find_actions(self, pattern: regex.Pattern[str], text: str, where: str) -> list[str]:
        """``pattern.findall(text)`` within what is left of the file's time budget."""
        left = self.regex_deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return pattern.findall(text, timeout=left)
        except TimeoutError:
            raise self.error(
                _REGEX_FIELD,
                f"matching the pattern against {where} took over {ACTION_REGEX_BUDGET_S:g} s in all "
                "(catastrophic backtracking?); the pattern is not run further: fix it in the file "
                f"(mini-swe-agent's default is {DEFAULT_ACTION_REGEX!r})",
            ) from None


def _content_text(ctx: _Ctx, content: Any, where: str) -> str | None:
    """Text of a message content: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") in ("image_url", "input_image", "image"):
                continue
            else:
                raise ctx.error(f"{where}.content[{k}]", "expected a text part")
        return "".join(parts)
    raise ctx.error(f"{where}.content", "expected a string, null or a list of text parts")


def _timestamp(ctx: _Ctx, m: dict[str, Any], extra: dict[str, Any], where: str) -> float | None:
    """A message's time (v2 ``extra.timestamp``, v1 ``timestamp``); None when absent or not a number."""
    field = f"{where}.extra.timestamp" if "timestamp" in extra else f"{where}.timestamp"
    v = extra.get("timestamp", m.get("timestamp"))
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    problem = check_seconds(as_float(v), timestamp=True)
    if problem:
        raise ctx.error(field, problem)
    return float(v)


def _normalise(ctx: _Ctx, i: int, m: Any) -> list[_Msg]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ctx.error(where, "expected a message object")
    extra = m.get("extra") or {}
    if not isinstance(extra, dict):
        raise ctx.error(f"{where}.extra", "expected an object")
    ts = _timestamp(ctx, m, extra, where)
    if m.get("object") == "response":  # Responses API assistant output
        output = m.get("output")
        if not isinstance(output, list):
            raise ctx.error(f"{where}.output", "expected a list of output items")
        texts, calls = [], []
        for k, item in enumerate(output):
            if not isinstance(item, dict):
                raise ctx.error(f"{where}.output[{k}]", "expected an object")
            if item.get("type") == "message":
                texts.append(_content_text(ctx, item.get("content"), f"{where}.output[{k}]") or "")
            elif item.get("type") == "function_call":
                cid = item.get("call_id") or item.get("id")
                name, args = item.get("name"), item.get("arguments", "{}")
                if not isinstance(cid, str) or not isinstance(name, str) or not isinstance(args, str):
                    raise ctx.error(f"{where}.output[{k}]", "function_call needs string call_id, name and arguments")
                calls.append((cid, name, args))
        return [_Msg(i, "assistant", "".join(texts) if texts else None, calls=calls, extra=extra, ts=ts)]
    if m.get("type") == "function_call_output":
        cid, out = m.get("call_id"), m.get("output")
        if not isinstance(cid, str):
            raise ctx.error(f"{where}.call_id", "expected a string")
        return [_Msg(i, "tool", _content_text(ctx, out, where) or "", call_id=cid, extra=extra, ts=ts)]
    role = m.get("role")
    if role not in ("system", "user", "assistant", "tool", "exit"):
        raise ctx.error(f"{where}.role", f"unknown role {role!r}")
    text = _content_text(ctx, m.get("content"), where)
    calls = []
    raw_calls = m.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise ctx.error(f"{where}.tool_calls", "expected a list")
    for k, c in enumerate(raw_calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(c.get("id"), str)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise ctx.error(f"{where}.tool_calls[{k}]", "expected {id, function: {name, arguments}} with strings")
        calls.append((c["id"], fn["name"], fn["arguments"]))
    call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise ctx.error(f"{where}.tool_call_id", "expected a string")
    return [_Msg(i, role, text, calls=calls, call_id=call_id, extra=extra, ts=ts)]


def _usage_tokens(ctx: _Ctx, response: Any, where: str) -> int | None:
    if not isinstance(response, dict):
        return None
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    for key in ("completion_tokens", "output_tokens"):
        v = usage.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            if v > MAX_OUTPUT_TOKENS:
                raise ctx.error(f"{where}.usage.{key}", f"beyond the limit of {MAX_OUTPUT_TOKENS:,} tokens")
            return v
    return None


def _response_text(response: Any) -> str | None:
    try:
        msg = response["choices"][0]["message"]
        text = msg.get("content")
        return text if isinstance(text, str) else None
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def _delta(ctx: _Ctx, a: float | None, b: _Msg) -> float | None:
    """Seconds from ``a`` to message ``b``'s time (None when either is unknown or b is earlier)."""
    if a is None or b.ts is None or b.ts < a:
        return None
    problem = check_seconds(b.ts - a)
    if problem:
        raise ctx.error(f"messages[{b.index}]", f"its timestamp, measured from the message before: {problem}")
    return b.ts - a


def _actions_of(ctx: _Ctx, msg: _Msg, pattern: regex.Pattern[str]) -> list[tuple[Action, str | None]]:
    """(action, tool_call_id) of every command an assistant message issued."""
    where = f"messages[{msg.index}]"
    listed = msg.extra.get("actions")
    if listed is not None:
        if not isinstance(listed, list):
            raise ctx.error(f"{where}.extra.actions", "expected a list")
        out = []
        for k, a in enumerate(listed):
            if not isinstance(a, dict) or not isinstance(a.get("command"), str):
                raise ctx.error(f"{where}.extra.actions[{k}]", "expected {command: string}")
            cid = a.get("tool_call_id")
            out.append((Action.bash(a["command"]), cid if isinstance(cid, str) else None))
        return out
    if msg.calls:
        out = []
        for k, (cid, name, raw) in enumerate(msg.calls):
            try:
                args = parse_json(raw) if raw.strip() else {}
            except ValueError as exc:
                raise json_error(exc, path=ctx.path, field=f"{where}.tool_calls[{k}].function.arguments") from None
            if not isinstance(args, dict):
                raise ctx.error(f"{where}.tool_calls[{k}].function.arguments", "expected a JSON object")
            if name == "bash" and set(args) == {"command"} and isinstance(args["command"], str):
                out.append((Action.bash(args["command"]), cid))
            elif not name:
                raise ctx.error(f"{where}.tool_calls[{k}].function.name", "expected a non-empty tool name")
            else:
                out.append((Action(name, args), cid))
        return out
    found = [a.strip() for a in ctx.find_actions(pattern, msg.text or "", where)]
    return [(Action.bash(found[0]), None)] if len(found) == 1 else []


def _estimate(msg: _Msg) -> int:
    chars = len(msg.text or "") + sum(len(n) + len(a) for _, n, a in msg.calls)
    return math.ceil(chars / 4)


def parse_traj_text(path: Path, text: str) -> list[Trace]:
    """Parse a mini-swe-agent trajectory file's content ``text`` into one trace."""
    ctx = _Ctx(path)
    try:
        obj = parse_json(text)
    except ValueError as exc:
        raise json_error(exc, path=str(path)) from None
    if isinstance(obj, list):
        obj = {"messages": obj}  # the bare message list some tools write
    if not isinstance(obj, dict):
        raise TraceFormatError("expected a JSON object with 'messages'", path=str(path))
    raw_messages = obj.get("messages")
    if not isinstance(raw_messages, list):
        if "messages" not in obj and ("traj" in obj or "task_id" in obj):
            raise TraceFormatError(
                "an object with task_id/traj: one tau-bench record, not a mini-swe-agent trajectory; "
                "a tau-bench file is a JSON list of records (wrap it in [ ])",
                path=str(path),
            )
        if "messages" not in obj:
            keys = ", ".join(sorted(obj)[:8]) or "(none)"
            raise ctx.error(
                "messages",
                "missing: not a mini-swe-agent trajectory (an object with a 'messages' list) nor a tau-bench "
                f"file (a list of records); top-level keys: {keys}",
            )
        raise ctx.error("messages", "expected a list of messages")
    info = obj.get("info") or {}
    if not isinstance(info, dict):
        raise ctx.error("info", "expected an object")
    fmt = obj.get("trajectory_format")
    if fmt is not None and fmt not in TRAJECTORY_FORMATS:
        raise ctx.error(
            "trajectory_format",
            f"unsupported trajectory format {fmt!r:.60}; this aospec reads {' and '.join(TRAJECTORY_FORMATS)}",
        )
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    agent_cfg = config.get("agent") if isinstance(config.get("agent"), dict) else {}
    model_cfg = config.get("model") if isinstance(config.get("model"), dict) else {}
    try:
        pattern = regex.compile(agent_cfg.get("action_regex") or DEFAULT_ACTION_REGEX, regex.DOTALL)
    except (regex.error, TypeError, ValueError) as exc:
        raise ctx.error(_REGEX_FIELD, f"invalid regex: {exc}") from None

    msgs = [m for i, raw in enumerate(raw_messages) for m in _normalise(ctx, i, raw)]
    t0 = next((m.ts for m in msgs if m.ts is not None), None)
    steps: list[Step] = []
    instruction: str | None = None
    notices: list[dict[str, Any]] = []
    exit_msg: _Msg | None = None
    i = 0
    while i < len(msgs):
        m = msgs[i]
        prev = msgs[i - 1] if i > 0 else None
        if m.role == "system":
            i += 1
            continue
        if m.role == "exit":
            exit_msg = m
            i += 1
            continue
        if m.role == "tool":
            raise ctx.error(f"messages[{m.index}].tool_call_id", "tool message answers no pending tool call")
        if m.role == "user":
            if instruction is None and not steps:
                instruction = m.text or ""
            elif m.extra.get("interrupt_type") == "FormatError":
                response = m.extra.get("response")
                reply = m.extra.get("model_response")
                reply = reply if isinstance(reply, str) else _response_text(response)
                counted = _usage_tokens(ctx, response, f"messages[{m.index}].extra.response")
                steps.append(
                    Step(
                        action=Action.none(),
                        observation=m.text or "",
                        output_tokens=counted if counted is not None else math.ceil(len(reply or "") / 4),
                        output_tokens_estimated=counted is None,
                        reply=reply,
                        extra=freeze_json({"interrupt_type": "FormatError"}),
                    )
                )
            else:
                notices.append({"message": m.index, "text": m.text or ""})
            i += 1
            continue
        # assistant
        actions = _actions_of(ctx, m, pattern)
        counted = _usage_tokens(ctx, m.extra.get("response"), f"messages[{m.index}].extra.response")
        tokens = counted if counted is not None else _estimate(m)
        latency = _delta(ctx, prev.ts, m) if prev is not None and prev.role != "system" else None
        started = None if latency is None or t0 is None or prev is None or prev.ts is None else prev.ts - t0
        problem = None if started is None else check_seconds(started, timestamp=True)
        if problem:
            raise ctx.error(f"messages[{prev.index}]", f"its timestamp, measured from the first message: {problem}")
        j = i + 1
        answers: list[_Msg] = []
        while j < len(msgs) and msgs[j].role in ("user", "tool") and msgs[j].extra.get("interrupt_type") is None:
            if msgs[j].role == "user" and len(answers) >= max(len(actions), 1):
                break
            answers.append(msgs[j])
            j += 1
        by_id = {a.call_id: a for a in answers if a.call_id is not None}
        if len(by_id) != sum(1 for a in answers if a.call_id is not None):
            raise ctx.error(f"messages[{answers[0].index}].tool_call_id", "a tool call is answered twice")
        in_order = [a for a in answers if a.call_id is None]
        call_ids = {cid for _, cid in actions if cid is not None}
        for cid, ans in by_id.items():
            if cid not in call_ids:
                raise ctx.error(f"messages[{ans.index}].tool_call_id", f"answers no tool call of the reply ({cid!r})")
        if not actions:
            actions_iter: list[tuple[Action, str | None]] = [(Action.none(), None)]
        else:
            actions_iter = actions
        last_ts = m.ts
        for k, (action, cid) in enumerate(actions_iter):
            if cid is not None:
                obs = by_id.get(cid)
                if obs is None and j < len(msgs) and msgs[j].role != "exit":
                    raise ctx.error(f"messages[{m.index}].tool_calls[{k}]", f"tool call {cid!r} has no answer")
            else:
                obs = in_order.pop(0) if in_order else None
            step_extra: dict[str, Any] = {}
            if obs is not None:
                for key in ("returncode", "exception_info"):
                    if obs.extra.get(key) not in (None, ""):
                        step_extra[key] = obs.extra[key]
            elif exit_status := _exit_status_after(msgs, j):
                step_extra["exit_status"] = exit_status
            exit_status = step_extra.get("exit_status")
            completed = obs is not None or exit_status == "Submitted"
            duration = _delta(ctx, last_ts, obs) if obs is not None else None
            if obs is not None and obs.ts is not None:
                last_ts = obs.ts
            steps.append(
                Step(
                    action=action,
                    observation=(obs.text or "") if obs is not None else "",
                    output_tokens=tokens if k == 0 else 0,
                    output_tokens_estimated=counted is None,
                    tool_duration_s=duration if not action.is_none else None,
                    model_latency_s=latency if k == 0 else None,
                    reply=(m.text if k == 0 else None),
                    started_at_s=started if k == 0 else None,
                    completed=completed,
                    extra=freeze_json(step_extra),
                )
            )
        if in_order:
            notices.extend({"message": a.index, "text": a.text or ""} for a in in_order)
        i = j
    if instruction is None:
        raise ctx.error("messages", "no user message with the task")
    name = path.name
    for suffix in (".traj.json", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    task = obj.get("instance_id")
    model_name = model_cfg.get("model_name")
    stats = info.get("model_stats") if isinstance(info.get("model_stats"), dict) else {}
    meta: dict[str, Any] = {
        "trajectory_format": fmt,
        "mini_version": info.get("mini_version"),
        "exit_status": info.get("exit_status") or (exit_msg.extra.get("exit_status") if exit_msg else None),
        "submission": info.get("submission"),
        "instance_cost": stats.get("instance_cost"),
        "api_calls": stats.get("api_calls"),
        "model_type": config.get("model_type"),
        "environment_type": config.get("environment_type"),
    }
    if notices:
        meta["unpaired_messages"] = notices
    return [
        Trace(
            id=name,
            task=task if isinstance(task, str) and task else name,
            harness=HARNESS,
            actor_model=model_name if isinstance(model_name, str) and model_name else "unknown",
            source=f"mini-swe-agent {info.get('mini_version') or '?'} trajectory {path.name}",
            steps=tuple(steps),
            instruction=instruction,
            meta=freeze_json({k: v for k, v in meta.items() if v is not None}),
        )
    ]


def _exit_status_after(msgs: list[_Msg], j: int) -> str | None:
    if j < len(msgs) and msgs[j].role == "exit":
        status = msgs[j].extra.get("exit_status")
        return status if isinstance(status, str) else "exit"
    return None


def read_traj(path: str | Path, *, max_file_bytes: int = MAX_FILE_BYTES) -> Trace:
    """Read one mini-swe-agent ``*.traj.json`` file."""
    p = Path(path)
    return parse_traj_text(p, read_text(p, max_bytes=max_file_bytes))[0]
