"""HistoryActionDrafter: next actions from an n-gram model over canonical actions.

Three sources of candidates, each with a probability estimated on the training traces:

- **Skeleton model** (learned across tasks): an action is abstracted relative to the one
  before it -- tokens that name a path of the previous command line (its redirect/tee
  target first) become slots -- so ``cat <<'EOF' > train.py`` followed by
  ``python train.py`` is the skeleton ``python $0`` after a ``cat::heredoc,redirect|.py``
  command. A tool call (function-calling harnesses) is abstracted the same way: argument
  values equal to one of the previous action's values become slots, so
  ``search_onestop_flight`` with the arguments of the ``search_direct_flight`` before it
  is one skeleton across tasks. ``P(skeleton | previous action)`` is Witten-Bell
  interpolated over backoff contexts (command class + extension of its first path,
  program, none; for a tool call: its tool, none); counts of the current trajectory's own
  transitions are added on top with a Dirichlet prior.
- **Within-trajectory successors** (PPM order 1 over exact actions): what followed the
  previous action the earlier times it ran in this trajectory.
- **Within-trajectory repetition**: the ``r``-th most recent distinct action, with the
  training rate at which the next action repeats it.

A candidate found by several sources gets the noisy-or of their probabilities. Lookahead
(offset ``k > 0``) chains the most likely candidates, but only through actions the effect
classifier calls read-only: a target behind a state change could never pass JASV.

**Time decay.** Within the trajectory, a transition seen ``age`` steps ago counts
``2 ** (-age / half_life)`` (``half_life`` steps, default 8; 0 turns decay off) in the
successor and skeleton counts, so the current phase of work (editing one file, re-running
one test) outweighs what the agent did long ago, and an old habit's counts fade back to
the training prior. Repetition is positional already (the ``r``-th most recent distinct
action has its own learned rate). Training transitions are not decayed: training traces
share no clock with the current trajectory, and a step's position in *another* trajectory
says nothing about its recency here.

**Per-harness models.** ``fit`` keeps the statistics of each harness (``Trace.harness``)
besides the pooled ones when the training traces come from several harnesses. The harness
model refines the pooled one at every backoff level (Witten-Bell: a context the harness
has seen often is the harness's own; a rare one stays close to the pooled estimate), and
the within-trajectory rates shrink towards the pooled rates with ``harness_prior``
pseudo-observations. At propose time the harness is the ``harness`` option when given,
else inferred from the history: naive Bayes over tool names and observation formats
learned in ``fit``, used once its posterior reaches 0.95 (the pooled model until then).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aospec.drafters._shell import HistoryIndex, command_class, entities, program

from aospec.effects import classify_action
from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.types import Action, Effect, History, Trace, Turn, canonical_json

__all__ = ["HistoryActionDrafter", "skeleton"]

_START = Action("<start>")
_MAX_CHARS = 400


def _slot(k: int) -> str:
    return f"\x00{k}\x00"


_SLOT_RE = re.compile("\x00(\\d+)\x00")


#: Prefix of a tool-call skeleton: ``\x01tool\x01{canonical JSON args with slots}``.
_CALL = "\x01"


@functools.lru_cache(maxsize=1 << 14)
def _values(action: Action) -> tuple[str, ...]:
    """What a next action may refer back to: the path-like tokens of a shell command, else
    a tool call's string argument values (by sorted argument path), each once."""
    cmd = action.command
    if cmd is not None:
        return tuple(entities(cmd))
    out: dict[str, None] = {}

    def walk(v: object) -> None:
        if isinstance(v, str):
            if 3 <= len(v) <= 200:
                out[v] = None
        elif isinstance(v, Mapping):
            for k in sorted(v):
                walk(v[k])
        elif isinstance(v, tuple):
            for x in v:
                walk(x)

    walk(action.args)
    return tuple(out)


