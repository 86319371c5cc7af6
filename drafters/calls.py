"""CallsActionDrafter: the next tool call of a function-calling harness, its arguments
taken from what the history shows.

Function-calling agents pass back identifiers they were given or shown: the user names an
account, a lookup returns a record whose fields name further records (a user's
reservations, an order's items), and the next calls look those up one by one. The history
drafter (:mod:`aospec.drafters.history`) predicts a call from the calls before it, so it
cannot name a value that so far appeared only in an *observation*; this drafter can.

**Values in the history.** Every scalar the history shows has a *source*:

- ``obs``, keyed by its JSON key: a scalar of a JSON observation (a list's items under the
  list's key, so a user record's ``reservations: ["A1", "B2"]`` are two ``reservations``
  values);
- ``arg``, keyed by the argument's name: an earlier call's argument;
- ``text``, keyed by its *shape* (letters ``a``/``A``, digits ``9``, runs collapsed:
  ``mia_li_3668`` is ``a_a_9``): a token of a text observation or of the task.

A source's values are ranked most recent turn first, in document order within a turn,
values already passed to the same tool argument after the others (the agent looks up the
next reservation it has not looked up yet). Each ``(kind, key, used)`` is a *feature*; its
rank-``r`` value is one candidate.

**What it learns** (:meth:`CallsActionDrafter.fit`, on the training traces' true
histories; nothing is specific to one harness or tool set):

- per tool, its argument names (tools whose arguments are all scalars; calls with nested
  arguments are writes of whole records, which this drafter does not draft);
- ``P(tool | previous action's tool)``, interpolated with the tool's overall rate
  (Witten-Bell);
- per (tool, argument, feature, rank): how often that candidate was the value passed,
  over the training calls where the feature had that rank, shrunk (``prior``
  pseudo-observations) towards the same rate pooled over every tool with the feature
  reduced to (kind, whether its key is the argument's own name, used, rank), itself scaled
  by how often the argument's values are in the history at all (a free-text argument's
  are not), which is also the estimate for features it never saw;
- per (tool, argument): its frequent literal values (a cabin class, a flag).

**Proposals.** For the likeliest tools after the last action, each argument's best
candidates (a value's probability is the best of its features'), and the calls they
make, ``P(tool) * prod P(value)``, most probable first. Histories without a tool call
other than shell commands get nothing (a shell harness is the other drafters' work).
:meth:`CallsActionDrafter.propose_routed` (a stream router named the tool while the actor
decodes its arguments) proposes that tool's calls only, each at ``prod P(value)``.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.types import Action, History, Trace

__all__ = ["CallsActionDrafter", "shape"]

_SHELL = "bash"
_START = "<start>"
#: candidates ranked deeper than this in a feature are not counted or proposed
_MAX_RANK = 8
#: tokens of text observations: words with inner ``_-.@:/`` (ids, dates, emails, codes)
_TOKEN = re.compile(r"[A-Za-z0-9](?:[\w@:/.\-]*[A-Za-z0-9])?")
_MAX_TEXT_TOKENS = 400
#: scalars taken from one JSON result; characters of a JSON result parsed at most, and of a
#: text result (or the task) read for tokens
_MAX_LEAVES = 1000
_MAX_JSON_CHARS = 1_000_000
_MAX_OBS_CHARS = 64_000
#: results up to this size have their values cached (larger ones are read each time)
_CACHED_CHARS = 16_000
#: the values of the last this many turns are candidates (older ones are not looked at)
_MAX_TURNS = 48
#: partial calls kept per argument while a tool's calls are ranked
_BEAM = 32
#: longer strings are text, not identifiers: never candidates
_MAX_VALUE_CHARS = 256


def shape(token: str) -> str:
    """A token's shape: letters ``a`` (lower) / ``A`` (upper), digits ``9``, other
    characters kept, each run of one class collapsed (``mia_li_3668`` -> ``a_a_9``,
    ``HAT069`` -> ``A9``, ``2024-05-20`` -> ``9-9-9``)."""
    out: list[str] = []
    for ch in token:
        c = "a" if ch.islower() else "A" if ch.isupper() else "9" if ch.isdigit() else ch
        if not out or out[-1] != c or c not in "aA9":
            out.append(c)
    return "".join(out)


def _scalar(v: object) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, str | int | bool) or v is None


def _candidate(v: object) -> bool:
    """A value worth passing back: a finite scalar, a string of at most ``_MAX_VALUE_CHARS``
    that is valid Unicode (JSON can spell a lone surrogate, which no client can send)."""
    if not _scalar(v):
        return False
    if isinstance(v, str):
        if len(v) > _MAX_VALUE_CHARS:
            return False
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def _is_call(action: Action) -> bool:
    """A tool call this drafter learns from: not a shell command, not the non-action."""
    return action.tool != _SHELL and not action.is_none


def _flat_args(action: Action) -> dict[str, Any] | None:
    """The call's arguments when all are scalars, else None."""
    args = dict(action.args)
    return args if all(_scalar(v) for v in args.values()) else None


