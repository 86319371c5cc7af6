"""Expected Value Decoding: rank drafted observations by the tool time they would hide.

A drafted observation ``c`` of an action in flight is worth ``p(c) * T(c)``: the chance
that it is byte-identical to the real observation times the tool time a continuation
started on it can hide. ``T(c)`` is a kernel regression over historical
(observation, tool time) pairs::

    T(c) = sum_j K(c, o_j) T_j / sum_j K(c, o_j)

with a pluggable similarity kernel :class:`aospec.protocols.Kernel`. The default
:class:`PatternKernel` is pattern equality: two observations are similar (1) when they
instantiate the same mined pattern (numbers, paths, hex ids and the echoed command
abstracted away), else 0. Kernels with a ``key`` method (:class:`aospec.protocols.GroupedKernel`)
are evaluated through grouped sums in O(1) per candidate; any other kernel (e.g.
embeddings) is evaluated over all pairs.

The ablation rankings are ``likelihood`` (``p(c)`` only) and ``tooltime`` (``T(c)`` only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from aospec.errors import ConfigError
from aospec.protocols import GroupedKernel, Kernel, ObservationDraft
from aospec.types import Action, Trace

__all__ = ["CMD_SLOT", "EVDEstimator", "EVDSession", "PatternKernel", "observation_pattern", "rank_drafts"]

#: Placeholder for the action's own command text echoed in an observation.
CMD_SLOT = "\x00CMD\x00"

_PATTERN_LIMIT = 4096
_ABSTRACTIONS = (
    (re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"(?:~|\.{1,2})?(?:/[\w.@+-]+)+/?"), "<path>"),
    (re.compile(r"\d+(?:[.:,]\d+)*"), "<n>"),
    (re.compile(r"[ \t]+"), " "),
)


def observation_pattern(text: str, command: str | None = None) -> str:
    """The pattern an observation instantiates: the echoed ``command`` becomes a slot, then
    hex ids, paths and numbers are abstracted and runs of blanks collapsed.

    Only the first 4 KiB count: long outputs rarely repeat verbatim and their tail adds
    nothing to grouping.
    """
    if command and len(command) >= 2 and command in text:
        text = text.replace(command, CMD_SLOT)
    text = text[:_PATTERN_LIMIT]
    for regex, repl in _ABSTRACTIONS:
        text = regex.sub(repl, text)
    return text


class PatternKernel:
    """K(c, o) = 1 when ``c`` and ``o`` instantiate the same observation pattern, else 0."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str | None], str] = {}

    def key(self, text: str, command: str | None = None) -> str:
        """The group an observation belongs to (its pattern); memoised."""
        memo_key = (text, command)
        key = self._memo.get(memo_key)
        if key is None:
            if len(self._memo) > 100_000:
                self._memo.clear()
            key = self._memo[memo_key] = observation_pattern(text, command)
        return key

    def similarities(self, candidate: str, observations: Sequence[str]) -> Sequence[float]:
        k = self.key(candidate)
        return [1.0 if self.key(o) == k else 0.0 for o in observations]


