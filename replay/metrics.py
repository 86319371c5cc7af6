"""Summaries of replay results per (policy, TPOT).

- ``mean_saving``: mean over traces of ``1 - latency / serial`` (traces weighted equally).
- ``p50_s`` ... ``p99_s``: quantiles (linear interpolation) of per-trial latency.
- ``hidden_tool_s``: total over traces of tool time of committed steps that ran while the
  actor decoded (before the step's action was emitted); ``hidden_decode_s``: total decoding
  of committed steps that ran while a tool ran (before the step's boundary); both >= 0.
- ``overhead_s``: total time on the committed path that was neither decoding nor tool time
  (forking, committing; always 0 in virtual time), so that
  ``latency = decode + tool - hidden_decode - hidden_tool + overhead``.
- ``obs_hit_rate``: committed steps whose observation a draft matched byte for byte, over
  steps that executed an action; ``action_hit_rate``: committed steps served by a
  speculative fork (JASV reuse), over the same. ``obs_canonical_hit_rate``: steps whose
  observation a draft matched only once canonicalised (policies with
  ``accept=canonical``; not included in ``obs_hit_rate``), over the same.
- ``wasted_tool_s``: total tool time spent in forks that were discarded;
  ``wasted_decode_s``: total decoding of cancelled provisional continuations.
- ``mean_ceiling_saving``: the same mean for the policy's matching ceiling (NaN when
  ceilings were not checked).
- ``drafter_failures``: drafting calls that failed (their candidates were dropped), summed
  over traces; ``drafter_error`` the first such error.
- ``state_model``: the state model every result was replayed under (replay/sandbox.py);
  results of different state models are never summarised together (ConfigError).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from aospec.errors import ConfigError
from replay.sweep import TraceResult

__all__ = ["PolicySummary", "summarize"]


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """Aggregate of one policy at one TPOT over a trace set."""

    policy: str
    tpot_ms: float
    traces: int
    steps: int
    mean_saving: float
    median_saving: float
    saving_of_total: float
    serial_total_s: float
    latency_total_s: float
    p50_s: float
    p90_s: float
    p95_s: float
    p99_s: float
    serial_p50_s: float
    serial_p99_s: float
    hidden_tool_s: float
    hidden_decode_s: float
    obs_hit_rate: float
    action_hit_rate: float
    wasted_tool_s: float
    wasted_decode_s: float
    forks_launched: int
    drafts_started: int
    mean_ceiling_saving: float
    unknown_tool_steps: int
    obs_canonical_hit_rate: float = 0.0
    drafter_failures: int = 0
    drafter_error: str = ""
    overhead_s: float = 0.0
    state_model: str = "effects"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _q(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


def summarize(results: Iterable[TraceResult]) -> list[PolicySummary]:
    """One summary per (policy, TPOT), in first-seen policy order, TPOTs descending.

    ConfigError when the results were replayed under different state models (a brackets'
    comparison is two summaries, never one mixed mean).
    """
    groups: dict[tuple[str, float], list[TraceResult]] = {}
    models: dict[str, None] = {}
    for r in results:
        groups.setdefault((r.policy, r.tpot_ms), []).append(r)
        models[r.state_model] = None
    if len(models) > 1:
        raise ConfigError(f"results replayed under different state models ({', '.join(models)}) cannot be summarised together")
    state_model = next(iter(models), "effects")
    policy_order = list(dict.fromkeys(p for p, _ in groups))
    out: list[PolicySummary] = []
    for tpot in sorted({t for _, t in groups}, reverse=True):
        for policy in policy_order:
            rs = groups.get((policy, tpot))
            if not rs:
                continue
            lat = [r.latency_ns * 1e-9 for r in rs]
            ser = [r.serial_ns * 1e-9 for r in rs]
            savings = [r.saving for r in rs]
            executed = sum(r.actions_executed for r in rs) or 1
            ceilings = [
                1.0 - r.ceiling_ns / r.serial_ns if r.ceiling_ns >= 0 and r.serial_ns else float("nan") for r in rs
            ]
            out.append(
                PolicySummary(
                    policy=policy,
                    tpot_ms=tpot,
                    traces=len(rs),
                    steps=sum(r.steps for r in rs),
                    mean_saving=float(np.mean(savings)),
                    median_saving=float(np.median(savings)),
                    saving_of_total=1.0 - sum(lat) / sum(ser) if sum(ser) else 0.0,
                    serial_total_s=sum(ser),
                    latency_total_s=sum(lat),
                    p50_s=_q(lat, 50),
                    p90_s=_q(lat, 90),
                    p95_s=_q(lat, 95),
                    p99_s=_q(lat, 99),
                    serial_p50_s=_q(ser, 50),
                    serial_p99_s=_q(ser, 99),
                    hidden_tool_s=sum(r.hidden_tool_ns for r in rs) * 1e-9,
                    hidden_decode_s=sum(r.hidden_decode_ns for r in rs) * 1e-9,
                    obs_hit_rate=sum(r.drafts_hit for r in rs) / executed,
                    action_hit_rate=sum(r.forks_reused for r in rs) / executed,
                    wasted_tool_s=sum(r.wasted_tool_ns for r in rs) * 1e-9,
                    wasted_decode_s=sum(r.wasted_decode_ns for r in rs) * 1e-9,
                    forks_launched=sum(r.forks_launched for r in rs),
                    drafts_started=sum(r.drafts_started for r in rs),
                    mean_ceiling_saving=float(np.mean(ceilings)),
                    unknown_tool_steps=sum(r.unknown_tool_steps for r in rs),
                    obs_canonical_hit_rate=sum(r.drafts_canonical_hit for r in rs) / executed,
                    drafter_failures=sum(r.drafter_failures for r in rs),
                    drafter_error=next((r.drafter_error for r in rs if r.drafter_error), ""),
                    overhead_s=sum(r.overhead_ns for r in rs) * 1e-9,
                    state_model=state_model,
                )
            )
    return out