def _leaves(observation: str) -> tuple[tuple[str, str, Any], ...]:
    """(kind, key, value) of every candidate value ``observation`` shows, in document order:
    the scalars of a JSON observation (``obs``; a top-level list's items under ``$``), else
    its tokens (``text``)."""
    if len(observation) <= _CACHED_CHARS:
        return _cached_leaves(observation)
    return _read_leaves(observation)


@functools.lru_cache(maxsize=1024)
def _cached_leaves(observation: str) -> tuple[tuple[str, str, Any], ...]:
    return _read_leaves(observation)


def _read_leaves(observation: str) -> tuple[tuple[str, str, Any], ...]:
    stripped = observation.lstrip()
    if stripped[:1] in ("{", "[") and len(stripped) <= _MAX_JSON_CHARS:
        try:
            doc = json.loads(stripped)
        except (ValueError, RecursionError):
            doc = None
        if isinstance(doc, dict | list):
            out: list[tuple[str, str, Any]] = []
            _walk(doc, "$", out, 0)
            return tuple(out)
    return _text_leaves(observation[:_MAX_OBS_CHARS])


def _text_leaves(text: str) -> tuple[tuple[str, str, Any], ...]:
    out = []
    for m in itertools.islice(_TOKEN.finditer(text), _MAX_TEXT_TOKENS):
        tok = m.group(0)
        if len(tok) >= 2 and tok.isascii():
            out.append(("text", shape(tok), tok))
    return tuple(out)


def _walk(v: Any, key: str, out: list[tuple[str, str, Any]], depth: int) -> None:
    if depth > 12 or len(out) >= _MAX_LEAVES:
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _walk(x, str(k), out, depth + 1)
    elif isinstance(v, list):
        for x in v:
            _walk(x, key, out, depth + 1)
    elif _candidate(v):
        out.append(("obs", key, v))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _coerce(value: Any, typ: str) -> Any:
    """``value`` as the argument's usual type (a text token ``"3"`` for an integer argument)."""
    if isinstance(value, bool):
        return value
    if typ == "int":
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,18}", value):
            return int(value)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e18:
            return int(value)
    if typ == "float":
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,15}(\.[0-9]{1,15})?", value):
            return float(value)
        if isinstance(value, int):
            return float(value)
    if typ == "str" and isinstance(value, int | float):
        return str(value)
    return value


Feature = tuple[str, str, bool]


@dataclass
class _Values:
    """The history's values by (kind, key), most recent first, and the values each (tool,
    argument) has been passed so far."""

    raw: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    used: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    _features: dict[tuple[str, str], dict[Feature, list[Any]]] = field(default_factory=dict)
    _coerced: dict[tuple[str, type, Any], tuple[Any, str]] = field(default_factory=dict)

    def coerced(self, value: Any, typ: str) -> tuple[Any, str]:
        """``value`` as type ``typ`` (:func:`_coerce`) and its JSON, each worked out once per
        history (a value is offered to many tools' arguments; values are scalars)."""
        key = (typ, type(value), value)
        got = self._coerced.get(key)
        if got is None:
            c = _coerce(value, typ)
            got = self._coerced[key] = (c, json.dumps(c))
        return got

    def features(self, tool: str, arg: str, typ: str) -> dict[Feature, list[Any]]:
        """The candidates of each feature for ``tool``'s ``arg`` (as its usual type ``typ``):
        a source's values not yet passed to it first, then those already passed, each at
        most ``_MAX_RANK``."""
        got = self._features.get((tool, arg))
        if got is None:
            used = self.used.get((tool, arg), set())
            got = {}
            for (kind, key), vals in self.raw.items():
                fresh: list[Any] = []
                old: list[Any] = []
                for v in vals:
                    (old if self.coerced(v, typ)[1] in used else fresh).append(v)
                if fresh:
                    got[(kind, key, False)] = fresh[:_MAX_RANK]
                if old:
                    got[(kind, key, True)] = old[:_MAX_RANK]
            self._features[(tool, arg)] = got
        return got