def _map_strings(value: Any, fn: Callable[[str], str | None]) -> Any:
    """``value`` (thawed JSON) with every string replaced by ``fn(string)``; None if ``fn``
    gave None for one."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out[k] = m = _map_strings(v, fn)
            if m is None and v is not None:
                return None
        return out
    if isinstance(value, list):
        items = [_map_strings(v, fn) for v in value]
        return None if any(m is None and v is not None for m, v in zip(items, value, strict=True)) else items
    return value


@functools.lru_cache(maxsize=1 << 16)
def skeleton(action: Action, previous: Action) -> str | None:
    """``action`` with what the previous action named turned into slots: the previous
    command line's paths inside a shell command, or (tool calls) argument values equal to
    one of the previous action's values (:func:`_values`). None for the non-action and very
    long actions, which are not modelled."""
    cmd = action.command
    if cmd is None:
        if action.is_none or "\x00" in action.key:
            return None
        ents = {e: k for k, e in reversed(list(enumerate(_values(previous))))}
        args = _map_strings(action.to_json()["args"], lambda v: _slot(ents[v]) if v in ents else v)
        skel = _CALL + action.tool + _CALL + canonical_json(args)
        return skel if len(skel) <= _MAX_CHARS else None
    if len(cmd) > _MAX_CHARS or "\x00" in cmd or cmd.startswith(_CALL):
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
    if skel.startswith(_CALL):
        _, tool, args = skel.split(_CALL, 2)
        ents = _values(previous)

        def fill(v: str) -> str | None:
            m = _SLOT_RE.fullmatch(v)
            if m is None:
                return v
            k = int(m.group(1))
            return ents[k] if k < len(ents) else None

        filled = _map_strings(json.loads(args), fill)
        return Action(tool, filled) if filled is not None else None
    if "\x00" not in skel:
        return Action.bash(skel)
    ents = list(entities(previous.command or ""))
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


class _Decayed:
    """Counts that halve every ``half_life`` steps (kept as of step ``t``, decayed lazily)."""

    __slots__ = ("items", "t", "total")

    def __init__(self) -> None:
        self.items: dict[str, float] = {}
        self.total = 0.0
        self.t = 0

    def add(self, key: str, now: int, rate: float) -> None:
        if now != self.t and rate != 1.0:
            f = rate ** (now - self.t)
            for k in self.items:
                self.items[k] *= f
            self.total *= f
        self.t = now
        self.items[key] = self.items.get(key, 0.0) + 1.0
        self.total += 1.0

    def scale(self, now: int, rate: float) -> float:
        """Factor turning stored counts into counts as of step ``now``."""
        return 1.0 if rate == 1.0 else rate ** (now - self.t)

    def top(self) -> str:
        return max(self.items, key=self.items.__getitem__)


@dataclass
class _TraceState:
    prev: Action = _START
    n: int = 0
    followers: dict[str, _Decayed] = field(default_factory=dict)
    actions: dict[str, Action] = field(default_factory=dict)
    recent: list[str] = field(default_factory=list)
    skel_counts: dict[str, _Decayed] = field(default_factory=dict)
    harness_ll: dict[str, float] = field(default_factory=dict)


def _fold(state: _TraceState, turn: Turn, rate: float) -> None:
    a = turn.action
    now = state.n
    fol = state.followers.get(state.prev.key)
    if fol is None:
        fol = state.followers[state.prev.key] = _Decayed()
    fol.add(a.key, now, rate)
    state.actions[a.key] = a
    sk = skeleton(a, state.prev)
    if sk is not None:
        ctx = _contexts(state.prev)[0]
        counts = state.skel_counts.get(ctx)
        if counts is None:
            counts = state.skel_counts[ctx] = _Decayed()
        counts.add(sk, now, rate)
    if a.key in state.recent:
        state.recent.remove(a.key)
    state.recent.append(a.key)
    state.prev = a
    state.n = now + 1


_OBS_FORMAT = re.compile(r"\s*(<[A-Za-z_][\w-]{0,30}>|[{\[])")


def _fingerprint(turn: Turn) -> tuple[str, str]:
    """Harness evidence of one turn: its tool name and its observation's opening markup."""
    m = _OBS_FORMAT.match(turn.observation)
    return (f"tool:{turn.action.tool}", f"obs:{m.group(1) if m else ''}")


