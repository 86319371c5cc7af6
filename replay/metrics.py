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
- ``wasted_tool_s``: total tool time spent in forks that were discarded (wall time, a
  paused fork's included); ``wasted_cpu_s``: the CPU those forks used (on a contended
  host, ``--cores``, what the simulated host metered: a paused fork uses none; without
  one, a fork is taken to use a core for its whole tool time, so it equals
  ``wasted_tool_s``); ``wasted_decode_s``: total decoding of cancelled provisional
  continuations.
- ``mean_ceiling_saving``: the same mean for the policy's matching ceiling (NaN when
  ceilings were not checked).
- ``drafter_failures``: drafting calls that failed (their candidates were dropped), summed
  over traces; ``drafter_error`` the first such error.
- ``state_model``: the state model every result was replayed under (replay/sandbox.py);
  results of different state models are never summarised together (ConfigError).
- ``hidden_s_per_trace``: ``(hidden_tool_s + hidden_decode_s) / traces``, the time
  speculation hid per trial (the paper's comparison of ranking rules).
- The policy's drafters on the recorded history (:mod:`aospec.replay.accuracy`; computed
  once per trace, so the same at every TPOT): ``obs_exact_by_length`` (exact-hit rate of
  its observation drafts by call length, < 1 s, 1-10 s, 10-60 s, > 60 s, with
  ``obs_calls_by_length`` the steps in each), ``action_accuracy_by_width`` (next action
  within the top 1, 2, 4, 8, 16, 32 targets) and ``action_accuracy_by_distance`` (the
  action 1..10 steps ahead within the top 8 at that offset); empty for policies without
  such drafters.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from aospec.replay.sweep import TraceResult

from aospec.errors import ConfigError

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
    hidden_s_per_trace: float = 0.0
    obs_calls_by_length: tuple[int, ...] = ()
    obs_exact_by_length: tuple[float, ...] = ()
    action_accuracy_by_width: tuple[float, ...] = ()
    action_accuracy_by_distance: tuple[float, ...] = ()
    wasted_cpu_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out


def _rates(hits: Sequence[int], totals: Sequence[int]) -> tuple[float, ...]:
    """hits / totals element-wise (NaN where a total is 0); () without counts."""
    if not hits or not any(totals):
        return ()
    return tuple(h / t if t else float("nan") for h, t in zip(hits, totals, strict=True))