def _values(history: History) -> _Values:
    """The candidate values of ``history``: those of its last ``_MAX_TURNS`` turns and of its
    task; and what each tool argument was passed (over the whole history)."""
    used: dict[tuple[str, str], set[str]] = defaultdict(set)
    for t in history.turns:
        args = _flat_args(t.action) if t.action.tool != _SHELL else None
        for k, v in (args or {}).items():
            used[(t.action.tool, k)].add(json.dumps(v))
    seen_all: dict[tuple[str, str], set[str]] = {}
    raw: dict[tuple[str, str], list[Any]] = defaultdict(list)

    def add(kind: str, key: str, value: Any) -> None:
        lst = raw[(kind, key)]
        if len(lst) >= 4 * _MAX_RANK:
            return
        seen = seen_all.setdefault((kind, key), set())
        mark = json.dumps(value)
        if mark not in seen:
            seen.add(mark)
            lst.append(value)

    for t in reversed(history.turns[-_MAX_TURNS:]):
        for kind, key, value in _leaves(t.observation):
            add(kind, key, value)
        if t.action.tool != _SHELL:
            for k, v in (_flat_args(t.action) or {}).items():
                if _candidate(v):
                    add("arg", k, v)
    for kind, key, value in _text_leaves(history.task[:_MAX_OBS_CHARS]):
        add(kind, key, value)
    return _Values(raw=dict(raw), used=dict(used))


def _generic(feature: Feature, arg: str, rank: int) -> tuple[str, bool, bool, int]:
    kind, key, used = feature
    return (kind, key == arg, used, rank)


@dataclass
class _Tool:
    args: tuple[str, ...]
    types: dict[str, str]
    consts: dict[str, list[tuple[Any, float]]]


