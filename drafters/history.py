"""HistoryActionDrafter: next actions from an n-gram model over canonical actions.

Three sources of candidates, each with a probability estimated on the training traces:

- **Skeleton model** (learned across tasks): an action is abstracted relative to the one
  before it -- tokens that name a path of the previous command line (its redirect/tee
  target first) become slots -- so ``cat <<'EOF' > train.py`` followed by
  ``python train.py`` is the skeleton ``python $0`` after a ``cat::heredoc,redirect|.py``
  command. ``P(skeleton | previous action)`` is Witten-Bell interpolated over backoff
  contexts (command class + extension of its first path, program, none); counts of the
  current trajectory's own transitions are added on top with a Dirichlet prior.
- **Within-trajectory successors** (PPM order 1 over exact actions): what followed the
  previous action the earlier times it ran in this trajectory.
- **Within-trajectory repetition**: the ``r``-th most recent distinct action, with the
  training rate at which the next action repeats it.

A candidate found by several sources gets the noisy-or of their probabilities. Lookahead
(offset ``k > 0``) chains the most likely candidates, but only through actions the effect
classifier calls read-only: a target behind a state change could never pass JASV.
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from aospec.effects import classify_action
from aospec.protocols import ActionDraft
from aospec.types import Action, Effect, History, Trace, Turn
from drafters._shell import HistoryIndex, command_class, entities, program

__all__ = ["HistoryActionDrafter", "skeleton"]

_START = Action("<start>")
_MAX_CHARS = 400


def _slot(k: int) -> str:
    return f"\x00{k}\x00"


_SLOT_RE = re.compile("\x00(\\d+)\x00")


@functools.lru_cache(maxsize=1 << 16)
def skeleton(action: Action, previous: Action) -> str | None:
    """``action``'s command with the previous command line's paths turned into slots
    (None for non-shell or very long actions, which are not modelled)."""
    cmd = action.command
    if cmd is None or len(cmd) > _MAX_CHARS or "\x00" in cmd:
        return None
    prev = previous.command
    if prev:
        ents = entities(prev)
        for k, e in sorted(enumerate(ents), key=lambda ke: -len(ke[1])):
            if len(e) >= 3 and e in cmd:
                slot = _slot(k)
                cmd = re.sub(r"(?<![\w.\-])" + re.escape(e) + r"(?![\w\-]|\.\w)", lambda _m, s=slot: s, cmd)
    return cmd


@functools.lru_cache(maxsize=1 << 16)
def _instantiate(skel: str, previous: Action) -> Action | None:
    if "\x00" not in skel:
        return Action.bash(skel)
    ents = entities(previous.command or "")
    ok = True

    def sub(m: re.Match[str]) -> str:
        nonlocal ok
        k = int(m.group(1))
        if k >= len(ents):
            ok = False
            return ""
        return ents[k]

    text = _SLOT_RE.sub(sub, skel)
    return Action.bash(text) if ok else None


@functools.lru_cache(maxsize=1 << 14)
def _contexts(previous: Action) -> tuple[str, ...]:
    cmd = previous.command
    if cmd is None:
        return (f"tool:{previous.tool}", "")
    ents = entities(cmd)
    ext = ""
    if ents:
        base = ents[0].rsplit("/", 1)[-1]
        ext = base[base.rfind(".") :] if "." in base else "/"
    return (f"{command_class(cmd)}|{ext}", program(cmd), "")


@dataclass
class _TraceState:
    prev: Action = _START
    followers: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    actions: dict[str, Action] = field(default_factory=dict)
    recent: list[str] = field(default_factory=list)
    skel_counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


def _fold(state: _TraceState, i: int, turn: Turn) -> None:
    a = turn.action
    state.followers[state.prev.key][a.key] += 1
    state.actions[a.key] = a
    sk = skeleton(a, state.prev)
    if sk is not None:
        state.skel_counts[_contexts(state.prev)[0]][sk] += 1
    if a.key in state.recent:
        state.recent.remove(a.key)
    state.recent.append(a.key)
    state.prev = a


class HistoryActionDrafter:
    """Action drafter over action histories (see module docstring)."""

    def __init__(self, max_recent: int = 6, top_per_context: int = 10, trace_prior: float = 2.0) -> None:
        self.max_recent = max_recent
        self.top_per_context = top_per_context
        self.trace_prior = trace_prior
        self._counts: dict[str, Counter[str]] = {}
        self._totals: dict[str, int] = {}
        self._distinct: dict[str, int] = {}
        self._top: dict[str, list[str]] = {}
        self.p_successor = 0.3
        self.p_repeat: list[float] = [0.1] * max_recent
        self._memo: dict[Action, list[tuple[str, Action, float]]] = {}
        self._index: HistoryIndex[_TraceState] = HistoryIndex(_TraceState, _fold)

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn skeleton transitions and within-trajectory rates from training traces."""
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        succ_hit = succ_n = 0
        rep_hits = [0] * self.max_recent
        rep_n = 0
        for trace in traces:
            state = _TraceState()
            for i, step in enumerate(trace.steps):
                a = step.action
                sk = skeleton(a, state.prev)
                if sk is not None:
                    for ctx in _contexts(state.prev):
                        counts[ctx][sk] += 1
                fol = state.followers.get(state.prev.key)
                if fol:
                    succ_n += 1
                    succ_hit += fol.most_common(1)[0][0] == a.key
                if state.recent:
                    rep_n += 1
                    recent = state.recent[::-1][: self.max_recent]
                    if a.key in recent:
                        rep_hits[recent.index(a.key)] += 1
                _fold(state, i, Turn(a, step.observation))
        self._counts = dict(counts)
        self._totals = {c: sum(v.values()) for c, v in counts.items()}
        self._distinct = {c: len(v) for c, v in counts.items()}
        self._top = {c: [s for s, _ in v.most_common(self.top_per_context)] for c, v in counts.items()}
        self.p_successor = (succ_hit + 1) / (succ_n + 2)
        self.p_repeat = [(h + 0.5) / (rep_n + 1) for h in rep_hits]
        self._memo = {}

    def _p_train(self, skel: str, contexts: Sequence[str]) -> float:
        p = 0.0
        for ctx in reversed(contexts):
            total = self._totals.get(ctx)
            if not total:
                continue
            u = self._distinct[ctx]
            p = (self._counts[ctx].get(skel, 0) + u * p) / (total + u)
        return p

    def _train_candidates(self, prev: Action) -> list[tuple[str, Action, float]]:
        """(skeleton, action, training probability) after ``prev`` (memoised)."""
        found = self._memo.get(prev)
        if found is None:
            contexts = _contexts(prev)
            found = []
            for sk in dict.fromkeys(s for ctx in contexts for s in self._top.get(ctx, ())):
                a = _instantiate(sk, prev)
                if a is not None:
                    found.append((sk, a, self._p_train(sk, contexts)))
            if len(self._memo) > 50_000:
                self._memo.clear()
            self._memo[prev] = found
        return found

    def _next(self, state: _TraceState, prev: Action) -> dict[str, tuple[Action, float]]:
        """Candidates for the action after ``prev``: key -> (action, probability)."""
        contexts = _contexts(prev)
        local_sk = state.skel_counts.get(contexts[0])
        local_total = sum(local_sk.values()) if local_sk else 0
        miss: dict[str, float] = {}
        acts: dict[str, Action] = {}

        def add(a: Action, p: float) -> None:
            if p <= 0.0:
                return
            acts[a.key] = a
            miss[a.key] = miss.get(a.key, 1.0) * (1.0 - min(p, 0.999))

        beta = self.trace_prior
        seen: set[str] = set()
        for sk, a, p in self._train_candidates(prev):
            if local_total:
                seen.add(sk)
                p = (local_sk.get(sk, 0) + beta * p) / (local_total + beta)  # type: ignore[union-attr]
            add(a, p)
        if local_sk:
            for sk, c in local_sk.items():
                if sk in seen:
                    continue
                a = _instantiate(sk, prev)
                if a is not None:
                    add(a, (c + beta * self._p_train(sk, contexts)) / (local_total + beta))
        fol = state.followers.get(prev.key)
        if fol:
            total = sum(fol.values())
            for key, c in fol.items():
                add(state.actions[key], self.p_successor * c / total)
        for r, key in enumerate(reversed(state.recent[-self.max_recent :])):
            add(state.actions[key], self.p_repeat[r])
        return {k: (acts[k], 1.0 - m) for k, m in miss.items()}

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if width <= 0:
            return []
        state = self._index.update(history)
        first = self._next(state, state.prev)
        ranked = sorted(first.values(), key=lambda ap: -ap[1])
        out = [ActionDraft(a, 0, p) for a, p in ranked[:width]]
        frontier = [(a, p) for a, p in ranked[:2]]
        for offset in range(1, depth):
            nxt: list[tuple[Action, float]] = []
            for a, p in frontier:
                if a.is_none or classify_action(a) is not Effect.READ_ONLY:
                    continue
                for b, q in self._next(state, a).values():
                    nxt.append((b, p * q))
            nxt.sort(key=lambda ap: -ap[1])
            out.extend(ActionDraft(b, offset, q) for b, q in nxt[:width])
            frontier = nxt[:2]
        out.sort(key=lambda d: -d.probability)
        return out[:width]
