"""Calibrated probabilities of drafts: ``p(drafter, tool, distance, raw_score)``.

A drafter's ``probability`` is its own estimate that a draft is exactly right (an
observation byte-identical to the real one, an action equal to the one emitted
``distance`` steps later). EVD ranks by it and a cost controller prices a guess with it,
so it must be honest: of the drafts a drafter scores 0.3, about 30% should hit.

:class:`Calibration` maps a raw score to an observed hit rate, per **cell** (drafter,
tool, distance): the tool is the routing label of the action the draft is for
(:func:`aospec.streams.tool_label`: ``python``, ``cat``, a tool-call name), the distance
0 for observation drafts and the target's step offset for action drafts. Each cell is an
isotonic (monotone, pool-adjacent-violators) step function of the raw score, each block's
rate shrunk towards the cell's parent (``prior`` pseudo-observations, Beta posterior mean):
(drafter, tool, distance) -> (drafter, any tool, distance) -> (drafter, any, any) ->
the raw score itself. Cells with fewer than ``min_count`` outcomes are not kept: their
drafts get the parent's answer.

Outcomes come from :func:`observation_outcomes` and :func:`action_outcomes`: a fitted
drafter run on traces' true histories, every draft scored against what happened.
:func:`cross_fit_outcomes` does that honestly: the drafter is fit on the other folds'
traces (grouped by task) and scored on the held-out fold, so a drafter that memorises its
training traces is not calibrated on them. ``aospec drafters calibration`` fits one and
reports predicted against observed hit rate per bucket (docs/drafters.md, Calibration).

The JSON form (:meth:`Calibration.to_json`, :meth:`Calibration.save`, ``calibration.json``
beside fitted drafters) holds every cell's thresholds and rates.

**Ranking by calibrated probabilities.** Several action drafters' targets are merged by
probability (the engine's launches, ``aospec mcp`` and ``aospec proxy`` predictions): raw
scores of different drafters are not comparable (on the tau-bench airline trajectories the
history drafter scores repeats of a call already made at 0.2-0.35, and they are right 1
time in 276), so a drafter that is confident and wrong pushes out one that is right.
:func:`fit_action_calibration` cross-fits one drafter on training traces and
:func:`calibrated` wraps it so that each target carries its calibrated probability (the
``calibrate_actions`` key of a replay policy, on in ``aospec``; docs/drafters.md,
"Calibration").
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.streams import tool_label
from aospec.types import History, Trace

__all__ = [
    "ACTION_BOUNDARIES",
    "ACTION_DEPTH",
    "ACTION_FOLDS",
    "ACTION_WIDTH",
    "ANY",
    "TIE_BREAK",
    "CalibratedActionDrafter",
    "CalibratedRoutedActionDrafter",
    "Calibration",
    "Outcome",
    "ReliabilityRow",
    "action_outcomes",
    "call_sync",
    "cross_fit_outcomes",
    "calibrated",
    "expected_calibration_error",
    "fit_action_calibration",
    "observation_outcomes",
    "reliability",
]

#: The tool or distance of a cell that pools all of them.
ANY = "*"
#: Targets per boundary and steps ahead scored when an action drafter is calibrated for
#: ranking (:func:`fit_action_calibration`): the engine's default fork width and lookahead.
ACTION_WIDTH, ACTION_DEPTH = 8, 2
#: The most boundaries an action drafter is scored at when it is calibrated for ranking
#: (beyond it, every k-th boundary of each trace): calibrating costs one drafting call per
#: boundary, and a few thousand outcomes fix a drafter's cells well enough to rank by.
ACTION_BOUNDARIES = 1000
#: Folds an action drafter is cross-fit in for ranking: two fits, each on half the
#: training traces (four would fit three times the traces for little better cells).
ACTION_FOLDS = 2
#: A calibrated target's probability is its calibrated rate plus this share of its raw
#: score: drafts in one isotonic block (equal rates) keep their drafter's own order, and
#: equal rates of two drafters are broken by their raw scores.
TIE_BREAK = 1e-6
_FORMAT = "aospec-calibration/1"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One draft and what happened: ``raw`` the drafter's probability, ``hit`` whether it
    was exactly right. ``tool`` is the label of the action the draft is for, ``distance``
    0 for an observation draft and the step offset of an action draft."""

    drafter: str
    tool: str
    distance: int
    raw: float
    hit: bool


