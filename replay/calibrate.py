"""Fitting the speculation controller's model on a user's traces, through the same engine.

:func:`fit_admission` replays each trace under a policy in virtual time with the
controller off (so every candidate is launched and its outcome seen: a fork reused or
thrown away, a branch adopted or cancelled) and the policy's drafters fitted
leave-one-task-out (each trace's drafters see only the traces of other tasks, so the
outcomes are those of drafters that never saw the trace, as they will be live). Every
outcome goes into one :class:`aospec.admission.AdmissionModel`, as it would in a live run;
so do the tool times (and the CPU, where the traces recorded it) of every execution. What
belongs to the model endpoint and the host rather than to the traces (decode times, the
critical path's overhead, the no-regret guard's realised steps) is left out: a run learns
them itself. ``aospec run --train-traces DIR --calibration FILE`` fits and saves one
(docs/live.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from aospec.replay.actor import ms_to_ns
from aospec.replay.policies import DrafterSet, parse_policy
from aospec.replay.sandbox import resolve_state_model
from aospec.replay.sweep import _run_one, _seed_trio_scheduler, check_tpots

from aospec.admission import AdmissionModel, CostModel, GuardState
from aospec.errors import ConfigError
from aospec.types import Trace

__all__ = ["fit_admission"]


def fit_admission(
    traces: Sequence[Trace],
    policy: str = "aospec",
    *,
    tpot_ms: float = 10.0,
    state_model: str = "auto",
    drafter_options: Mapping[str, Mapping[str, Any]] | None = None,
    model: AdmissionModel | None = None,
    on_trace_done: Callable[[Trace], None] | None = None,
) -> AdmissionModel:
    """The controller's model fitted on ``traces`` replayed under ``policy`` at ``tpot_ms``
    (see the module docstring); ``model`` is fitted further when given. Traces of a single
    task have no other task to fit drafters on: they are replayed with drafters fitted on
    nothing (ConfigError for no traces at all)."""
    from trio.testing import MockClock

    if not traces:
        raise ConfigError("fitting the admission model needs at least one trace")
    check_tpots([tpot_ms])
    p = parse_policy(policy)
    if p.is_oracle:
        raise ConfigError(f"policy {policy!r} drafts with the oracle: its outcomes say nothing about real drafters")
    p = dataclasses.replace(p, engine=dataclasses.replace(p.engine, admission="off"))
    state_model, _ = resolve_state_model(traces, state_model)
    model = model if model is not None else AdmissionModel()
    # the guard's steps are the host's realised benefit and cost, which a replay with
    # every candidate launched says nothing of: the model's own are set aside meanwhile
    guard, model.guard = model.guard, GuardState()
    tpot_ns = ms_to_ns(tpot_ms)
    by_task: dict[str, list[Trace]] = {}
    for t in traces:
        by_task.setdefault(t.task, []).append(t)

    async def main() -> None:
        for task, own in by_task.items():
            drafters = DrafterSet([t for t in traces if t.task != task], drafter_options)
            for trace in own:
                if trace.steps:
                    await _run_one(trace, p, tpot_ns, drafters, 0, state_model, admission_model=model)
                if on_trace_done is not None:
                    on_trace_done(trace)

    _seed_trio_scheduler(0)
    anyio.run(main, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    fitted = CostModel()
    fitted.tool, fitted.tool_all = model.costs.tool, model.costs.tool_all
    fitted.cpu, fitted.cpu_all = model.costs.cpu, model.costs.cpu_all
    model.costs = fitted  # decode times and overhead are the endpoint's and the host's: learned live
    model.guard = guard
    return model