def _q(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


class _Group:
    """What a summary needs of one (policy, TPOT)'s results: four numbers per trace (for
    the means, median and quantiles) and running integer sums; never the records."""

    __slots__ = ("ceilings", "counts", "drafter_error", "lat", "savings", "ser", "sums", "traces")

    _SUMMED = (
        "steps",
        "actions_executed",
        "hidden_tool_ns",
        "hidden_decode_ns",
        "drafts_hit",
        "forks_reused",
        "wasted_tool_ns",
        "wasted_decode_ns",
        "wasted_cpu_ns",
        "forks_launched",
        "drafts_started",
        "unknown_tool_steps",
        "drafts_canonical_hit",
        "drafter_failures",
        "overhead_ns",
        "action_steps",
    )
    _VECTORS = (
        "obs_calls_by_length",
        "obs_exact_by_length",
        "action_hits_by_width",
        "action_targets_by_distance",
        "action_hits_by_distance",
    )

    def __init__(self) -> None:
        self.lat, self.ser, self.savings, self.ceilings = array("d"), array("d"), array("d"), array("d")
        self.traces = 0
        self.sums = dict.fromkeys(self._SUMMED, 0)
        self.counts: dict[str, list[int]] = {k: [] for k in self._VECTORS}
        self.drafter_error = ""

    def add(self, r: TraceResult) -> None:
        self.traces += 1
        self.lat.append(r.latency_ns * 1e-9)
        self.ser.append(r.serial_ns * 1e-9)
        self.savings.append(r.saving)
        self.ceilings.append(
            1.0 - r.ceiling_ns / r.serial_ns if r.ceiling_ns >= 0 and r.serial_ns else float("nan")
        )
        sums = self.sums
        for k in self._SUMMED:
            sums[k] += getattr(r, k)
        for k in self._VECTORS:
            v = getattr(r, k)
            acc = self.counts[k]
            if v and not acc:
                acc.extend([0] * len(v))
            if v and len(v) == len(acc):
                for j, x in enumerate(v):
                    acc[j] += x
        if not self.drafter_error and r.drafter_error:
            self.drafter_error = r.drafter_error

    def summary(self, policy: str, tpot: float, state_model: str) -> PolicySummary:
        lat, ser, n = list(self.lat), list(self.ser), self.sums
        executed = n["actions_executed"] or 1
        return PolicySummary(
            policy=policy,
            tpot_ms=tpot,
            traces=self.traces,
            steps=n["steps"],
            mean_saving=float(np.mean(self.savings)),
            median_saving=float(np.median(self.savings)),
            saving_of_total=1.0 - sum(lat) / sum(ser) if sum(ser) else 0.0,
            serial_total_s=sum(ser),
            latency_total_s=sum(lat),
            p50_s=_q(lat, 50),
            p90_s=_q(lat, 90),
            p95_s=_q(lat, 95),
            p99_s=_q(lat, 99),
            serial_p50_s=_q(ser, 50),
            serial_p99_s=_q(ser, 99),
            hidden_tool_s=n["hidden_tool_ns"] * 1e-9,
            hidden_decode_s=n["hidden_decode_ns"] * 1e-9,
            obs_hit_rate=n["drafts_hit"] / executed,
            action_hit_rate=n["forks_reused"] / executed,
            wasted_tool_s=n["wasted_tool_ns"] * 1e-9,
            wasted_decode_s=n["wasted_decode_ns"] * 1e-9,
            forks_launched=n["forks_launched"],
            drafts_started=n["drafts_started"],
            mean_ceiling_saving=float(np.mean(self.ceilings)),
            unknown_tool_steps=n["unknown_tool_steps"],
            obs_canonical_hit_rate=n["drafts_canonical_hit"] / executed,
            drafter_failures=n["drafter_failures"],
            drafter_error=self.drafter_error,
            overhead_s=n["overhead_ns"] * 1e-9,
            state_model=state_model,
            hidden_s_per_trace=(n["hidden_tool_ns"] + n["hidden_decode_ns"]) * 1e-9 / max(1, self.traces),
            obs_calls_by_length=tuple(self.counts["obs_calls_by_length"]) if any(self.counts["obs_calls_by_length"]) else (),
            obs_exact_by_length=_rates(self.counts["obs_exact_by_length"], self.counts["obs_calls_by_length"]),
            action_accuracy_by_width=_rates(self.counts["action_hits_by_width"], [n["action_steps"]] * 6)
            if n["action_steps"]
            else (),
            action_accuracy_by_distance=_rates(self.counts["action_hits_by_distance"], self.counts["action_targets_by_distance"]),
            wasted_cpu_s=n["wasted_cpu_ns"] * 1e-9,
        )


def summarize(results: Iterable[TraceResult]) -> list[PolicySummary]:
    """One summary per (policy, TPOT), in first-seen policy order, TPOTs descending.

    ``results`` may be a stream (e.g. :func:`aospec.replay.report.read_results` of a sweep's
    results.jsonl): only a few numbers per result are kept, not the results.

    ConfigError when the results were replayed under different state models (a brackets'
    comparison is two summaries, never one mixed mean).
    """
    groups: dict[tuple[str, float], _Group] = {}
    models: dict[str, None] = {}
    for r in results:
        group = groups.get((r.policy, r.tpot_ms))
        if group is None:
            group = groups[(r.policy, r.tpot_ms)] = _Group()
        group.add(r)
        models[r.state_model] = None
    if len(models) > 1:
        raise ConfigError(f"results replayed under different state models ({', '.join(models)}) cannot be summarised together")
    state_model = next(iter(models), "effects")
    policy_order = list(dict.fromkeys(p for p, _ in groups))
    out: list[PolicySummary] = []
    for tpot in sorted({t for _, t in groups}, reverse=True):
        for policy in policy_order:
            g = groups.get((policy, tpot))
            if g is not None:
                out.append(g.summary(policy, tpot, state_model))
    return out
