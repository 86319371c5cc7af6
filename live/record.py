"""Recording a live run as a canonical aospec trace (docs/trace-format.md).

:class:`TraceRecorder` writes one trace to a JSONL file: the header when it opens, then the
whole file again after every committed step (:meth:`TraceRecorder.add`, the agent's
``on_step``), each time to a temporary file that is fsynced and renamed into place. The
file on disk is therefore always a complete, valid trace holding every step committed so
far: a crash, ``kill -9`` or Ctrl-C loses at most the step in flight, never a committed
one. :meth:`TraceRecorder.finish` adds how the run ended to the header's ``meta``.

Per step: the action, the observation, the reply text, ``output_tokens`` from the
endpoint's usage (``output_tokens_estimated`` when it sent none), the model latency, the
tool duration, its CPU time (``tool_cpu_s``, when the sandbox meters its commands:
:class:`aospec.protocols.MeteredSandbox`; else null), and the exact content versions of the committed sandbox before and after
the step (so ``state_changed`` is known exactly, and ``version_after[i] ==
version_before[i + 1]``), and, when the agent recorded them, the step's read and write sets
in ``extra`` (``read_set``, ``write_set``: docs/trace-format.md).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aospec.live.agent import AgentResult, StepRecord
from aospec.replay.io import dump_jsonl

from aospec.types import Step, Trace, version_hash

__all__ = ["TraceRecorder", "step_of"]

_NS = 1e-9


def _seconds(ns: int | None) -> float | None:
    return None if ns is None else round(max(ns, 0) * _NS, 9)


def step_of(record: StepRecord) -> Step:
    """The canonical :class:`~aospec.types.Step` of one committed step."""
    reply = record.reply
    extra: dict[str, Any] = {
        "wait_actor_s": _seconds(record.wait_actor_ns),
        "wait_tool_s": _seconds(record.wait_tool_ns),
        "tool_hidden_s": _seconds(record.tool_hidden_ns),
        "fork_reused": record.fork_reused,
        "draft_hit": record.draft_hit,
    }
    for key in ("read_set", "write_set"):  # --state-model readsets replays with them
        if getattr(record, key) is not None:
            extra[key] = getattr(record, key).to_json()
    if reply is not None:
        text = reply.text
        tokens, estimated = int(reply.output_tokens), bool(reply.tokens_estimated)
        latency = _seconds(reply.latency_ns)
        if getattr(reply, "first_token_ns", None) is not None:
            extra["first_token_s"] = _seconds(reply.first_token_ns)
        if getattr(reply, "finish_reason", None) is not None:
            extra["finish_reason"] = str(reply.finish_reason)
    else:
        # An actor that keeps no replies (a scripted one): the action is all there is.
        text = None
        command = record.action.command
        tokens, estimated = math.ceil(len(command or "") / 4), True
        latency = None
    return Step(
        action=record.action,
        observation=record.observation,
        output_tokens=tokens,
        output_tokens_estimated=estimated,
        tool_duration_s=_seconds(record.tool_ns),
        tool_cpu_s=_seconds(record.tool_cpu_ns),
        model_latency_s=latency,
        state_changed=record.version_before != record.version_after,
        version_before=record.version_before,
        version_after=record.version_after,
        reply=text,
        completed=True,
        started_at_s=_seconds(record.boundary_ns),
        extra=extra,
    )


def _write_atomically(text: str, target: Path) -> None:
    """``text`` into ``target`` via a fsynced temporary file renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        dfd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class TraceRecorder:
    """Records one live run into ``path`` (see the module docstring).

    ``task`` is the task text (the trace's ``instruction``); the trace's ``task`` is
    ``task_id`` (default: a short hash of the text), its ``id`` ``trace_id`` (default
    ``run-<UTC time>-<hash>``), ``harness`` ``aospec-run``. ``meta`` starts the header's meta.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        task: str,
        actor_model: str,
        trace_id: str | None = None,
        task_id: str | None = None,
        source: str = "aospec run",
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        digest = version_hash("task", task)[:12]
        now = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        self.id = trace_id or f"run-{now}-{digest}"
        self.task = task
        self.task_id = task_id or f"task-{digest}"
        self.actor_model = actor_model or "unknown"
        self.source = source
        self.meta: dict[str, Any] = dict(meta or {})
        self.steps: list[Step] = []
        self._write()

    @property
    def trace(self) -> Trace:
        """The trace as recorded so far."""
        return Trace(
            id=self.id,
            task=self.task_id,
            harness="aospec-run",
            actor_model=self.actor_model,
            source=self.source,
            steps=tuple(self.steps),
            instruction=self.task,
            meta=self.meta,
        )

    def add(self, record: StepRecord, statistics: Any = None) -> None:
        """Record one committed step and write the file (the agent's ``on_step``)."""
        self.steps.append(step_of(record))
        self._write()

    def finish(self, result: AgentResult | None = None, *, exit_reason: str | None = None, error: str | None = None) -> None:
        """Write how the run ended into the header's ``meta``: the result's summary, or
        ``exit_reason``/``error`` of a run that did not finish (interrupted, failed)."""
        if result is not None:
            self.meta["result"] = result.summary()
            self.meta["exit_reason"] = result.exit_reason
        if exit_reason is not None:
            self.meta["exit_reason"] = exit_reason
        if error is not None:
            self.meta["error"] = error
        self._write()

    def _write(self) -> None:
        _write_atomically(dump_jsonl([self.trace]), self.path)
