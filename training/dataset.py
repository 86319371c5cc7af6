"""Training examples from canonical traces, split by task.

The examples themselves are built by :mod:`aospec.drafters.examples` (the LM drafters fit on
them too) and re-exported here; this module splits traces and examples by task.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from aospec.drafters.examples import Example, ExampleKind, build_examples, expand_weights

from aospec.errors import ConfigError
from aospec.types import Trace

__all__ = ["Example", "ExampleKind", "build_examples", "expand_weights", "split_by_task", "tasks_of"]

T = TypeVar("T")


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
