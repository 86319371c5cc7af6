"""Statistics of a trace set: size, tool-time distribution, tokens and effect classes.

Quantiles use numpy's default ``linear`` method (type 7 of Hyndman & Fan) over the steps
whose tool duration is known; steps with an unknown duration are excluded from the time
figures and counted in ``untimed_steps``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from aospec.effects import step_effect
from aospec.types import Effect, Trace

__all__ = ["LONG_CALL_S", "QUANTILE_METHOD", "TraceStats", "tool_durations", "trace_stats"]

#: A tool call at least this long counts as "long" (``long_call_time_share``).
LONG_CALL_S = 1.0
#: How quantiles are computed (numpy.quantile's method).
QUANTILE_METHOD = "linear"


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Summary of a trace set; ``to_json()`` gives the ``aospec traces stats --format json`` object.

    Time figures are None when no step has a known tool duration.
    """

    trials: int
    steps: int
    tasks: int
    harnesses: dict[str, int]
    actor_models: dict[str, int]
    timed_steps: int
    untimed_steps: int
    incomplete_steps: int
    no_action_steps: int
    tool_time_total_s: float
    tool_time_mean_s: float | None
    tool_time_p50_s: float | None
    tool_time_p90_s: float | None
    tool_time_p99_s: float | None
    tool_time_max_s: float | None
    long_calls: int
    long_call_share: float | None
    long_call_time_share: float | None
    model_latency_steps: int
    model_latency_total_s: float
    model_latency_p50_s: float | None
    output_tokens: int
    output_tokens_counted: int
    output_tokens_estimated: int
    steps_tokens_counted: int
    steps_tokens_estimated: int
    read_only_steps: int
    may_change_steps: int
    effects_recorded: int
    effects_classified: int
    tools: dict[str, int]
    task_names: list[str] = field(default_factory=list)
    quantile_method: str = f"numpy {QUANTILE_METHOD}"
    long_call_threshold_s: float = LONG_CALL_S

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (keys in a stable order)."""
        out = asdict(self)
        out["effects"] = {Effect.READ_ONLY.value: self.read_only_steps, Effect.MAY_CHANGE.value: self.may_change_steps}
        return out


def tool_durations(traces: Iterable[Trace]) -> np.ndarray:
    """Every known tool duration (seconds) of the steps of ``traces``, in order."""
    return np.array([s.tool_duration_s for t in traces for s in t.steps if s.tool_duration_s is not None], dtype=float)


def _quantiles(values: np.ndarray, qs: Sequence[float]) -> list[float | None]:
    if values.size == 0:
        return [None] * len(qs)
    return [float(v) for v in np.quantile(values, qs, method=QUANTILE_METHOD)]


def trace_stats(traces: Sequence[Trace]) -> TraceStats:
    """Summarise ``traces``."""
    steps = [s for t in traces for s in t.steps]
    durations = tool_durations(traces)
    latencies = np.array([s.model_latency_s for s in steps if s.model_latency_s is not None], dtype=float)
    p50, p90, p99 = _quantiles(durations, (0.5, 0.9, 0.99))
    total = float(durations.sum())
    long_mask = durations >= LONG_CALL_S
    effects = Counter(step_effect(s) for s in steps)
    recorded = sum(
        1
        for s in steps
        if s.state_changed is not None or (s.version_before is not None and s.version_after is not None)
    )
    counted = [s for s in steps if not s.output_tokens_estimated]
    estimated = [s for s in steps if s.output_tokens_estimated]
    return TraceStats(
        trials=len(traces),
        steps=len(steps),
        tasks=len({t.task for t in traces}),
        harnesses=dict(sorted(Counter(t.harness for t in traces).items())),
        actor_models=dict(sorted(Counter(t.actor_model for t in traces).items())),
        timed_steps=int(durations.size),
        untimed_steps=len(steps) - int(durations.size),
        incomplete_steps=sum(1 for s in steps if not s.completed),
        no_action_steps=sum(1 for s in steps if s.action.is_none),
        tool_time_total_s=total,
        tool_time_mean_s=float(durations.mean()) if durations.size else None,
        tool_time_p50_s=p50,
        tool_time_p90_s=p90,
        tool_time_p99_s=p99,
        tool_time_max_s=float(durations.max()) if durations.size else None,
        long_calls=int(long_mask.sum()),
        long_call_share=float(long_mask.mean()) if durations.size else None,
        long_call_time_share=(float(durations[long_mask].sum()) / total if total > 0 else None),
        model_latency_steps=int(latencies.size),
        model_latency_total_s=float(latencies.sum()),
        model_latency_p50_s=_quantiles(latencies, (0.5,))[0],
        output_tokens=sum(s.output_tokens for s in steps),
        output_tokens_counted=sum(s.output_tokens for s in counted),
        output_tokens_estimated=sum(s.output_tokens for s in estimated),
        steps_tokens_counted=len(counted),
        steps_tokens_estimated=len(estimated),
        read_only_steps=effects[Effect.READ_ONLY],
        may_change_steps=effects[Effect.MAY_CHANGE],
        effects_recorded=recorded,
        effects_classified=len(steps) - recorded,
        tools=dict(sorted(Counter(s.action.tool for s in steps).items())),
        task_names=sorted({t.task for t in traces}),
    )
