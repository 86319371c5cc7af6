"""Markov prefetch over tool transitions (SpecBox: Laplace alpha=1, lambda=5, tau=0.6, B=1).

:class:`MarkovPrefetcher` counts transitions between tool labels (:func:`aospec.specbox.routers.tool_label`:
a shell command's program, else the tool name; a trace starts in the state ``<start>``) and
predicts the next tool with Laplace smoothing::

    P(next = t | context c) = (count(c, t) + alpha) / (count(c) + alpha * |V|)

over the vocabulary V of labels seen in training. ``order`` > 1 conditions on the last
``order`` labels with PPM-style backoff: the longest context seen at least ``min_count``
times in training is used, else the next shorter one, down to order 1 (and the start
state's distribution for an empty history).

:meth:`MarkovPrefetcher.prefetch` is what a prewarm pool asks after each step: at most
``budget`` (B) tools whose probability is at least ``tau`` (τ) and whose cost is at least
``lam`` (λ) — costs are per tool, in milliseconds by default the mean recorded tool
duration in the training traces (a tool without a recorded cost passes the cost filter;
``respond`` and ``none`` are never prefetched). :meth:`observe` updates the counts online
(O(order) dict updates).

It is also an :class:`aospec.protocols.ActionDrafter`: ``propose(history, width, depth)``
takes the next-tool distribution (offset 0; for offset k > 0 the first-order chain pushed
k steps further) and, for each likely tool, the actions recorded with that label in
training, each with probability ``P(tool) * P(action | tool)`` (``P(action | tool)``: the
action's share of that label's training actions). For bash this proposes, e.g., the
commonest ``ls -la`` when ``ls`` is the likely next program: an exact repeat of a recorded
command, which JASV only reuses when the actor emits exactly it. Once a router has named
the tool being decoded, ``propose_routed(history, tool, width)`` proposes that label's
recorded actions with ``P(action | tool)`` (a RoutedActionDrafter).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aospec.specbox.routers import NON_CALLS, tool_label

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.types import Action, History, Trace

__all__ = ["START", "MarkovPrefetcher", "MarkovScore", "evaluate_markov", "prefetch_task", "tool_costs_ms"]

#: The state before a trace's first step.
START = "<start>"


def tool_costs_ms(traces: Sequence[Trace]) -> dict[str, float]:
    """Mean recorded tool duration per label, in milliseconds (labels with no recorded
    duration are left out)."""
    total: dict[str, float] = defaultdict(float)
    n: Counter[str] = Counter()
    for t in traces:
        for s in t.steps:
            if s.tool_duration_s is not None:
                lab = tool_label(s.action)
                total[lab] += 1000.0 * s.tool_duration_s
                n[lab] += 1
    return {lab: total[lab] / n[lab] for lab in n}


class MarkovPrefetcher:
    """Next-tool prediction over tool transitions, with prefetch thresholds; an ActionDrafter."""

    def __init__(
        self,
        *,
        alpha: float = 1.0,
        lam: float = 5.0,
        tau: float = 0.6,
        budget: int = 1,
        order: int = 1,
        min_count: int = 1,
        costs: Mapping[str, float] | None = None,
        max_actions_per_tool: int = 16,
    ) -> None:
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ConfigError(f"alpha must be a finite number >= 0, got {alpha!r}")
        if not 0.0 <= tau <= 1.0:
            raise ConfigError(f"tau must be in [0, 1], got {tau!r}")
        if not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"budget must be an integer >= 0, got {budget!r}")
        if not isinstance(order, int) or order < 1:
            raise ConfigError(f"order must be an integer >= 1, got {order!r}")
        self.alpha = float(alpha)
        self.lam = float(lam)
        self.tau = float(tau)
        self.budget = budget
        self.order = order
        self.min_count = min_count
        self.costs: dict[str, float] = dict(costs or {})
        self.max_actions_per_tool = max_actions_per_tool
        # context (tuple of the last k labels, k = 1..order) -> next label -> count
        self.counts: dict[tuple[str, ...], Counter[str]] = defaultdict(Counter)
        self.totals: Counter[tuple[str, ...]] = Counter()
        self.vocab: set[str] = set()
        self.actions: dict[str, Counter[Action]] = defaultdict(Counter)
        self._recent: list[str] = [START]

    # ---------------------------------------------------------------- fitting

    def fit(self, traces: Sequence[Trace]) -> None:
        """Count the transitions and actions of ``traces`` (adds to what is counted);
        costs default to :func:`tool_costs_ms` of them when none were given."""
        for t in traces:
            self.reset()
            for s in t.steps:
                self.observe(tool_label(s.action), s.action)
        self.reset()
        if not self.costs:
            self.costs = tool_costs_ms(traces)

    def reset(self) -> None:
        """Start a new trajectory (the context becomes the start state)."""
        self._recent = [START]

    def observe(self, tool: str, action: Action | None = None) -> None:
        """The step just decoded was a call of ``tool`` (its ``action`` when known): count the
        transition from the current context and move on."""
        recent = self._recent
        for k in range(1, min(self.order, len(recent)) + 1):
            ctx = tuple(recent[-k:])
            self.counts[ctx][tool] += 1
            self.totals[ctx] += 1
        self.vocab.add(tool)
        if action is not None:
            self.actions[tool][action] += 1
        recent.append(tool)
        if len(recent) > self.order:
            del recent[: len(recent) - self.order]

    # ---------------------------------------------------------------- prediction

    def _context(self, seq: Sequence[str]) -> tuple[str, ...]:
        """The longest context (suffix of ``seq``, the start state and the labels after it)
        seen at least ``min_count`` times; the order-1 one when none is."""
        for k in range(min(self.order, len(seq)), 0, -1):
            ctx = tuple(seq[-k:])
            if self.totals[ctx] >= self.min_count:
                return ctx
        return (seq[-1],)

    def distribution(self, labels: Sequence[str] | None = None) -> dict[str, float]:
        """P(next tool) after the labels ``labels`` (default: what :meth:`observe` saw since
        the last reset), Laplace-smoothed over the vocabulary."""
        ctx = self._context(self._recent if labels is None else [START, *labels])
        vocab = self.vocab
        if not vocab:
            return {}
        counts = self.counts.get(ctx, Counter())
        denom = self.totals[ctx] + self.alpha * len(vocab)
        if denom <= 0:
            return {t: 1.0 / len(vocab) for t in vocab}
        return {t: (counts.get(t, 0) + self.alpha) / denom for t in vocab}

    def predict(self, labels: Sequence[str] | None = None, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` most likely next tools with their probabilities, best first."""
        dist = self.distribution(labels)
        return sorted(dist.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    def cost(self, tool: str) -> float:
        return self.costs.get(tool, math.inf)

    def prefetch(self, labels: Sequence[str] | None = None) -> list[tuple[str, float]]:
        """Tools to prefetch now: probability >= tau, cost >= lam, not a non-call, at most
        ``budget`` of them, most likely first."""
        out: list[tuple[str, float]] = []
        if self.budget == 0:
            return out
        for tool, p in self.predict(labels, k=len(self.vocab)):
            if p < self.tau:
                break
            if tool in NON_CALLS or self.cost(tool) < self.lam:
                continue
            out.append((tool, p))
            if len(out) >= self.budget:
                break
        return out

    # ---------------------------------------------------------------- ActionDrafter

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        """Up to ``width`` likely next actions, ``depth`` steps ahead at most (see the module
        docstring): probability ``P_offset(tool) * P(action | tool)``."""
        if width <= 0 or depth <= 0 or not self.vocab:
            return []
        labels = [tool_label(a) for a in history.actions]
        dist = self.distribution(labels)
        drafts: list[ActionDraft] = []
        for offset in range(depth):
            for tool, p in dist.items():
                if tool in NON_CALLS:
                    continue
                acts = self.actions.get(tool)
                if not acts:
                    continue
                n = sum(acts.values())
                for action, c in acts.most_common(self.max_actions_per_tool):
                    drafts.append(ActionDraft(action, offset, p * c / n))
            if offset + 1 < depth:
                dist = self._step(dist)
        drafts.sort(key=lambda d: (-d.probability, d.offset, d.action.key))
        return drafts[:width]

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        """Once a router has named the ``tool`` of the action being decoded
        (:class:`aospec.protocols.RoutedActionDrafter`): the actions recorded (in training and
        by :meth:`observe`) with that label, most frequent first, each at offset 0 with
        ``P(action | tool)``, its share of the label's recorded actions. Nothing for a
        non-call label or one never recorded."""
        acts = self.actions.get(tool)
        if width <= 0 or tool in NON_CALLS or not acts:
            return []
        n = sum(acts.values())
        ranked = sorted(acts.items(), key=lambda ac: (-ac[1], ac[0].key))[:width]
        return [ActionDraft(action, 0, c / n) for action, c in ranked]

    def _step(self, dist: Mapping[str, float]) -> dict[str, float]:
        """The first-order chain one step further: sum_t P(t) * P(. | t)."""
        out: dict[str, float] = defaultdict(float)
        for t, p in dist.items():
            if p <= 0:
                continue
            for u, q in self.distribution_after(t).items():
                out[u] += p * q
        return dict(out)

    def distribution_after(self, tool: str) -> dict[str, float]:
        ctx = (tool,)
        counts = self.counts.get(ctx, Counter())
        denom = self.totals[ctx] + self.alpha * len(self.vocab)
        return {t: (counts.get(t, 0) + self.alpha) / denom for t in self.vocab} if denom > 0 else {}


@dataclass(frozen=True, slots=True)
class MarkovScore:
    """Next-tool prediction on held-out traces: top-1/top-3 accuracy over all steps, and the
    prefetch decisions (steps where something was prefetched; how many were right)."""

    steps: int
    top1: int
    top3: int
    prefetched: int
    prefetch_hits: int

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "top1": round(self.top1 / self.steps, 4) if self.steps else None,
            "top3": round(self.top3 / self.steps, 4) if self.steps else None,
            "prefetch_rate": round(self.prefetched / self.steps, 4) if self.steps else None,
            "prefetch_precision": round(self.prefetch_hits / self.prefetched, 4) if self.prefetched else None,
        }


