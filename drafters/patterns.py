"""PatternDrafter: observations from templates mined over training traces.

Mining (:meth:`PatternDrafter.fit`): each training observation becomes a template by
replacing the action's own command text, where it is echoed, with a slot (the harness's
timeout message ``The last command <command>...</command> timed out ...`` is the typical
case). A template that observations of at least ``min_tasks`` different tasks share
verbatim is *instantiable*: filling the slot with a new command gives an exact candidate
(empty outputs, timeout messages, "command not found", ...).

Probabilities: ``P(template | action)`` by Witten-Bell interpolation over backoff contexts
of the command (command class such as ``python:script:redirect``, then the program, then
none), estimated on the training traces; within a trajectory the counts of its own
earlier steps in the action's most specific context are added on top with a Dirichlet
prior (strength ``trace_prior``), so a command kind that timed out before in this
trajectory makes a timeout more likely. Each draft carries its template's EVD pattern
(``aospec.evd.observation_pattern``) so the pattern kernel groups it with history.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from aospec.drafters._shell import HistoryIndex, command_contexts

from aospec.evd import CMD_SLOT, observation_pattern
from aospec.protocols import ObservationDraft
from aospec.types import Action, History, Trace, Turn

__all__ = ["PatternDrafter", "template_of"]


def template_of(observation: str, command: str | None) -> str:
    """The observation with the echoed command replaced by the slot."""
    if command and len(command) >= 2 and command in observation:
        return observation.replace(command, CMD_SLOT)
    return observation


@dataclass
class _TraceCounts:
    by_ctx: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


def _fold(state: _TraceCounts, i: int, turn: Turn) -> None:
    a = turn.action
    if a.is_none:
        return
    state.by_ctx[command_contexts(a)[0]][template_of(turn.observation, a.command)] += 1


class PatternDrafter:
    """Observation drafter over mined templates (see module docstring)."""

    def __init__(
        self, min_tasks: int = 2, top_per_context: int = 12, trace_prior: float = 4.0, max_chars: int = 20_000
    ) -> None:
        self.min_tasks = min_tasks
        self.top_per_context = top_per_context
        self.trace_prior = trace_prior
        self.max_chars = max_chars
        self._counts: dict[str, Counter[str]] = {}
        self._totals: dict[str, int] = {}
        self._distinct: dict[str, int] = {}
        self._top: dict[str, list[str]] = {}
        self._instantiable: set[str] = set()
        self._keys: dict[str, str] = {}
        self._index: HistoryIndex[_TraceCounts] = HistoryIndex(_TraceCounts, _fold)

    def fit(self, traces: Sequence[Trace]) -> None:
        """Mine templates and their context counts from training traces."""
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        tasks: dict[str, set[str]] = defaultdict(set)
        for trace in traces:
            for step in trace.steps:
                a = step.action
                if a.is_none or not step.completed:
                    continue
                t = template_of(step.observation, a.command)
                tasks[t].add(trace.task)
                for ctx in command_contexts(a):
                    counts[ctx][t] += 1
        self._instantiable = {t for t, ts in tasks.items() if len(ts) >= self.min_tasks and len(t) <= self.max_chars}
        self._counts = dict(counts)
        self._totals = {c: sum(v.values()) for c, v in counts.items()}
        self._distinct = {c: len(v) for c, v in counts.items()}
        self._top = {
            c: [t for t, _ in v.most_common() if t in self._instantiable][: self.top_per_context]
            for c, v in counts.items()
        }
        self._keys = {t: observation_pattern(t) for t in self._instantiable}

    def _p_train(self, template: str, contexts: Sequence[str]) -> float:
        p = 0.0
        for ctx in reversed(contexts):
            total = self._totals.get(ctx)
            if not total:
                continue
            u = self._distinct[ctx]
            p = (self._counts[ctx].get(template, 0) + u * p) / (total + u)
        return p

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        command = action.command
        if command is None or n <= 0:
            return []
        contexts = command_contexts(action)
        local = self._index.update(history).by_ctx.get(contexts[0])
        candidates: dict[str, None] = {}
        for ctx in contexts:
            for t in self._top.get(ctx, ()):
                candidates[t] = None
        local_total = 0
        if local:
            local_total = sum(local.values())
            for t in local:
                if len(t) <= self.max_chars:
                    candidates[t] = None
        out: list[ObservationDraft] = []
        beta = self.trace_prior
        for t in candidates:
            p = self._p_train(t, contexts)
            if local_total:
                p = (local.get(t, 0) + beta * p) / (local_total + beta)  # type: ignore[union-attr]
            if p <= 0.0:
                continue
            key = self._keys.get(t)
            if key is None:
                if len(self._keys) > 200_000:
                    self._keys = {k: self._keys[k] for k in self._instantiable}
                key = self._keys[t] = observation_pattern(t)
            out.append(ObservationDraft(t.replace(CMD_SLOT, command), p, template=key))
        out.sort(key=lambda d: -d.probability)
        return out[:n]
