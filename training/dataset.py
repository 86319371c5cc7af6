"""Training examples from canonical traces, split by task.

An observation example is (history window before step i, action i) -> observation i; an
action example is (history window before step i) -> actions i .. i+depth-1. Prompts are
cut to a token budget (the task and the newest turns are kept, see
:mod:`drafters.prompts`). Steps whose tool ran for at least ``min_tool_time_s`` are
oversampled (``weight``): those are the steps whose observations are worth drafting.
Steps the recording did not finish (no observation) give no observation example.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from aospec.errors import ConfigError
from aospec.types import Trace
from drafters.prompts import ACTION_SEPARATOR, PromptBudget, action_messages, observation_messages, render_action

__all__ = ["Example", "ExampleKind", "build_examples", "expand_weights", "split_by_task", "tasks_of"]

ExampleKind = Literal["observation", "action"]
T = TypeVar("T")


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


def tasks_of(items: Iterable[Trace] | Iterable[Example]) -> list[str]:
    return sorted({x.task for x in items})


def split_by_task(
    items: Sequence[T],
    *,
    eval_fraction: float = 0.2,
    eval_tasks: Sequence[str] | None = None,
    seed: int = 0,
    task: Callable[[T], str] = lambda x: x.task,  # type: ignore[attr-defined]
) -> tuple[list[T], list[T], list[str]]:
    """Split ``items`` (traces or examples) so that no task is on both sides.

    ``eval_tasks`` names the held-out tasks; otherwise ``ceil(eval_fraction * tasks)`` of
    them (at least one, never all) are drawn with ``seed``. Returns (train, eval, eval task
    names).
    """
    tasks = sorted({task(x) for x in items})
    if eval_tasks is not None:
        unknown = sorted(set(eval_tasks) - set(tasks))
        if unknown:
            raise ConfigError(f"eval tasks {unknown} are not in the data (tasks: {', '.join(tasks)})")
        held = sorted(set(eval_tasks))
    else:
        if len(tasks) < 2:
            raise ConfigError(f"splitting by task needs at least 2 tasks, the data has {len(tasks)}")
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        k = min(len(tasks) - 1, max(1, math.ceil(eval_fraction * len(tasks))))
        held = sorted(random.Random(seed).sample(tasks, k))
    held_set = set(held)
    train = [x for x in items if task(x) not in held_set]
    evals = [x for x in items if task(x) in held_set]
    return train, evals, held