def evaluate_markov(model: MarkovPrefetcher, traces: Sequence[Trace]) -> MarkovScore:
    """Predict each step's label of ``traces`` from the labels before it (the model is not
    updated on them)."""
    steps = top1 = top3 = prefetched = hits = 0
    for t in traces:
        labels: list[str] = []
        for s in t.steps:
            lab = tool_label(s.action)
            ranked = [tool for tool, _ in model.predict(labels, k=3)]
            steps += 1
            top1 += bool(ranked) and ranked[0] == lab
            top3 += lab in ranked
            pf = model.prefetch(labels)
            if pf:
                prefetched += 1
                hits += any(tool == lab for tool, _ in pf)
            labels.append(lab)
    return MarkovScore(steps, top1, top3, prefetched, hits)


async def prefetch_task(
    model: MarkovPrefetcher,
    receive: Any,
    on_prefetch: Any,
) -> None:
    """The background variant: for each ``(tool, action)`` (action may be None) from the anyio
    receive stream ``receive``, :meth:`~MarkovPrefetcher.observe` it and pass the tools to
    prefetch now to ``on_prefetch`` (a function or a coroutine function) when there are any.
    Returns when the stream is closed; cancel-safe (holds nothing)."""
    import inspect

    async with receive:
        async for tool, action in receive:
            model.observe(tool, action)
            tools = model.prefetch()
            if tools:
                result = on_prefetch(tools)
                if inspect.isawaitable(result):
                    await result