@dataclass(frozen=True, slots=True)
class _Cell:
    """A monotone step function: ``rates[k]`` for raw scores up to ``uppers[k]`` (the last
    block runs to 1); ``counts[k]`` outcomes in block ``k``."""

    uppers: tuple[float, ...]
    rates: tuple[float, ...]
    counts: tuple[int, ...]

    def __call__(self, raw: float) -> float:
        lo, hi = 0, len(self.uppers) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if raw <= self.uppers[mid]:
                hi = mid
            else:
                lo = mid + 1
        return self.rates[lo]

    def to_json(self) -> dict[str, Any]:
        return {"uppers": list(self.uppers), "rates": list(self.rates), "counts": list(self.counts)}


def _pav(points: Sequence[tuple[float, bool]]) -> list[tuple[float, int, int]]:
    """Pool-adjacent-violators over (raw, hit) sorted by raw: (upper raw, hits, n) blocks
    with non-decreasing hit rates."""
    grouped: dict[float, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for raw, hit in points:
        grouped[raw][0] += hit
        grouped[raw][1] += 1
    blocks: list[list[float]] = []  # [upper, hits, n]
    for raw in sorted(grouped):
        blocks.append([raw, *grouped[raw]])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            upper, h, n = blocks.pop()
            blocks[-1][0] = upper
            blocks[-1][1] += h
            blocks[-1][2] += n
    return [(b[0], int(b[1]), int(b[2])) for b in blocks]


class Calibration:
    """Calibrated hit probabilities per (drafter, tool, distance) (see module doc).

    Build with :meth:`fit`; ask with :meth:`p`; keep with :meth:`save` / :meth:`load`.
    """

    def __init__(
        self, cells: Mapping[tuple[str, str, str], _Cell] | None = None, *, prior: float = 2.0, min_count: int = 20
    ) -> None:
        if prior < 0 or min_count < 1:
            raise ConfigError("calibration: prior must be >= 0 and min_count >= 1")
        self.prior = prior
        self.min_count = min_count
        self._cells: dict[tuple[str, str, str], _Cell] = dict(cells or {})

    @property
    def drafters(self) -> tuple[str, ...]:
        """Drafters with a cell of their own."""
        return tuple(dict.fromkeys(k[0] for k in self._cells))

    @property
    def cells(self) -> dict[tuple[str, str, str], _Cell]:
        return dict(self._cells)

    @classmethod
    def fit(cls, outcomes: Iterable[Outcome], *, prior: float = 2.0, min_count: int = 20) -> Calibration:
        """Isotonic cells from ``outcomes``, coarse to fine (each shrunk to its parent)."""
        out = cls(prior=prior, min_count=min_count)
        groups: dict[tuple[str, str, str], list[tuple[float, bool]]] = defaultdict(list)
        for o in outcomes:
            if not (isinstance(o.raw, (int, float)) and 0.0 <= o.raw <= 1.0):
                raise ConfigError(f"calibration: outcome of {o.drafter!r} has raw score {o.raw!r} outside [0, 1]")
            point = (float(o.raw), bool(o.hit))
            groups[(o.drafter, ANY, ANY)].append(point)
            groups[(o.drafter, ANY, str(o.distance))].append(point)
            groups[(o.drafter, o.tool, str(o.distance))].append(point)
        for level in (0, 1, 2):
            for key, points in groups.items():
                if _level(key) != level or len(points) < min_count:
                    continue
                blocks = _pav(points)
                rates = []
                for upper, h, n in blocks:
                    parent = out._parent_p(key, upper)
                    rates.append((h + prior * parent) / (n + prior))
                # shrinking may break monotonicity slightly: restore it
                for k in range(1, len(rates)):
                    rates[k] = max(rates[k], rates[k - 1])
                out._cells[key] = _Cell(tuple(b[0] for b in blocks), tuple(rates), tuple(b[2] for b in blocks))
        return out

    def _parent_p(self, key: tuple[str, str, str], raw: float) -> float:
        drafter, tool, distance = key
        if tool != ANY:
            return self._lookup((drafter, ANY, distance), raw)
        if distance != ANY:
            return self._lookup((drafter, ANY, ANY), raw)
        return raw

    def _lookup(self, key: tuple[str, str, str], raw: float) -> float:
        cell = self._cells.get(key)
        return cell(raw) if cell is not None else self._parent_p(key, raw)

    def p(self, drafter: str, tool: str, distance: int, raw_score: float) -> float:
        """The calibrated probability that a draft of ``drafter`` with probability
        ``raw_score``, for an action labelled ``tool``, ``distance`` steps ahead (0 for an
        observation), is exactly right. A drafter without cells gets ``raw_score`` back."""
        raw = min(1.0, max(0.0, float(raw_score)))
        return self._lookup((drafter, tool, str(distance)), raw)

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "prior": self.prior,
            "min_count": self.min_count,
            "cells": [
                {"drafter": d, "tool": t, "distance": s, **cell.to_json()} for (d, t, s), cell in self._cells.items()
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "calibration") -> Calibration:
        """The calibration :meth:`to_json` wrote (ConfigError naming the bad field)."""
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise ConfigError(f"{where}: not an aospec calibration (expected format {_FORMAT!r})")
        cells = {}
        for k, c in enumerate(data.get("cells", ())):
            try:
                key = (str(c["drafter"]), str(c["tool"]), str(c["distance"]))
                uppers = tuple(float(x) for x in c["uppers"])
                rates = tuple(float(x) for x in c["rates"])
                counts = tuple(int(x) for x in c["counts"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: cells[{k}]: {type(exc).__name__}: {exc}") from None
            if not uppers or not (len(uppers) == len(rates) == len(counts)):
                raise ConfigError(f"{where}: cells[{k}]: uppers, rates and counts must be non-empty and of one length")
            if any(not 0.0 <= r <= 1.0 or math.isnan(r) for r in rates) or list(uppers) != sorted(uppers):
                raise ConfigError(f"{where}: cells[{k}]: rates must be in [0, 1] and uppers sorted")
            cells[key] = _Cell(uppers, rates, counts)
        try:
            return cls(cells, prior=float(data.get("prior", 2.0)), min_count=int(data.get("min_count", 20)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: prior/min_count: {exc}") from None

    def save(self, path: str | Path) -> Path:
        """Write ``calibration.json`` (or ``path`` itself when it ends in ``.json``)."""
        p = Path(path)
        if p.suffix != ".json":
            p = p / "calibration.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read what :meth:`save` wrote (a directory means its ``calibration.json``)."""
        p = Path(path)
        if p.is_dir():
            p = p / "calibration.json"
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read the calibration: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{p}: not valid JSON: {exc}") from None
        return cls.from_json(data, str(p))


def _level(key: tuple[str, str, str]) -> int:
    return (key[2] != ANY) + (key[1] != ANY)


# -------------------------------------------------------------------- outcomes


def _run(coro: Any) -> Any:
    """The result of a drafter coroutine that never suspends (the non-LM drafters), else
    of running it on anyio."""
    import anyio

    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    except anyio.NoEventLoopError:
        # it needs an event loop (a model drafter's worker thread) before its first suspension
        raise _Suspends from None
    coro.close()
    raise _Suspends


class _Suspends(Exception):
    pass


def call_sync(fn: Callable[..., Any], *args: Any) -> Any:
    """``await fn(*args)`` from synchronous code: stepped directly when the coroutine never
    suspends (the drafters without a model), else run on anyio."""
    try:
        return _run(fn(*args))
    except _Suspends:
        import anyio

        return anyio.run(fn, *args)


def observation_outcomes(name: str, drafter: Any, traces: Iterable[Trace], n: int = 8) -> Iterator[Outcome]:
    """Every draft of observation drafter ``drafter`` (named ``name``) for every completed
    step of ``traces``, on the true history, scored byte for byte."""
    for trace in traces:
        for i, step in enumerate(trace.steps):
            if not step.completed or step.action.is_none:
                continue
            tool = tool_label(step.action)
            for d in call_sync(drafter.draft, trace.history(i), step.action, n):
                yield Outcome(name, tool, 0, d.probability, d.text == step.observation)


def action_outcomes(
    name: str, drafter: Any, traces: Iterable[Trace], width: int = 32, depth: int = 10, stride: int = 1
) -> Iterator[Outcome]:
    """Every target of action drafter ``drafter`` at every boundary of ``traces`` (true
    histories; with ``stride`` k, at every k-th boundary of each trace), scored against the
    action recorded ``offset`` steps later (targets past the end are left out)."""
    for trace in traces:
        actions = [s.action for s in trace.steps]
        for i in range(0, len(actions), max(1, stride)):
            for d in call_sync(drafter.propose, trace.history(i), width, depth):
                j = i + d.offset
                if j < len(actions):
                    yield Outcome(name, tool_label(d.action), d.offset, d.probability, d.action == actions[j])


def cross_fit_outcomes(
    make: Callable[[], Any],
    name: str,
    kind: str,
    traces: Sequence[Trace],
    *,
    folds: int = 4,
    width: int = 32,
    depth: int = 10,
    stride: int = 1,
) -> list[list[Outcome]]:
    """The outcomes of each fold: a fresh drafter (``make()``, fit on the other folds'
    traces when it has ``fit``) scored on the fold's traces; folds group traces by task
    (task ``n`` in sorted order goes to fold ``n % folds``). ``kind``: ``observation`` or
    ``action`` (``width`` targets per boundary, ``depth`` steps ahead at most, every
    ``stride``-th boundary)."""
    if kind not in ("observation", "action"):
        raise ConfigError(f"calibration: kind must be 'observation' or 'action', got {kind!r}")
    tasks = sorted({t.task for t in traces})
    if len(tasks) < 2:
        raise ConfigError("calibration: cross-fitting needs traces of at least two tasks")
    k = min(folds, len(tasks))
    fold_of = {task: n % k for n, task in enumerate(tasks)}
    out: list[list[Outcome]] = []
    for f in range(k):
        train = [t for t in traces if fold_of[t.task] != f]
        held = [t for t in traces if fold_of[t.task] == f]
        drafter = make()
        fit = getattr(drafter, "fit", None)
        if callable(fit):
            fit(train)
        if kind == "observation":
            out.append(list(observation_outcomes(name, drafter, held)))
        else:
            out.append(list(action_outcomes(name, drafter, held, width, depth, stride)))
    return out


def fit_action_calibration(
    name: str,
    make: Callable[[], Any],
    traces: Sequence[Trace],
    *,
    folds: int = ACTION_FOLDS,
    width: int = ACTION_WIDTH,
    depth: int = ACTION_DEPTH,
    boundaries: int = ACTION_BOUNDARIES,
    min_count: int = 20,
) -> Calibration | None:
    """A calibration of action drafter ``name`` (``make()`` builds it unfit) for ranking its
    targets among other drafters': cross-fit on ``traces`` (:func:`cross_fit_outcomes`:
    each fold's targets drafted by a drafter fit on the other folds, so a drafter that
    memorises its training traces is judged on tasks it has not seen), at ``boundaries``
    of the traces' boundaries at most. None when the traces hold fewer than two tasks
    (nothing to cross-fit: the raw scores stand), and None with one note on stderr when the
    drafter fails while it is cross-fit (a guess's ranking must not stop what fits it; the
    drafter's failures when it drafts are the engine's to count, as before)."""
    if len({t.task for t in traces}) < 2:
        return None
    total = sum(len(t.steps) for t in traces)
    stride = max(1, math.ceil(total / max(1, boundaries)))
    try:
        folds_out = cross_fit_outcomes(
            make, name, "action", traces, folds=folds, width=width, depth=depth, stride=stride
        )
        return Calibration.fit((o for fold in folds_out for o in fold), min_count=min_count)
    except Exception as exc:
        print(
            f"aospec: note: the {name} action drafter failed while its ranking was calibrated "
            f"({type(exc).__name__}: {exc}); its raw scores stand",
            file=sys.stderr,
        )
        return None


class CalibratedActionDrafter:
    """Action drafter ``inner`` (named ``name`` in ``calibration``) whose targets carry their
    calibrated probability (plus :data:`TIE_BREAK` times the raw one) instead of the raw
    score, so that merging several drafters by probability ranks them on one scale. Any
    other attribute is ``inner``'s (``fit`` included)."""

    __slots__ = ("calibration", "inner", "name")

    def __init__(self, inner: Any, name: str, calibration: Calibration) -> None:
        self.inner = inner
        self.name = name
        self.calibration = calibration

    def __getattr__(self, attr: str) -> Any:
        if attr == "propose_routed":
            raise AttributeError(attr)  # only CalibratedRoutedActionDrafter routes
        return getattr(self.inner, attr)

    def _calibrated(self, drafts: Iterable[Any]) -> list[Any]:
        out = []
        for d in drafts:
            if isinstance(d, ActionDraft) and isinstance(d.probability, (int, float)) and 0 <= d.probability <= 1:
                p = self.calibration.p(self.name, tool_label(d.action), d.offset, d.probability)
                d = replace(d, probability=min(1.0, p + TIE_BREAK * d.probability))
            out.append(d)  # (anything else is the engine's to reject, as it was)
        return out

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        return self._calibrated(await self.inner.propose(history, width, depth))


class CalibratedRoutedActionDrafter(CalibratedActionDrafter):
    """:class:`CalibratedActionDrafter` of a drafter that has ``propose_routed``. Routed
    targets (proposed once the tool is named mid-decode) keep their raw scores: they are
    ranked only among themselves, and the boundary's outcomes the calibration was fit on
    say nothing of how often a target of a named tool is right."""

    __slots__ = ()

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        return await self.inner.propose_routed(history, tool, width)


def calibrated(inner: Any, name: str, calibration: Calibration | None) -> Any:
    """``inner`` ranked by ``calibration`` (:class:`CalibratedActionDrafter`, routed when
    ``inner`` routes), or ``inner`` itself when there is no calibration."""
    if calibration is None:
        return inner
    routed = callable(getattr(inner, "propose_routed", None))
    return (CalibratedRoutedActionDrafter if routed else CalibratedActionDrafter)(inner, name, calibration)


@dataclass(frozen=True, slots=True)
class ReliabilityRow:
    """One bucket of a reliability table: drafts whose predicted probability fell in
    ``[low, high)``, their mean prediction and their observed hit rate."""

    drafter: str
    low: float
    high: float
    count: int
    predicted: float
    observed: float


def reliability(
    outcomes: Iterable[Outcome], predict: Callable[[Outcome], float], bins: int = 10
) -> list[ReliabilityRow]:
    """Predicted against observed hit rate per drafter and probability bucket (``bins``
    equal-width buckets; empty ones left out), with ``predict(outcome)`` the prediction
    judged (``lambda o: o.raw`` for the drafter's own score)."""
    acc: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for o in outcomes:
        p = min(1.0, max(0.0, predict(o)))
        b = min(bins - 1, int(p * bins))
        cell = acc[(o.drafter, b)]
        cell[0] += 1
        cell[1] += p
        cell[2] += o.hit
    rows = []
    for (drafter, b), (n, sp, sh) in sorted(acc.items()):
        rows.append(ReliabilityRow(drafter, b / bins, (b + 1) / bins, int(n), sp / n, sh / n))
    return rows


def expected_calibration_error(rows: Iterable[ReliabilityRow]) -> dict[str, float]:
    """Per drafter: the count-weighted mean |predicted - observed| over its buckets."""
    num: dict[str, float] = defaultdict(float)
    den: dict[str, int] = defaultdict(int)
    for r in rows:
        num[r.drafter] += r.count * abs(r.predicted - r.observed)
        den[r.drafter] += r.count
    return {d: num[d] / den[d] for d in num if den[d]}


