"""ObservationCache: reuse observations of earlier identical (action, state) pairs.

This is the SpecHop-cache drafter. Within a trajectory, the candidate for action ``a`` is
the observation ``a`` produced the last time it ran. The state is tracked through the
conservative effect classifier (:func:`aospec.effects.classify_action`): if no action that
may change the filesystem ran since, the state is taken as unchanged. Probabilities are
learned in :meth:`ObservationCache.fit` as the fraction of such repeats in the training
traces whose observation was byte-identical (separately for unchanged and possibly changed
state), with a Beta(1, 1) prior. Across trajectories, observations that training traces of
at least ``min_traces`` different tasks produced for the same exact action are also offered.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from aospec.drafters._shell import HistoryIndex

from aospec.effects import classify_action
from aospec.protocols import ObservationDraft
from aospec.types import Action, Effect, History, Trace, Turn

__all__ = ["ObservationCache"]


@dataclass
class _TraceState:
    last: dict[str, tuple[int, str]] = field(default_factory=dict)
    last_change: int = -1


def _fold(state: _TraceState, i: int, turn: Turn) -> None:
    if turn.action.is_none:
        return
    state.last[turn.action.key] = (i, turn.observation)
    if classify_action(turn.action) is Effect.MAY_CHANGE:
        state.last_change = i


class ObservationCache:
    """Observation drafter reusing earlier results of the same action (see module doc)."""

    def __init__(self, min_traces: int = 2, min_probability: float = 0.05) -> None:
        self.min_traces = min_traces
        self.min_probability = min_probability
        self.p_same_state = 0.5
        self.p_changed_state = 0.5
        self._global: dict[str, tuple[str, float]] = {}
        self._index: HistoryIndex[_TraceState] = HistoryIndex(_TraceState, _fold)

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn repeat-hit rates and the cross-trajectory table from training traces."""
        hits = {True: [0, 0], False: [0, 0]}
        by_action: dict[str, Counter[str]] = defaultdict(Counter)
        tasks_by_pair: dict[tuple[str, str], set[str]] = defaultdict(set)
        for trace in traces:
            state = _TraceState()
            for i, step in enumerate(trace.steps):
                a = step.action
                if a.is_none or not step.completed:
                    _fold(state, i, Turn(a, step.observation))
                    continue
                prev = state.last.get(a.key)
                if prev is not None:
                    same = state.last_change < prev[0]
                    cell = hits[same]
                    cell[0] += prev[1] == step.observation
                    cell[1] += 1
                by_action[a.key][step.observation] += 1
                tasks_by_pair[(a.key, step.observation)].add(trace.task)
                _fold(state, i, Turn(a, step.observation))
        self.p_same_state = (hits[True][0] + 1) / (hits[True][1] + 2)
        self.p_changed_state = (hits[False][0] + 1) / (hits[False][1] + 2)
        self._global = {}
        for key, counts in by_action.items():
            obs, c = counts.most_common(1)[0]
            if len(tasks_by_pair[(key, obs)]) >= self.min_traces:
                self._global[key] = (obs, c / (sum(counts.values()) + 1))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if action.is_none or n <= 0:
            return []
        state = self._index.update(history)
        out: list[ObservationDraft] = []
        prev = state.last.get(action.key)
        if prev is not None:
            i, obs = prev
            same = state.last_change < i
            p = self.p_same_state if same else self.p_changed_state
            if p >= self.min_probability:
                out.append(ObservationDraft(obs, p))
        glob = self._global.get(action.key)
        if glob is not None and glob[1] >= self.min_probability and (not out or out[0].text != glob[0]):
            out.append(ObservationDraft(glob[0], glob[1]))
        return out[:n]
