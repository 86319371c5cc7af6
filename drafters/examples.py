"""Supervised examples for the drafter models, built from canonical traces.

An observation example is (history window before step i, action i) -> observation i; an
action example is (history window before step i) -> actions i .. i+depth-1. Prompts are
cut to a token budget (the task and the newest turns are kept, see
:mod:`aospec.drafters.prompts`). Steps whose tool ran for at least ``min_tool_time_s`` are
oversampled (``weight``): those are the steps whose observations are worth drafting.
Steps the recording did not finish (no observation) give no observation example.

The LM drafters fit on these in-process (``fit_steps``); ``aospec train`` (training/)
builds the same examples for its offline runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from aospec.drafters.prompts import ACTION_SEPARATOR, PromptBudget, action_messages, observation_messages, render_action

from aospec.errors import ConfigError
from aospec.types import Trace

__all__ = ["Example", "ExampleKind", "build_examples", "expand_weights"]

ExampleKind = Literal["observation", "action"]


@dataclass(frozen=True, slots=True)
class Example:
    """One supervised example: chat ``messages`` -> ``target`` text."""

    task: str
    trace_id: str
    step: int
    messages: tuple[tuple[tuple[str, str], ...], ...]
    target: str
    tool_time_s: float | None
    weight: int = 1

    def chat(self) -> list[dict[str, str]]:
        """The messages as the list of dicts chat templates take."""
        return [dict(m) for m in self.messages]


def _freeze_messages(messages: Sequence[dict[str, str]]) -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple(tuple(sorted(m.items())) for m in messages)


def build_examples(
    traces: Iterable[Trace],
    *,
    count: Callable[[str], int],
    kind: ExampleKind = "observation",
    budget: PromptBudget | None = None,
    depth: int = 1,
    min_tool_time_s: float = 1.0,
    oversample: int = 3,
) -> list[Example]:
    """Examples of ``kind`` from ``traces``; ``count`` counts tokens of a text."""
    if kind not in ("observation", "action"):
        raise ConfigError(f"unknown example kind {kind!r} (observation or action)")
    if depth < 1 or oversample < 1:
        raise ConfigError("depth and oversample must be >= 1")
    budget = budget or PromptBudget()
    out: list[Example] = []
    for trace in traces:
        steps = trace.steps
        for i, step in enumerate(steps):
            history = trace.history(i)
            tool = step.tool_duration_s
            weight = oversample if tool is not None and tool >= min_tool_time_s else 1
            if kind == "observation":
                if not step.completed:
                    continue
                messages = observation_messages(history, step.action, budget, count)
                target = step.observation
            else:
                messages = action_messages(history, budget, count)
                target = ACTION_SEPARATOR.join(render_action(s.action) for s in steps[i : i + depth])
            out.append(
                Example(trace.task, trace.id, i, _freeze_messages(messages), target, tool, weight)
            )
    return out


def expand_weights(examples: Sequence[Example]) -> list[int]:
    """Indices of ``examples`` with each repeated ``weight`` times (the oversampled pool)."""
    return [i for i, e in enumerate(examples) for _ in range(e.weight)]