class CallsActionDrafter:
    """Next tool calls with arguments grounded in the history (module doc).

    ``tools``: at most this many tools are tried per proposal (the likeliest).
    ``values``: at most this many candidate values per argument. ``prior``: how many
    pseudo-observations of the pooled rate each (tool, argument, feature, rank) starts
    with. ``min_probability``: drafts below it are not proposed.
    """

    def __init__(self, tools: int = 6, values: int = 3, prior: float = 2.0, min_probability: float = 0.002) -> None:
        def whole(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        def number(x: object) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

        if not (whole(tools) and whole(values) and number(prior) and prior > 0 and number(min_probability)
                and 0.0 <= min_probability < 1.0):
            raise ConfigError(
                "calls drafter: tools and values must be whole numbers >= 1, prior a number > 0, "
                f"0 <= min_probability < 1 (got tools={tools!r}, values={values!r}, prior={prior!r}, "
                f"min_probability={min_probability!r})"
            )
        self.tools = tools
        self.values = values
        self.prior = prior
        self.min_probability = min_probability
        self._tools: dict[str, _Tool] = {}
        self._next: dict[str, Counter[str]] = {}
        self._unigram: Counter[str] = Counter()
        self._specific: dict[tuple[str, str, Feature, int], list[int]] = {}
        self._pooled: dict[tuple[str, bool, bool, int], list[int]] = {}
        self._grounded: dict[tuple[str, str], float] = {}

    # -- fitting ---------------------------------------------------------------------------

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn the tools' arguments, their transitions and where their values come from."""
        shapes: dict[str, Counter[tuple[str, ...]]] = defaultdict(Counter)
        nested: Counter[str] = Counter()
        types: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        consts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
        nxt: dict[str, Counter[str]] = defaultdict(Counter)
        unigram: Counter[str] = Counter()
        calls = [t for t in traces if any(_is_call(s.action) for s in t.steps)]
        for trace in calls:
            prev = _START
            for step in trace.steps:
                a = step.action
                if a.is_none:
                    continue
                nxt[prev][a.tool] += 1
                unigram[a.tool] += 1
                prev = a.tool
                if a.tool == _SHELL:
                    continue
                args = _flat_args(a)
                if args is None:
                    nested[a.tool] += 1
                    continue
                shapes[a.tool][tuple(sorted(args))] += 1
                for k, v in args.items():
                    types[(a.tool, k)][type(v).__name__] += 1
                    consts[(a.tool, k)][json.dumps(v)] += 1
        tools: dict[str, _Tool] = {}
        for tool, sigs in shapes.items():
            n = sum(sigs.values())
            if nested[tool] > n:
                continue
            args = max(sigs, key=lambda s: (sigs[s], s))
            tools[tool] = _Tool(
                args=args,
                types={k: types[(tool, k)].most_common(1)[0][0] for k in args},
                consts={
                    k: [
                        (json.loads(m), c / (n + 1))
                        for m, c in consts[(tool, k)].most_common(3)
                        if c >= 2 and _candidate(json.loads(m))
                    ]
                    for k in args
                },
            )
        self._tools, self._next, self._unigram = tools, dict(nxt), unigram
        specific: dict[tuple[str, str, Feature, int], list[int]] = defaultdict(lambda: [0, 0])
        pooled: dict[tuple[str, bool, bool, int], list[int]] = defaultdict(lambda: [0, 0])
        grounded: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for trace in calls:
            for i, step in enumerate(trace.steps):
                a = step.action
                spec = tools.get(a.tool)
                args = _flat_args(a) if spec is not None else None
                if args is None or tuple(sorted(args)) != spec.args:
                    continue
                vals = _values(trace.history(i))
                for k, v in args.items():
                    found = False
                    for feat, cands in vals.features(a.tool, k, spec.types[k]).items():
                        for r, c in enumerate(cands):
                            hit = _same(vals.coerced(c, spec.types[k])[0], v)
                            found = found or hit
                            s = specific[(a.tool, k, feat, r)]
                            g = pooled[_generic(feat, k, r)]
                            s[0] += hit
                            s[1] += 1
                            g[0] += hit
                            g[1] += 1
                    gr = grounded[(a.tool, k)]
                    gr[0] += found
                    gr[1] += 1
        self._specific, self._pooled = dict(specific), dict(pooled)
        total = [sum(g[0] for g in grounded.values()), sum(g[1] for g in grounded.values())]
        rate = (total[0] + 1) / (total[1] + 2)
        # how much more (or less) often than the average argument this one takes a value the
        # history shows: scales the pooled rates (a free-text argument's are near 0)
        self._grounded = {ta: min(1.0, (g[0] + 1) / (g[1] + 2) / rate) for ta, g in grounded.items()}

    # -- proposing -------------------------------------------------------------------------

    def _p_value(self, tool: str, arg: str, feat: Feature, rank: int) -> float:
        g = self._pooled.get(_generic(feat, arg, rank))
        p0 = 0.0 if g is None else (g[0] + 1) / (g[1] + 2) * self._grounded.get((tool, arg), 1.0)
        s = self._specific.get((tool, arg, feat, rank))
        if s is None:
            return p0
        return (s[0] + self.prior * p0) / (s[1] + self.prior)

    def _p_tools(self, history: History) -> list[tuple[str, float]]:
        prev = _START
        for t in reversed(history.turns):
            if not t.action.is_none:
                prev = t.action.tool
                break
        after = self._next.get(prev, Counter())
        n, types = sum(after.values()), len(after)
        lam = n / (n + types) if n else 0.0
        total = sum(self._unigram.values()) or 1
        scored = [
            (tool, lam * after[tool] / max(n, 1) + (1 - lam) * self._unigram[tool] / total) for tool in self._tools
        ]
        scored.sort(key=lambda x: (-x[1], x[0]))
        return scored[: self.tools]

    def _candidates(self, tool: str, arg: str, vals: _Values) -> list[tuple[Any, float]]:
        spec = self._tools[tool]
        best: dict[str, tuple[Any, float]] = {}
        for feat, cands in vals.features(tool, arg, spec.types[arg]).items():
            for r, c in enumerate(cands):
                p = self._p_value(tool, arg, feat, r)
                if p <= 0.0:
                    continue
                v, mark = vals.coerced(c, spec.types[arg])
                if mark not in best or best[mark][1] < p:
                    best[mark] = (v, p)
        for v, p in spec.consts.get(arg, []):
            mark = json.dumps(v)
            if mark not in best or best[mark][1] < p:
                best[mark] = (v, p)
        out = sorted(best.values(), key=lambda x: -x[1])
        return out[: self.values]

    def _proposals(self, history: History, tool: str | None = None) -> Iterator[tuple[Action, float]]:
        """Each likely tool's calls, best first by a beam over its arguments (at most
        ``_BEAM`` partial calls kept per argument, so the cost is linear in the number of
        arguments); a partial call below ``min_probability`` is dropped at once."""
        vals = _values(history)
        tools = self._p_tools(history) if tool is None else [(tool, 1.0)]
        for name, p_tool in tools:
            spec = self._tools[name]
            beam: list[tuple[float, tuple[Any, ...]]] = [(p_tool, ())]
            for k in spec.args:
                cands = self._candidates(name, k, vals)
                beam = sorted(
                    ((p * q, (*vs, v)) for p, vs in beam for v, q in cands if p * q >= self.min_probability),
                    key=lambda x: -x[0],
                )[:_BEAM]
                if not beam:
                    break
            for p, vs in beam:
                yield Action(name, dict(zip(spec.args, vs, strict=True))), p

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if width <= 0 or depth <= 0 or not self._tools:
            return []
        if not any(_is_call(t.action) for t in history.turns):
            return []
        return self._ranked(self._proposals(history), width)

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        """The calls of ``tool``, which a stream router named while the actor decodes its
        arguments: each with the probability of its arguments (the tool is given)."""
        if width <= 0 or tool not in self._tools:
            return []
        return self._ranked(self._proposals(history, tool), width)

    @staticmethod
    def _ranked(proposals: Iterator[tuple[Action, float]], width: int) -> list[ActionDraft]:
        found: dict[Action, float] = {}
        for action, p in proposals:
            if found.get(action, 0.0) < p:
                found[action] = p
        ranked = sorted(found.items(), key=lambda x: (-x[1], x[0].key))[:width]
        return [ActionDraft(a, 0, min(p, 1.0)) for a, p in ranked]