@dataclass
class _Model:
    """Statistics learned from the training traces of one harness (or of all); a harness
    model's ``others`` is the model of every other harness's traces, its prior."""

    counts: dict[str, Counter[str]]
    totals: dict[str, int]
    distinct: dict[str, int]
    top: dict[str, list[str]]
    succ: tuple[int, int]
    rep: tuple[list[int], int]
    p_successor: float = 0.3
    p_repeat: list[float] = field(default_factory=list)
    others: _Model | None = None


class HistoryActionDrafter:
    """Action drafter over action histories (see module docstring).

    ``half_life``: within-trajectory decay in steps (0: none). ``harness``: the harness
    whose model to use (default: inferred from the history). ``harness_prior``:
    pseudo-observations of the pooled rates in a harness's rates. ``label``: the routing
    label of an action (the router's own rule, e.g. ``aospec.specbox.routers.tool_label``: a shell
    command's program, else the tool name), which :meth:`propose_routed` needs.
    """

    def __init__(
        self,
        max_recent: int = 6,
        top_per_context: int = 10,
        trace_prior: float = 2.0,
        half_life: float = 8.0,
        harness: str | None = None,
        harness_prior: float = 10.0,
        label: Callable[[Action], str] | None = None,
    ) -> None:
        if half_life < 0:
            raise ConfigError(f"history drafter: half_life must be >= 0 steps (0: no decay), got {half_life}")
        self.max_recent = max_recent
        self.top_per_context = top_per_context
        self.trace_prior = trace_prior
        self.half_life = half_life
        self.harness = harness
        self.harness_prior = harness_prior
        self.label = label
        self._labels: dict[str, str] = {}
        self._rate = 2.0 ** (-1.0 / half_life) if half_life > 0 else 1.0
        self._pooled = self._train([])
        self._harnesses: dict[str, _Model] = {}
        self._evidence: dict[str, Counter[str]] = {}
        self._evidence_totals: dict[str, int] = {}
        self._log_prior: dict[str, float] = {}
        self._vocab = 1
        self._memo: dict[tuple[str | None, Action], list[tuple[str, Action, float]]] = {}
        self._index: HistoryIndex[_TraceState] = HistoryIndex(_TraceState, self._fold)

    @property
    def p_successor(self) -> float:
        return self._pooled.p_successor

    @property
    def p_repeat(self) -> list[float]:
        return self._pooled.p_repeat

    @property
    def harnesses(self) -> tuple[str, ...]:
        """Harnesses with a model of their own (empty when training saw only one)."""
        return tuple(self._harnesses)

    def _fold(self, state: _TraceState, i: int, turn: Turn) -> None:
        _fold(state, turn, self._rate)
        if self._evidence:
            for h, counts in self._evidence.items():
                denom = self._evidence_totals[h] + self._vocab
                state.harness_ll[h] = state.harness_ll.get(h, self._log_prior[h]) + sum(
                    math.log((counts.get(f, 0) + 1) / denom) for f in _fingerprint(turn)
                )

    def _train(self, traces: Sequence[Trace]) -> _Model:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        succ_hit = succ_n = 0
        rep_hits = [0] * self.max_recent
        rep_n = 0
        for trace in traces:
            state = _TraceState()
            for step in trace.steps:
                a = step.action
                sk = skeleton(a, state.prev)
                if sk is not None:
                    for ctx in _contexts(state.prev):
                        counts[ctx][sk] += 1
                fol = state.followers.get(state.prev.key)
                if fol is not None:
                    succ_n += 1
                    succ_hit += fol.top() == a.key
                if state.recent:
                    rep_n += 1
                    recent = state.recent[::-1][: self.max_recent]
                    if a.key in recent:
                        rep_hits[recent.index(a.key)] += 1
                _fold(state, Turn(a, step.observation), self._rate)
        return _Model(
            counts=dict(counts),
            totals={c: sum(v.values()) for c, v in counts.items()},
            distinct={c: len(v) for c, v in counts.items()},
            top={c: [s for s, _ in v.most_common(self.top_per_context)] for c, v in counts.items()},
            succ=(succ_hit, succ_n),
            rep=(rep_hits, rep_n),
            p_successor=(succ_hit + 1) / (succ_n + 2),
            p_repeat=[(h + 0.5) / (rep_n + 1) for h in rep_hits],
        )

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn skeleton transitions and within-trajectory rates from training traces,
        pooled and (when they come from several harnesses) per harness."""
        self._pooled = self._train(traces)
        by_harness: dict[str, list[Trace]] = defaultdict(list)
        for t in traces:
            by_harness[t.harness].append(t)
        self._harnesses = {}
        self._evidence = {}
        if len(by_harness) > 1:
            m = self.harness_prior
            for h, ts in by_harness.items():
                model = self._train(ts)
                model.others = others = self._train([t for t in traces if t.harness != h])
                (sh, sn), (rh, rn) = model.succ, model.rep
                model.p_successor = (sh + m * others.p_successor) / (sn + m)
                model.p_repeat = [(x + m * q) / (rn + m) for x, q in zip(rh, others.p_repeat, strict=True)]
                self._harnesses[h] = model
                self._evidence[h] = Counter(
                    f for t in ts for s in t.steps for f in _fingerprint(Turn(s.action, s.observation))
                )
            self._evidence_totals = {h: sum(c.values()) for h, c in self._evidence.items()}
            self._vocab = len(set().union(*self._evidence.values())) + 1
            n = sum(len(ts) for ts in by_harness.values())
            self._log_prior = {h: math.log(len(ts) / n) for h, ts in by_harness.items()}
        self._memo = {}
        self._index = HistoryIndex(_TraceState, self._fold)

    def _harness_of(self, state: _TraceState) -> _Model | None:
        if not self._harnesses:
            return None
        if self.harness is not None:
            return self._harnesses.get(self.harness)
        ll = state.harness_ll
        if not ll:
            return None
        best = max(ll, key=ll.__getitem__)
        z = sum(math.exp(v - ll[best]) for v in ll.values())
        return self._harnesses[best] if 1.0 / z >= 0.95 else None

    def _p_train(self, skel: str, contexts: Sequence[str], model: _Model | None) -> float:
        """Witten-Bell interpolation from the least specific context up; with a harness
        model, at each context the other harnesses' counts come first and the harness's own
        refine them (no count is used twice)."""
        p = 0.0
        chain = (self._pooled,) if model is None else (model.others, model)
        for ctx in reversed(contexts):
            for m in chain:
                assert m is not None
                total = m.totals.get(ctx)
                if total:
                    u = m.distinct[ctx]
                    p = (m.counts[ctx].get(skel, 0) + u * p) / (total + u)
        return p

    def _train_candidates(
        self, prev: Action, model: _Model | None, name: str | None
    ) -> list[tuple[str, Action, float]]:
        """(skeleton, action, training probability) after ``prev`` (memoised)."""
        found = self._memo.get((name, prev))
        if found is None:
            contexts = _contexts(prev)
            tops = [m.top for m in ((model, self._pooled) if model is not None else (self._pooled,))]
            found = []
            for sk in dict.fromkeys(s for top in tops for ctx in contexts for s in top.get(ctx, ())):
                a = _instantiate(sk, prev)
                if a is not None:
                    found.append((sk, a, self._p_train(sk, contexts, model)))
            if len(self._memo) > 50_000:
                self._memo.clear()
            self._memo[(name, prev)] = found
        return found

    def _next(self, state: _TraceState, prev: Action, model: _Model | None) -> dict[str, tuple[Action, float]]:
        """Candidates for the action after ``prev``: key -> (action, probability)."""
        contexts = _contexts(prev)
        now, rate = state.n, self._rate
        local = state.skel_counts.get(contexts[0])
        local_f = local.scale(now, rate) if local is not None else 0.0
        local_total = local.total * local_f if local is not None else 0.0
        rates = model if model is not None else self._pooled
        miss: dict[str, float] = {}
        acts: dict[str, Action] = {}

        def add(a: Action, p: float) -> None:
            if p <= 0.0:
                return
            acts[a.key] = a
            miss[a.key] = miss.get(a.key, 1.0) * (1.0 - min(p, 0.999))

        beta = self.trace_prior
        seen: set[str] = set()
        name = None if model is None else next(h for h, m in self._harnesses.items() if m is model)
        for sk, a, p in self._train_candidates(prev, model, name):
            if local is not None:
                seen.add(sk)
                p = (local.items.get(sk, 0.0) * local_f + beta * p) / (local_total + beta)
            add(a, p)
        if local is not None:
            for sk, c in local.items.items():
                if sk in seen:
                    continue
                a = _instantiate(sk, prev)
                if a is not None:
                    add(a, (c * local_f + beta * self._p_train(sk, contexts, model)) / (local_total + beta))
        fol = state.followers.get(prev.key)
        if fol is not None:
            for key, c in fol.items.items():
                add(state.actions[key], rates.p_successor * c / fol.total)
        for r, key in enumerate(reversed(state.recent[-self.max_recent :])):
            add(state.actions[key], rates.p_repeat[r])
        return {k: (acts[k], 1.0 - m) for k, m in miss.items()}

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if width <= 0:
            return []
        state = self._index.update(history)
        model = self._harness_of(state)
        first = self._next(state, state.prev, model)
        ranked = sorted(first.values(), key=lambda ap: -ap[1])
        out = [ActionDraft(a, 0, p) for a, p in ranked[:width]]
        frontier = [(a, p) for a, p in ranked[:2]]
        for offset in range(1, depth):
            nxt: list[tuple[Action, float]] = []
            for a, p in frontier:
                if a.is_none or classify_action(a) is not Effect.READ_ONLY:
                    continue
                for b, q in self._next(state, a, model).values():
                    nxt.append((b, p * q))
            nxt.sort(key=lambda ap: -ap[1])
            out.extend(ActionDraft(b, offset, q) for b, q in nxt[:width])
            frontier = nxt[:2]
        out.sort(key=lambda d: -d.probability)
        return out[:width]

    def _label(self, action: Action) -> str:
        assert self.label is not None
        found = self._labels.get(action.key)
        if found is None:
            if len(self._labels) > 50_000:
                self._labels.clear()
            found = self._labels[action.key] = self.label(action)
        return found

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        """Once a router has named the ``tool`` (label) of the action being decoded
        (:class:`aospec.protocols.RoutedActionDrafter`): this drafter's own offset-0
        candidates whose ``label`` is ``tool``, most likely first, with ``P(action | tool)``.

        The candidates are all of :meth:`propose`'s sources, not only its top ``width``,
        plus the trajectory's older distinct actions of that label (beyond the ``max_recent``
        the repetition source ranks), each at the last learned repetition rate: an agent
        that re-runs its test or build command ten steps later is routed to it. The
        conditional probability divides a candidate's probability by the mass that can
        belong to ``tool``: its candidates' sum plus the mass no candidate claims
        (``1 - sum`` over all candidates, when positive), a lower bound of the true
        conditional when the drafter's probabilities are calibrated."""
        if width <= 0:
            return []
        if self.label is None:
            raise ConfigError(
                "history drafter: propose_routed needs label= (the router's label function, "
                "e.g. aospec.specbox.routers.tool_label)"
            )
        state = self._index.update(history)
        model = self._harness_of(state)
        candidates = self._next(state, state.prev, model)
        unclaimed = max(0.0, 1.0 - sum(p for _, p in candidates.values()))
        found = {k: ap for k, ap in candidates.items() if not ap[0].is_none and self._label(ap[0]) == tool}
        rates = model if model is not None else self._pooled
        if rates.p_repeat and len(state.recent) > self.max_recent:
            for key in reversed(state.recent[: -self.max_recent]):
                a = state.actions[key]
                if key not in found and not a.is_none and self._label(a) == tool:
                    found[key] = (a, rates.p_repeat[-1])
        if not found:
            return []
        mass = sum(p for _, p in found.values()) + unclaimed
        ranked = sorted(found.values(), key=lambda ap: (-ap[1], ap[0].key))[:width]
        return [ActionDraft(a, 0, min(1.0, p / mass)) for a, p in ranked]
