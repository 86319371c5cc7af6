"""Fault injection for sweeps: an observation drafter whose fitting fails on demand.

``aospec sweep`` retries a failed trace once and then stops, naming the trace, the policy
and the TPOT (replay/executors.py). To see that on a real sweep, on any executor, name this
drafter in a policy and give it options::

    aospec sweep --bundled --policies serial,aospec:obs_drafter=aospec.replay.faults.FaultyObservationDrafter \\
        --drafter-options '{"aospec.replay.faults.FaultyObservationDrafter": {"fail_on_task": "oom", "times": 1, "marker": "/tmp/faults"}}'

It is the pattern drafter (drafters/patterns.py) except that ``fit`` raises
:class:`InjectedFault` when it is fit for evaluating ``fail_on_task`` under
leave-one-task-out (its training set holds no trace of that task), ``times`` times in all
(every time when negative; a limited count needs ``marker``), counted across processes
and hosts sharing ``marker`` (a file: one line per fault raised). Without ``fail_on_task`` it never fails.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aospec.drafters.patterns import PatternDrafter

from aospec.types import Trace

__all__ = ["FaultyObservationDrafter", "InjectedFault"]


class InjectedFault(RuntimeError):
    """The failure :class:`FaultyObservationDrafter` was asked to raise."""


class FaultyObservationDrafter(PatternDrafter):
    """The pattern drafter, failing its ``fit`` on demand (see the module docstring)."""

    def __init__(self, fail_on_task: str = "", times: int = -1, marker: str = "", **options: Any) -> None:
        super().__init__(**options)
        self.fail_on_task = fail_on_task
        self.times = times
        self.marker = marker

    def _faults_so_far(self) -> int:
        try:
            return len(Path(self.marker).read_text(encoding="utf-8").splitlines())
        except FileNotFoundError:
            return 0

    def fit(self, traces: Sequence[Trace]) -> None:
        evaluating = self.fail_on_task and not any(t.task == self.fail_on_task for t in traces)
        if evaluating and (self.times < 0 or (self.marker and self._faults_so_far() < self.times)):
            if self.marker:
                with open(self.marker, "a", encoding="utf-8") as f:
                    f.write(f"{os.getpid()}\n")
            raise InjectedFault(f"injected fault: fitting drafters for task {self.fail_on_task!r}")
        super().fit(traces)