class EVDEstimator:
    """Historical (observation, tool time) pairs and a kernel; estimates ``T(c)``.

    Fit it on training traces (:meth:`fit`), then open one :meth:`session` per engine run:
    a session adds the run's own verified pairs without changing the estimator, so runs
    never see each other's observations.
    """

    def __init__(self, kernel: Kernel | None = None) -> None:
        self.kernel: Any = kernel if kernel is not None else PatternKernel()
        self._grouped = isinstance(self.kernel, GroupedKernel)
        self._sums: dict[str, list[float]] = {}
        self._obs: list[str] = []
        self._times: list[float] = []
        self._total = 0.0
        self._count = 0

    @property
    def prior_s(self) -> float:
        """Mean tool time over all pairs: the estimate for an observation like none seen."""
        return self._total / self._count if self._count else 0.0

    def add(self, observation: str, tool_s: float, command: str | None = None) -> None:
        """Add one historical pair."""
        self._total += tool_s
        self._count += 1
        if self._grouped:
            cell = self._sums.setdefault(self.kernel.key(observation, command), [0.0, 0.0])
            cell[0] += tool_s
            cell[1] += 1.0
        else:
            self._obs.append(observation)
            self._times.append(tool_s)

    def fit(self, traces: Sequence[Trace]) -> None:
        """Add every completed step with a known tool time of ``traces``."""
        for trace in traces:
            for step in trace.steps:
                if step.completed and step.tool_duration_s is not None and not step.action.is_none:
                    self.add(step.observation, step.tool_duration_s, step.action.command)

    def _estimate(self, key: str | None, text: str, session: EVDSession | None) -> float:
        if self._grouped:
            if key is None:
                key = self.kernel.key(text)
            num = den = 0.0
            cell = self._sums.get(key)
            if cell is not None:
                num, den = cell
            if session is not None and (cell := session._extra.get(key)) is not None:
                num += cell[0]
                den += cell[1]
            return num / den if den > 0 else self.prior_s
        obs, times = self._obs, self._times
        if session is not None and session._extra_obs:
            obs, times = obs + session._extra_obs, times + session._extra_times
        if not obs:
            return self.prior_s
        weights = np.asarray(self.kernel.similarities(text, obs), dtype=float)
        den = float(weights.sum())
        if den <= 0:
            return self.prior_s
        return float(weights @ np.asarray(times, dtype=float)) / den

    def tool_time(self, draft: ObservationDraft) -> float:
        """``T(c)`` in seconds for one draft (its ``template`` is used as the group when set)."""
        return self._estimate(draft.template, draft.text, None)

    def session(self) -> EVDSession:
        """A per-run view that also learns from the run's verified observations."""
        return EVDSession(self)


class EVDSession:
    """One run's view of an :class:`EVDEstimator`; :meth:`observe` adds verified pairs."""

    __slots__ = ("_extra", "_extra_obs", "_extra_times", "estimator")

    def __init__(self, estimator: EVDEstimator) -> None:
        self.estimator = estimator
        self._extra: dict[str, list[float]] = {}
        self._extra_obs: list[str] = []
        self._extra_times: list[float] = []

    def observe(self, action: Action, observation: str, tool_s: float) -> None:
        est = self.estimator
        if est._grouped:
            cell = self._extra.setdefault(est.kernel.key(observation, action.command), [0.0, 0.0])
            cell[0] += tool_s
            cell[1] += 1.0
        else:
            self._extra_obs.append(observation)
            self._extra_times.append(tool_s)

    def tool_time(self, draft: ObservationDraft) -> float:
        return self.estimator._estimate(draft.template, draft.text, self)


def rank_drafts(
    drafts: Iterable[ObservationDraft],
    rank: str,
    budget: int,
    evd: EVDSession | None,
    *,
    min_probability: float = 0.0,
) -> list[ObservationDraft]:
    """The ``budget`` best drafts under ranking ``rank`` (evd, likelihood, tooltime).

    Equal texts are merged (highest probability kept). Ties keep the drafters' order.
    """
    best: dict[str, ObservationDraft] = {}
    for d in drafts:
        if d.probability < min_probability:
            continue
        prev = best.get(d.text)
        if prev is None or d.probability > prev.probability:
            best[d.text] = d
    items = list(best.values())
    if len(items) <= 1 or rank == "likelihood" or evd is None:
        if rank == "likelihood" or evd is None:
            items.sort(key=lambda d: -d.probability)
        return items[:budget]
    if rank == "evd":
        scores = [d.probability * evd.tool_time(d) for d in items]
    elif rank == "tooltime":
        scores = [evd.tool_time(d) for d in items]
    else:
        raise ConfigError(f"unknown ranking {rank!r}; known: evd, likelihood, tooltime")
    order = sorted(range(len(items)), key=lambda i: (-scores[i], -items[i].probability, i))
    return [items[i] for i in order[:budget]]
