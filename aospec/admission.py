"""The speculation controller: every guess is priced before it is launched (issue 22).

One decision point per kind of guess: :meth:`aospec.forks.Forks.launch` for action forks
(a boundary's targets, a provisional continuation's action, a routed target) and the
session's branch start for observation branches; a SpecBox pool asks :meth:`Admission.pool`.
Each candidate gets

- an expected **benefit**: ``p(hit) * the time it would hide``, the hidden time bounded by
  what it can overlap (a boundary target: the decodes and steps until its action would be
  emitted; a provisional target: what is left of the step in flight; an observation branch:
  the next decode, bounded by what is left of the tool it drafts for);
  A fork that misses its step may still be emitted later from the same state (JASV keeps
  it valid): that *late hit*, within :data:`LATE_STEPS` steps, adds ``(1 - p(hit)) *
  p(late) * what it has run by then``;
- an expected **cost**: ``P(used by nobody) * (CPU seconds it would waste * the host's price
  of a CPU-second + decode seconds it would waste * decode_price + memory)`` plus its share
  of the critical path's overhead (learned per launch from the committed steps' overhead).
  A branch's CPU is its stream's on this host: the decode seconds it would waste times the
  cores one stream takes here (:meth:`CostModel.stream_cores`, learned live from
  :class:`aospec.host.DecodeMeter`).
  A wrong fork runs until a step changes the state (the share of steps that do is learned)
  or its tool ends.

It is launched only when the benefit exceeds the cost. ``p(hit)`` is calibrated, not a
drafter's raw score: :class:`BetaHitModel` keeps Beta posteriors of the outcomes of
candidates by kind x score bin x distance x tool label x drafter, each level backing off to
the coarser one (so a new tool starts from what its kind and distance have shown). Every
candidate's outcome is learned, also of the refused ones: a fork priced for step ``n``
(launched or refused) hit iff step ``n``'s action is its action from the version it was
priced at (JASV; late hits are learned apart), a branch iff its draft is the real
observation, so gating never starves the model of outcomes. Costs are
learned too (:class:`CostModel`): tool time per action and per tool label, CPU per tool
second per label (from :class:`aospec.protocols.MeteredSandbox` samples, or recorded step
CPU when fitted on traces), the decode time of a step and the overhead per launch. Both
live in an :class:`AdmissionModel`, which an Engine keeps across its runs and which is saved
and loaded as JSON (fitted on a user's traces by replaying them through this same engine:
``aospec.replay.calibrate``).

The host's price of a CPU-second (:func:`cpu_price`) is ``cpu_price`` (the engine config) on
a quiet host, plus the share of a core a guess takes from other work when fewer than one is
free, plus the CPU pressure (PSI): a guess on a saturated host costs the critical path about
what it takes. While the command the agent waits on is CPU-bound and the host has no room,
speculative forks are paused (:func:`forks_to_run`); under memory pressure the lowest-value
fork is dropped. A **no-regret guard** compares the realised benefit (tool and decode time
hidden) with the realised cost (wasted CPU at the host's price, wasted decodes, speculative
overhead) over the last ``guard_window`` steps; when the cost is higher it lets through one
probe every :data:`PROBE_EVERY` steps only, until speculation pays again. Its steps are the
model's (:class:`GuardState`): an Engine's runs, and the runs that load and save one model
file, are judged over one window.

``EngineConfig(admission="off")`` launches everything as before this controller existed
(outcomes are still learned): replay results are then exactly the previous ones.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from aospec.engine_config import EngineConfig
from aospec.errors import ConfigError
from aospec.host import DecodeMeter
from aospec.protocols import Clock, HostMonitor, HostSnapshot
from aospec.streams import tool_label
from aospec.types import Action, Step, Trace

if TYPE_CHECKING:
    from aospec.host import SpeculationBudget, SpeculationLease
    from aospec.ledger import Ledger

__all__ = [
    "BRANCH",
    "KINDS",
    "MODEL_FORMAT",
    "POOL",
    "PROBE_EVERY",
    "PROVISIONAL",
    "REASONS",
    "ROUND_KINDS",
    "ROUTED",
    "TARGET",
    "Admission",
    "AdmissionModel",
    "BetaHitModel",
    "Candidate",
    "CostModel",
    "Decision",
    "DraftRound",
    "DraftingState",
    "GuardState",
    "HitModel",
    "SavableHitModel",
    "cpu_price",
    "forks_to_run",
    "host_config",
    "step_cpu_s",
]

#: Kinds of candidates: a boundary's target action, a provisional continuation's action, a
#: routed target (the tool named mid-decode), an observation branch, a SpecBox pool fork.
TARGET, PROVISIONAL, ROUTED, BRANCH, POOL = "target", "provisional", "routed", "branch", "pool"
KINDS = (TARGET, PROVISIONAL, ROUTED, BRANCH, POOL)
#: Why a candidate was refused (``EngineStatistics.refused_<reason>``).
REASONS = ("price", "guard", "budget", "memory")
#: The JSON format name of a saved :class:`AdmissionModel`.
MODEL_FORMAT = "aospec-admission"
_MODEL_VERSION = 1

# Constants of the controller (documented in docs/engine.md, "The speculation controller").
#: Before any outcome, a fork that missed its step is taken to hit later with this share
#: of its score.
LATE_PRIOR = 0.25
#: A fork that missed its step and is not emitted within this many steps after it missed
#: for good (what p(late hit) is learned over).
LATE_STEPS = 4
#: Upper edges of the raw-score bins p(hit) is learned in (the last bin is open).
SCORE_EDGES = (0.05, 0.15, 0.3, 0.5, 0.75)
#: Distances beyond this share one cell.
MAX_DISTANCE = 3
#: Weight (in outcomes) of each level's prior, the coarser level's posterior mean.
BACKOFF_STRENGTH = 4.0
#: Before any measurement: a tool's time, a step's decode time, a launch's critical-path
#: overhead (s), and the CPU a command uses per second of its tool time (1: a guess whose
#: CPU is unknown is charged its whole tool time).
PRIOR_TOOL_S, PRIOR_DECODE_S, PRIOR_OVERHEAD_S, PRIOR_CPU_RATIO = 1.0, 1.0, 0.0005, 1.0
#: The most cores one measurement of a command's (or a stream's) CPU is taken to use.
MAX_CPU_RATIO = 64.0
#: Before any measurement (and in replay): the cores of this host one decode stream takes
#: (an observation branch's local price; aospec.host.DecodeMeter measures it live, a model
#: served in this process included): none, as for a remote endpoint.
PRIOR_STREAM_CORES = 0.0
#: The stream-seconds one measurement of a stream's cores spans at least.
STREAM_SAMPLE_S = 0.25
#: Before any step: the share of steps that change the filesystem; and the most steps a
#: fork is expected to stay valid (a run where nothing changes the state).
PRIOR_CHANGES, MAX_STEPS_VALID = 0.5, 20.0
#: A command that has run past its expected tool time is expected to run on for this
#: share of the time it has run.
OVERRUN = 0.5
#: A running mean counts at most this many samples (then it follows recent ones).
MEAN_WINDOW = 64
#: In the guard: one probe is let through every this many steps.
PROBE_EVERY = 8
#: The most committed steps the guard remembers (a larger ``guard_window`` is cut to it).
MAX_GUARD_WINDOW = 1024
#: A committed command using at least this many cores is CPU-bound (guesses yield to it).
CPU_BOUND_CORES = 0.5
#: Cores the host must keep free beside the command the agent waits on for guesses to run.
MIN_FREE_CORES = 0.5
#: Free cores the host must have for a speculative fork's reads to be traced (the tracer
#: multiplies its command's CPU; read-set validation is an investment only a spare core pays).
TRACE_FREE_CORES = 1.0
#: How often the command the agent waits on is sampled while it runs (s), while a guess
#: runs that could yield to it; with none, memory is checked every MEMORY_CHECK_SAMPLES-th.
SAMPLE_INTERVAL_S = 0.02
MEMORY_CHECK_SAMPLES = 10
#: Memory one fork is assumed to hold (no seam meters it), memory that must stay available,
#: the memory stall share (PSI) above which forks are dropped, and the price of one fork's
#: memory when it is all that is left (s).
FORK_MEMORY_BYTES = 64 << 20
MEMORY_RESERVE_BYTES = 256 << 20
MEMORY_PRESSURE = 0.10
MEMORY_PRICE_S = 0.1
#: Priced forks whose outcomes are still to come (beyond it the furthest are forgotten).
MAX_PENDING = 4096
#: Action keys whose last tool time is remembered.
MAX_KEYS = 4096
#: Drafting rounds of one kind remembered (their mean is what the next is expected to be
#: worth), how many
#: must be known before one may be skipped, the candidates one round keeps (the most
#: valuable first), and how often a kind whose rounds are skipped drafts all the same (a
#: probe: its rounds' figures stay current).
ROUND_WINDOW = 8
ROUND_MIN = 2
ROUND_CANDIDATES = 16
ROUND_PROBE_EVERY = 4
#: Kinds of drafting round: a boundary's targets, a branch's observations, a routed tool's
#: targets (each named after the kind of candidate it prices).
ROUND_KINDS = (TARGET, BRANCH, ROUTED)


def _late(c: Candidate) -> Candidate:
    """The candidate whose outcome is ``c``'s late hit: emitted after its step, still from
    the version it was priced at (JASV keeps such forks valid)."""
    return Candidate(f"{c.kind}/late", c.source, c.label, c.distance, c.score * LATE_PRIOR)


def _bin(score: float) -> int:
    for i, edge in enumerate(SCORE_EDGES):
        if score < edge:
            return i
    return len(SCORE_EDGES)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One guess to price: its ``kind`` (:data:`KINDS`), the drafter it comes from
    (``source``), the tool label of its action (``aospec.streams.tool_label``), its
    ``distance`` (steps ahead of the verified history: an action's offset or level, a
    branch's level) and the drafter's raw ``score``."""

    kind: str
    source: str
    label: str
    distance: int
    score: float

    def cells(self) -> tuple[tuple[Any, ...], ...]:
        """Its cells in :class:`BetaHitModel`, coarsest first."""
        b, d = _bin(self.score), min(self.distance, MAX_DISTANCE)
        return (
            (self.kind, b),
            (self.kind, b, d),
            (self.kind, b, d, self.label),
            (self.kind, b, d, self.label, self.source),
        )


@runtime_checkable
class HitModel(Protocol):
    """Where p(hit) comes from (pluggable: e.g. a drafter's score calibration combined with
    :class:`BetaHitModel`): ``p_hit(candidate)`` in [0, 1], ``observe(candidate, hit)`` once
    per candidate whose outcome is known. ``to_json()`` / ``from_json(obj)`` when it can be
    saved with an :class:`AdmissionModel`."""

    def p_hit(self, candidate: Candidate) -> float: ...

    def observe(self, candidate: Candidate, hit: bool) -> None: ...


@runtime_checkable
class SavableHitModel(HitModel, Protocol):
    """A :class:`HitModel` that can be saved with an :class:`AdmissionModel`."""

    def to_json(self) -> Any: ...


class BetaHitModel:
    """Beta posteriors of candidates' outcomes, hierarchical over :meth:`Candidate.cells`.

    With no outcome, p(hit) is the drafter's score; each cell's posterior mean is
    ``(hits + S * prior) / (outcomes + S)`` with ``S = strength`` and the coarser cell's
    mean as its prior, from the coarsest (kind x score bin) to the finest (x distance x tool
    label x drafter)."""

    def __init__(self, *, strength: float = BACKOFF_STRENGTH) -> None:
        if not strength > 0:
            raise ConfigError(f"BetaHitModel: strength must be > 0, got {strength}")
        self.strength = strength
        self._cells: dict[tuple[Any, ...], list[float]] = {}

    def __len__(self) -> int:
        return len(self._cells)

    def p_hit(self, candidate: Candidate) -> float:
        m = min(1.0, max(0.0, candidate.score))
        s = self.strength
        for key in candidate.cells():
            cell = self._cells.get(key)
            if cell is not None:
                m = (cell[0] + s * m) / (cell[1] + s)
        return m

    def observe(self, candidate: Candidate, hit: bool) -> None:
        for key in candidate.cells():
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = [0.0, 0.0]
            cell[0] += 1.0 if hit else 0.0
            cell[1] += 1.0

    def outcomes(self, candidate: Candidate) -> tuple[float, float]:
        """(hits, outcomes) of the candidate's finest cell."""
        cell = self._cells.get(candidate.cells()[-1])
        return (cell[0], cell[1]) if cell is not None else (0.0, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"strength": self.strength, "cells": [[list(k), h, n] for k, (h, n) in self._cells.items()]}

    @classmethod
    def from_json(cls, obj: Any, where: str = "hits") -> BetaHitModel:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected an object")
        model = cls(strength=_number(obj.get("strength", BACKOFF_STRENGTH), f"{where}.strength", positive=True))
        cells = obj.get("cells", [])
        if not isinstance(cells, list):
            raise ConfigError(f"{where}.cells: expected a list")
        for i, row in enumerate(cells):
            ok = isinstance(row, list) and len(row) == 3 and isinstance(row[0], list) and 2 <= len(row[0]) <= 5
            if not ok:
                raise ConfigError(f"{where}.cells[{i}]: expected [key, hits, outcomes]")
            hits = _number(row[1], f"{where}.cells[{i}] hits")
            n = _number(row[2], f"{where}.cells[{i}] outcomes")
            if hits > n:
                raise ConfigError(f"{where}.cells[{i}]: more hits ({hits}) than outcomes ({n})")
            model._cells[tuple(row[0])] = [hits, n]
        return model


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: expected a finite number >= 0, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where}: expected a number > 0, got {value!r}")
    return float(value)


class _Mean:
    """A running mean over at most MEAN_WINDOW samples (then it follows recent ones)."""

    __slots__ = ("mean", "n")

    def __init__(self, n: int = 0, mean: float = 0.0) -> None:
        self.n, self.mean = n, mean

    def add(self, x: float) -> None:
        self.n = min(self.n + 1, MEAN_WINDOW)
        self.mean += (x - self.mean) / self.n

    def get(self, default: float) -> float:
        return self.mean if self.n else default

    def to_json(self) -> list[float]:
        return [self.n, self.mean]

    @classmethod
    def from_json(cls, obj: Any, where: str) -> _Mean:
        if not (isinstance(obj, list) and len(obj) == 2):
            raise ConfigError(f"{where}: expected [samples, mean]")
        return cls(int(_number(obj[0], f"{where} samples")), _number(obj[1], f"{where} mean"))


class _Line:
    """``y = a + b * x`` fitted online (least squares, samples weighted down by
    ``1 - 1/MEAN_WINDOW`` per new one), ``a, b >= 0``; the mean of ``y`` until ``x`` varies."""

    __slots__ = ("n", "sx", "sxx", "sxy", "sy")

    def __init__(self, n: float = 0.0, sx: float = 0.0, sy: float = 0.0, sxx: float = 0.0, sxy: float = 0.0) -> None:
        self.n, self.sx, self.sy, self.sxx, self.sxy = n, sx, sy, sxx, sxy

    def add(self, x: float, y: float) -> None:
        k = 1.0 - 1.0 / MEAN_WINDOW
        self.n = self.n * k + 1.0
        self.sx = self.sx * k + x
        self.sy = self.sy * k + y
        self.sxx = self.sxx * k + x * x
        self.sxy = self.sxy * k + x * y

    def mean(self, default: float) -> float:
        return self.sy / self.n if self.n > 0 else default

    def at(self, x: float, default: float) -> float:
        n = self.n
        if n <= 0:
            return default
        mx, my = self.sx / n, self.sy / n
        var = self.sxx / n - mx * mx
        if n < 2 or var <= 1e-9 * max(1.0, mx * mx):
            return my
        slope = max(0.0, (self.sxy / n - mx * my) / var)
        intercept = max(0.0, my - slope * mx)
        return intercept + slope * x

    def to_json(self) -> list[float]:
        return [self.n, self.sx, self.sy, self.sxx, self.sxy]

    @classmethod
    def from_json(cls, obj: Any, where: str) -> _Line:
        if not (isinstance(obj, list) and len(obj) == 5):
            raise ConfigError(f"{where}: expected [n, sx, sy, sxx, sxy]")
        n, sx, sy, sxx = (_number(v, where) for v in obj[:4])
        sxy = obj[4]
        if isinstance(sxy, bool) or not isinstance(sxy, (int, float)) or not math.isfinite(sxy):
            raise ConfigError(f"{where}: expected finite numbers")
        return cls(n, sx, sy, sxx, float(sxy))


def _length(action: Action) -> float:
    """How much the actor writes to emit ``action``: the characters of its command (of its
    canonical arguments for another tool)."""
    cmd = action.command
    return float(len(cmd) if cmd is not None else len(action.key))


class CostModel:
    """What guesses cost, learned: tool time per action key (the last run of it) and per
    tool label, CPU seconds per tool second per label, a step's decode time (a line in the
    length of the action it emits: a long heredoc takes longer to decode than ``ls``), and
    the critical path's overhead without launches and per launch (s)."""

    def __init__(self) -> None:
        self.tool: dict[str, _Mean] = {}
        self.tool_all = _Mean()
        self.cpu: dict[str, _Mean] = {}
        self.cpu_all = _Mean()
        self.decode = _Line()
        self.overhead_base = _Mean()
        self.overhead_launch = _Mean()
        self.changes = _Mean()
        self.stream = _Mean()
        #: CPU-seconds one drafting round of a kind takes in this process (measured live)
        self.drafting: dict[str, _Mean] = {}
        self._keys: collections.OrderedDict[str, float] = collections.OrderedDict()

    def tool_s(self, action: Action, label: str | None = None) -> float:
        """Expected tool time of ``action``: its own last run, else its label's mean, else
        every tool's, else PRIOR_TOOL_S."""
        t = self._keys.get(action.key)
        if t is not None:
            return t
        mean = self.tool.get(label if label is not None else tool_label(action))
        if mean is not None and mean.n:
            return mean.mean
        return self.tool_all.get(PRIOR_TOOL_S)

    def mean_tool_s(self) -> float:
        return self.tool_all.get(PRIOR_TOOL_S)

    def cpu_ratio(self, label: str) -> float:
        mean = self.cpu.get(label)
        if mean is not None and mean.n:
            return mean.mean
        return self.cpu_all.get(PRIOR_CPU_RATIO)

    def stream_cores(self) -> float:
        """Cores of this host one decode stream takes (measured, else PRIOR_STREAM_CORES)."""
        return self.stream.get(PRIOR_STREAM_CORES)

    def drafting_cpu_s(self, kind: str) -> float:
        """CPU-seconds a drafting round of ``kind`` takes in this process (0 while unmeasured)."""
        mean = self.drafting.get(kind)
        return mean.mean if mean is not None and mean.n else 0.0

    def decode_s(self, action: Action | None = None) -> float:
        """Expected decode time of a step (that emits ``action``, when known)."""
        if action is None:
            return self.decode.mean(PRIOR_DECODE_S)
        return self.decode.at(_length(action), PRIOR_DECODE_S)

    def decoded(self, action: Action, decode_s: float) -> None:
        """A committed step took ``decode_s`` to decode ``action``."""
        self.decode.add(_length(action), decode_s)

    def steps_valid(self) -> float:
        """Steps a fork stays valid: until one changes the filesystem (1 / the share of
        steps that do; at most MAX_STEPS_VALID)."""
        return 1.0 / max(self.changes.get(PRIOR_CHANGES), 1.0 / MAX_STEPS_VALID)

    def overhead_s(self) -> float:
        """Critical-path overhead one launch adds (s)."""
        return self.overhead_launch.get(PRIOR_OVERHEAD_S)

    def executed(self, action: Action, tool_s: float, cpu_s: float | None = None, label: str | None = None) -> None:
        """``action`` ran for ``tool_s`` (using ``cpu_s`` of CPU, when measured)."""
        label = label if label is not None else tool_label(action)
        keys = self._keys
        keys[action.key] = tool_s
        keys.move_to_end(action.key)
        if len(keys) > MAX_KEYS:
            keys.popitem(last=False)
        self.tool.setdefault(label, _Mean()).add(tool_s)
        self.tool_all.add(tool_s)
        if cpu_s is not None and tool_s > 0:
            ratio = min(cpu_s / tool_s, MAX_CPU_RATIO)
            self.cpu.setdefault(label, _Mean()).add(ratio)
            self.cpu_all.add(ratio)

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": {k: v.to_json() for k, v in self.tool.items()},
            "tool_all": self.tool_all.to_json(),
            "cpu": {k: v.to_json() for k, v in self.cpu.items()},
            "cpu_all": self.cpu_all.to_json(),
            "decode": self.decode.to_json(),
            "overhead_base": self.overhead_base.to_json(),
            "overhead_launch": self.overhead_launch.to_json(),
            "changes": self.changes.to_json(),
            "stream": self.stream.to_json(),
            "drafting": {k: v.to_json() for k, v in self.drafting.items()},
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "costs") -> CostModel:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected an object")
        model = cls()
        for name in ("tool", "cpu", "drafting"):
            table = obj.get(name, {})
            if not isinstance(table, Mapping):
                raise ConfigError(f"{where}.{name}: expected an object")
            if name == "drafting" and (unknown := sorted(set(table) - set(ROUND_KINDS))):
                raise ConfigError(
                    f"{where}.drafting: unknown kind of round {unknown[0]!r} (known: {', '.join(ROUND_KINDS)})"
                )
            setattr(model, name, {str(k): _Mean.from_json(v, f"{where}.{name}.{k}") for k, v in table.items()})
        for name in ("tool_all", "cpu_all", "overhead_base", "overhead_launch", "changes", "stream"):
            if name in obj:
                setattr(model, name, _Mean.from_json(obj[name], f"{where}.{name}"))
        if "decode" in obj:
            model.decode = _Line.from_json(obj["decode"], f"{where}.decode")
        return model


def step_cpu_s(step: Step) -> float | None:
    """The CPU time a recorded step's command used (s), when the trace recorded it: the
    step's ``tool_cpu_s`` (aospec's recorder writes it, docs/trace-format.md), else
    ``extra["cpu_s"]``; None when unknown or not a number >= 0."""
    value: object = step.tool_cpu_s
    if value is None:
        value = step.extra.get("cpu_s") if isinstance(step.extra, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


class GuardState:
    """The no-regret guard's memory: the realised (benefit, cost) of the last committed
    steps, newest last (seconds), whether speculation is held back, and the steps since the
    last probe. It belongs to the :class:`AdmissionModel`, so an Engine's runs (and the runs
    of ``aospec run --calibration FILE``, which saves it) share one window: a guard that
    needed ``guard_window`` steps of one run never acted on tasks shorter than that."""

    __slots__ = ("guarded", "since_probe", "window")

    def __init__(self, window: Sequence[tuple[float, float]] = (), guarded: bool = False) -> None:
        self.window: collections.deque[tuple[float, float]] = collections.deque(window, maxlen=MAX_GUARD_WINDOW)
        self.guarded = guarded
        self.since_probe = PROBE_EVERY

    def step(self, benefit_s: float, cost_s: float, window: int) -> None:
        """One committed step's realised benefit and cost; with ``window`` > 0 steps known,
        the guard holds speculation back once their cost exceeds their benefit, and lets it
        go again once their benefit exceeds their cost."""
        w = self.window
        w.append((benefit_s, cost_s))
        self.since_probe += 1
        if window <= 0 or len(w) < window:
            return
        benefit = cost = 0.0
        for b, c in itertools.islice(reversed(w), window):
            benefit += b
            cost += c
        if not self.guarded and cost > benefit:
            self.guarded = True
        elif self.guarded and benefit > cost and benefit > 0:
            self.guarded = False

    def to_json(self) -> dict[str, Any]:
        return {"window": [[b, c] for b, c in self.window], "guarded": self.guarded}

    @classmethod
    def from_json(cls, obj: Any, where: str = "guard") -> GuardState:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected an object")
        window = obj.get("window", [])
        if not isinstance(window, list):
            raise ConfigError(f"{where}.window: expected a list of [benefit, cost]")
        pairs = []
        for i, pair in enumerate(window):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ConfigError(f"{where}.window[{i}]: expected [benefit, cost]")
            pairs.append((_number(pair[0], f"{where}.window[{i}]"), _number(pair[1], f"{where}.window[{i}]")))
        guarded = obj.get("guarded", False)
        if not isinstance(guarded, bool):
            raise ConfigError(f"{where}.guarded: expected true or false")
        return cls(pairs, guarded)


#: One priced candidate of a drafting round, price-free: (benefit net of its overhead share,
#: the share of its waste that is expected, the CPU-seconds it would waste, the rest of its
#: waste in seconds: decode and memory). At ``price`` seconds per CPU-second it is worth
#: ``net - share * (cpu * price + rest)``.
Figures = tuple[float, float, float, float]


class DraftRound:
    """One drafting round (``kind``: a boundary's targets, a branch's observations, a routed
    tool's targets): the figures of the candidates it priced, whatever became of them.
    What the round was worth at a price of a CPU-second is :meth:`value_s`: the sum of what
    its candidates would have been worth beyond their cost (those worth nothing count 0)."""

    __slots__ = ("cpu_ns", "figures", "kind", "open")

    def __init__(self, kind: str, figures: Sequence[Figures] = ()) -> None:
        self.kind = kind
        self.figures: list[Figures] = list(figures)
        #: the CPU this process spent on the round while it ran (None: not measured)
        self.cpu_ns: int | None = None
        #: running: CPU may still be charged to it (:meth:`Admission.end_round` closes it)
        self.open = False

    def add(self, figures: Figures) -> None:
        if figures[0] > 0:  # (one worth nothing even when free is worth nothing at any price)
            self.figures.append(figures)

    def value_s(self, price: float) -> float:
        return sum(max(0.0, net - share * (cpu * price + rest)) for net, share, cpu, rest in self.figures)

    def kept(self) -> DraftRound:
        """This round as it is remembered: its ROUND_CANDIDATES most valuable candidates."""
        best = sorted(self.figures, key=lambda f: -f[0])[:ROUND_CANDIDATES]
        return DraftRound(self.kind, best)


class DraftingState:
    """What drafting rounds were worth lately, per kind (:class:`DraftRound`, the last
    ROUND_WINDOW of each), and the rounds skipped in a row since the last one drafted. Like
    the guard's window it belongs to the :class:`AdmissionModel`: an Engine's runs, and runs
    that load and save one model file, share it."""

    __slots__ = ("rounds", "skipped")

    def __init__(self, rounds: Mapping[str, Sequence[DraftRound]] | None = None) -> None:
        self.rounds: dict[str, collections.deque[DraftRound]] = {
            k: collections.deque((rounds or {}).get(k, ()), maxlen=ROUND_WINDOW) for k in ROUND_KINDS
        }
        self.skipped: dict[str, int] = dict.fromkeys(ROUND_KINDS, 0)

    def to_json(self) -> dict[str, Any]:
        return {k: [[list(f) for f in r.figures] for r in rs] for k, rs in self.rounds.items() if rs}

    @classmethod
    def from_json(cls, obj: Any, where: str = "drafting") -> DraftingState:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{where}: expected an object")
        rounds: dict[str, list[DraftRound]] = {}
        for kind, rs in obj.items():
            if kind not in ROUND_KINDS:
                raise ConfigError(f"{where}: unknown kind of round {kind!r} (known: {', '.join(ROUND_KINDS)})")
            if not isinstance(rs, list):
                raise ConfigError(f"{where}.{kind}: expected a list of rounds")
            rounds[kind] = []
            for i, r in enumerate(rs):
                if not isinstance(r, list):
                    raise ConfigError(f"{where}.{kind}[{i}]: expected a list of candidates")
                figures: list[Figures] = []
                for j, f in enumerate(r):
                    at = f"{where}.{kind}[{i}][{j}]"
                    if not (isinstance(f, list) and len(f) == 4):
                        raise ConfigError(f"{at}: expected [net benefit, share wasted, cpu, other waste]")
                    net, share, cpu, rest = (_number(x, at) for x in f)
                    figures.append((net, share, cpu, rest))
                rounds[kind].append(DraftRound(kind, figures))
        return cls(rounds)


class AdmissionModel:
    """What the controller has learned: p(hit) (``hits``, a :class:`HitModel`, default
    :class:`BetaHitModel`), costs (:class:`CostModel`), the no-regret guard's recent
    steps (:class:`GuardState`) and what drafting rounds were worth lately
    (:class:`DraftingState`). An Engine keeps one across its runs; :meth:`save`/:meth:`load`
    keep it in a JSON file (``aospec run --calibration``)."""

    def __init__(
        self,
        hits: HitModel | None = None,
        costs: CostModel | None = None,
        guard: GuardState | None = None,
        drafting: DraftingState | None = None,
    ) -> None:
        self.hits: HitModel = hits if hits is not None else BetaHitModel()
        self.costs = costs if costs is not None else CostModel()
        self.guard = guard if guard is not None else GuardState()
        self.drafting = drafting if drafting is not None else DraftingState()

    def fit_costs(self, traces: Sequence[Trace]) -> None:
        """Learn tool times (and CPU per tool second where a step recorded its CPU) from the
        recorded steps of ``traces``."""
        costs = self.costs
        for trace in traces:
            for step in trace.steps:
                if step.action.is_none or step.tool_duration_s is None or not step.completed:
                    continue
                costs.executed(step.action, step.tool_duration_s, step_cpu_s(step))

    def to_json(self) -> dict[str, Any]:
        hits = self.hits
        if not isinstance(hits, SavableHitModel):
            raise ConfigError(
                f"admission model: its hit model {type(hits).__name__} has no to_json(); it cannot be saved"
            )
        return {
            "format": MODEL_FORMAT,
            "version": _MODEL_VERSION,
            "hits": hits.to_json(),
            "costs": self.costs.to_json(),
            "guard": self.guard.to_json(),
            "drafting": self.drafting.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "admission model") -> AdmissionModel:
        if not isinstance(obj, Mapping) or obj.get("format") != MODEL_FORMAT:
            raise ConfigError(f'{where}: not an aospec admission model (no "format": "{MODEL_FORMAT}")')
        if obj.get("version") != _MODEL_VERSION:
            raise ConfigError(f"{where}: version {obj.get('version')!r} is not {_MODEL_VERSION}")
        return cls(
            BetaHitModel.from_json(obj.get("hits", {}), f"{where}: hits"),
            CostModel.from_json(obj.get("costs", {}), f"{where}: costs"),
            GuardState.from_json(obj.get("guard", {}), f"{where}: guard"),
            DraftingState.from_json(obj.get("drafting", {}), f"{where}: drafting"),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AdmissionModel:
        """The model saved in ``path`` (ConfigError naming the file and what is wrong)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read the admission model: {exc.strerror or exc}") from None
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{p}: not JSON: {exc}") from None
        return cls.from_json(obj, str(p))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model to ``path`` atomically. A file there that is not an admission
        model aospec wrote is never overwritten (ConfigError)."""
        p = Path(path)
        if p.exists():
            try:
                ours = json.loads(p.read_text(encoding="utf-8")).get("format") == MODEL_FORMAT
            except (OSError, ValueError, AttributeError):
                ours = False
            if not ours:
                raise ConfigError(f"{p}: exists and is not an aospec admission model; not overwriting it")
        text = json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


# ---------------------------------------------------------------------- the host's price


def cpu_price(base: float, snapshot: HostSnapshot | None) -> float:
    """Seconds of latency one CPU-second of a guess costs now: ``base`` on a quiet host,
    plus the share of a core a guess takes from other work when fewer than one core is
    free, plus the CPU stall share (PSI). Unknown host (None): ``base``."""
    if snapshot is None:
        return base
    taken = min(1.0, max(0.0, 1.0 - snapshot.free_cores))
    return base + taken + (snapshot.cpu_pressure or 0.0)


def memory_low(snapshot: HostSnapshot | None) -> bool:
    """Memory is scarce: its stall share is at least MEMORY_PRESSURE, or less than
    MEMORY_RESERVE_BYTES is available."""
    if snapshot is None:
        return False
    if snapshot.memory_pressure is not None and snapshot.memory_pressure >= MEMORY_PRESSURE:
        return True
    return snapshot.memory_available_bytes is not None and snapshot.memory_available_bytes < MEMORY_RESERVE_BYTES


def forks_to_run(
    command_cores: float, snapshot: HostSnapshot | None, demands: Sequence[float], running_demand: float
) -> int:
    """How many speculative forks (the best first; ``demands``: the cores each uses) may run
    while the command the agent waits on uses ``command_cores``: all of them while it is not
    CPU-bound (it blocks: guesses take nothing from it); else as many as leave MIN_FREE_CORES
    free on the host besides it (``running_demand``: the cores the forks running now use,
    part of the snapshot's busy cores). With no host information: none."""
    if command_cores < CPU_BOUND_CORES:
        return len(demands)
    if snapshot is None:
        return 0
    spare = snapshot.free_cores + running_demand
    n = 0
    for d in demands:
        if spare - d < MIN_FREE_CORES:
            break
        spare -= d
        n += 1
    return n


def host_config(config: EngineConfig, snapshot: HostSnapshot) -> EngineConfig:
    """``config`` with width, depth and live forks scaled to the host: at most two target
    forks per free core (at least 1), lookahead 1 with fewer than two free cores, and at
    most 8 live forks per core (at least 4)."""
    free = snapshot.free_cores
    width = max(1, min(config.fork_width, int(2 * free)))
    depth = config.depth if free >= 2 else 1
    live = max(4, min(config.max_live_forks, int(8 * snapshot.cores)))
    if config.fork_width == 0:
        width = 0
    return replace(config, fork_width=width, depth=depth, max_live_forks=live)


# ---------------------------------------------------------------------- one run's controller


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict on one candidate: ``launch``, and why (``reason``: ``admitted``, ``probe``
    (let through by the guard), ``off`` (the controller is off), or one of :data:`REASONS`),
    with the figures it was decided on (p(hit), benefit and cost in seconds). ``lease`` is
    the budget slot an admitted fork holds while it runs (None without a budget)."""

    launch: bool
    reason: str
    candidate: Candidate
    p_hit: float
    benefit_s: float
    cost_s: float
    lease: SpeculationLease | None = None

    @property
    def value_s(self) -> float:
        return self.benefit_s - self.cost_s


Failed = Callable[..., None]


class Admission:
    """The controller of one run (see the module docstring): prices candidates, learns
    their outcomes and the run's costs, and keeps the guard. ``model`` is the Engine's
    (shared by its runs); ``host`` None prices CPU as on a quiet host; ``budget`` is the
    host's speculation budget (None: none)."""

    def __init__(
        self,
        model: AdmissionModel,
        config: EngineConfig,
        *,
        clock: Clock,
        ledger: Ledger,
        failed: Failed,
        host: HostMonitor | None = None,
        budget: SpeculationBudget | None = None,
    ) -> None:
        self.model = model
        self.on = config.admission == "on"
        self._config = config
        self._clock = clock
        self._ledger = ledger
        self._failed = failed
        self.host = host
        self.budget = budget
        self._hits = model.hits
        self._costs = model.costs
        self._boundary_ns = clock.now_ns()
        self._emitted_ns = self._boundary_ns
        self._inflight: Action | None = None
        self._launches = 0
        self._step_cost_s = 0.0
        #: the guard's recent steps, the model's: shared with this Engine's other runs
        self._guard = model.guard
        # forks priced (launched or refused) by their target step: (candidate, origin, key)
        self._pending: dict[int, list[tuple[Candidate, str, str]]] = {}
        self._pending_n = 0
        # forks that missed their step but are still valid (same origin), by (origin, key):
        # (their target step, candidate), the earliest first
        self._late: dict[tuple[str, str], list[tuple[int, Candidate]]] = {}
        # the live host's decode streams (aospec.host.DecodeMeter; a simulated host has none):
        # the cores one stream takes here, learned at each commit from the last mark
        meter = getattr(host, "decodes", None) if config.stream_cores is None else None
        #: where the session counts its decode streams (None: nowhere)
        self.decodes: DecodeMeter | None = meter if isinstance(meter, DecodeMeter) else None
        self._stream_mark: tuple[int, int] | None = None
        self._measure_streams()
        #: what drafting rounds were worth lately, the model's (shared with its other runs)
        self._rounds = model.drafting
        # the live host's CPU clock of the calling thread, on which drafting rounds are
        # measured (a simulated host has none: drafting costs nothing in virtual time)
        cpu = getattr(host, "drafting_cpu", None) if config.drafting_cpu_s is None else None
        self._drafting_cpu: Callable[[], int] | None = cpu if callable(cpu) else None
        #: whether drafting rounds are measured (:meth:`drafting_cpu_ns` reads the clock)
        self.measures_drafting = self._drafting_cpu is not None

    # ------------------------------------------------------------------ the host

    def snapshot(self) -> HostSnapshot | None:
        """The host now (None without a monitor, or when it fails: counted)."""
        if self.host is None:
            return None
        try:
            return self.host.snapshot()
        except Exception as exc:
            self._failed("reading the host's load", exc)
            return None

    def price(self) -> float:
        return cpu_price(self._config.cpu_price, self.snapshot())

    def memory_low(self) -> bool:
        return self.on and memory_low(self.snapshot())

    def may_trace(self) -> bool:
        """Whether a speculative fork may be traced for its read set now: the host has
        TRACE_FREE_CORES to spare (always with the controller off, or no host monitor)."""
        if not self.on:
            return True
        snap = self.snapshot()
        return snap is None or snap.free_cores >= TRACE_FREE_CORES

    # ------------------------------------------------------------------ the run's timeline

    def boundary(self, now_ns: int) -> None:
        """A step boundary (the run's start, or a commit)."""
        self._boundary_ns = now_ns
        self._inflight = None

    def emitted(self, action: Action, now_ns: int) -> None:
        """The actor emitted ``action``: it is the step in flight."""
        self._inflight = action
        self._emitted_ns = now_ns

    def executed(self, action: Action, tool_ns: int, cpu_ns: int | None) -> None:
        """An execution of ``action`` ended with an observation (a fork's or the step's own)."""
        if action.is_none:
            return
        self._costs.executed(action, tool_ns * 1e-9, None if cpu_ns is None else cpu_ns * 1e-9)

    def committed(
        self, action: Action, *, decode_ns: int, hidden_ns: int, overhead_ns: int, changed: bool = True
    ) -> None:
        """A step that emitted ``action`` was committed: its decode time, the time
        speculation hid on it (tool and decode), its overhead, and whether it ``changed``
        the filesystem; the guard moves on by one step."""
        costs = self._costs
        costs.decoded(action, decode_ns * 1e-9)
        costs.changes.add(1.0 if changed else 0.0)
        self._measure_streams()
        overhead = overhead_ns * 1e-9
        spent = 0.0
        if self._launches == 0:
            costs.overhead_base.add(overhead)
        else:
            spent = max(0.0, overhead - costs.overhead_base.get(0.0))
            costs.overhead_launch.add(spent / self._launches)
        guard = self._guard
        guard.step(hidden_ns * 1e-9, self._step_cost_s + spent, min(self._config.guard_window, MAX_GUARD_WINDOW))
        if self.guarded and self.on:
            self._ledger.guarded_step()
        self._launches = 0
        self._step_cost_s = 0.0

    @property
    def guarded(self) -> bool:
        """Whether the no-regret guard holds speculation back (only probes go), with a
        ``guard_window`` (0: never)."""
        return bool(self._config.guard_window) and self._guard.guarded

    def stream_cores(self) -> float:
        """Cores one decode stream takes on this host: ``stream_cores`` where the
        configuration fixes it, else what the cost model measured."""
        fixed = self._config.stream_cores
        return float(fixed) if fixed is not None else self._costs.stream_cores()

    def _measure_streams(self) -> None:
        """One measurement of the cores a decode stream takes in this process, once the
        streams since the last mark span STREAM_SAMPLE_S: the process's CPU over them."""
        meter = self.decodes
        if meter is None:
            return
        try:
            cpu, streams = meter.sample()
        except Exception as exc:
            self._failed("reading this process's decode streams", exc)
            self.decodes = None
            return
        mark = self._stream_mark
        if mark is None or cpu < mark[0] or streams < mark[1]:
            self._stream_mark = (cpu, streams)
            return
        spanned = streams - mark[1]
        if spanned >= STREAM_SAMPLE_S * 1e9:
            cores = getattr(self.host, "cores", None)
            cap = float(cores) if isinstance(cores, (int, float)) and cores > 0 else MAX_CPU_RATIO
            self._costs.stream.add(min((cpu - mark[0]) / spanned, cap))
            self._stream_mark = (cpu, streams)

    def _remaining_s(self, now_ns: int) -> float:
        """What is left of the step in flight's tool time (s; 0 with none in flight)."""
        if self._inflight is None:
            return 0.0
        elapsed = (now_ns - self._emitted_ns) * 1e-9
        # A command already past its expected time is expected to run on for a share of
        # what it has run (tool times are heavy-tailed).
        return max(self._costs.tool_s(self._inflight) - elapsed, OVERRUN * elapsed)

    # ------------------------------------------------------------------ drafting rounds

    def drafting_cpu_ns(self) -> int | None:
        """The engine thread's CPU time now, on the clock drafting rounds are measured on
        (None where they are not measured; a clock that fails is counted and not read again)."""
        clock = self._drafting_cpu
        if clock is None:
            return None
        try:
            return int(clock())
        except Exception as exc:
            self._failed("reading the drafting CPU clock", exc)
            self._drafting_cpu = None
            self.measures_drafting = False
            return None

    def drafting_cpu_s(self, kind: str) -> float:
        """CPU-seconds one drafting round of ``kind`` takes in this process: ``drafting_cpu_s``
        where the configuration fixes it, else what was measured where rounds are measured
        (0 before that; and always 0 where they are not, as in replay, whatever the model
        learned elsewhere)."""
        fixed = self._config.drafting_cpu_s
        if fixed is not None:
            return float(fixed)
        return self._costs.drafting_cpu_s(kind) if self.measures_drafting else 0.0

    def begin_round(self, kind: str) -> DraftRound | None:
        """A drafting round of ``kind`` (ROUND_KINDS) is about to start: the round to price
        its candidates in (``drafted_in=`` of :meth:`fork` and :meth:`branch`), or None when it is
        not worth its CPU now and must not run. Drafting is a guess too: it costs this
        process's CPU (at the host's price, as a fork's does) and is worth what it would
        launch. A round runs unless at least ROUND_MIN rounds of its kind are known and the
        last ROUND_WINDOW, priced at the host's price now, were worth less on average than a
        round's CPU; then every ROUND_PROBE_EVERY-th runs all the same (a probe)."""
        if self.on and not self._worth_drafting(kind):
            return None
        r = DraftRound(kind)
        r.open = True
        return r

    def _worth_drafting(self, kind: str) -> bool:
        cpu = self.drafting_cpu_s(kind)
        rounds = self._rounds.rounds[kind]
        if cpu <= 0 or len(rounds) < ROUND_MIN:
            return True
        price = self.price()
        cost = cpu * price
        skipped = self._rounds.skipped
        # what the next round is expected to be worth: the remembered ones' mean, each priced
        # again at the host's price now
        if sum(r.value_s(price) for r in rounds) > cost * len(rounds):
            skipped[kind] = 0
            return True
        skipped[kind] += 1
        if skipped[kind] >= ROUND_PROBE_EVERY:
            skipped[kind] = 0
            self._ledger.drafting_round(probe=True)
            return True
        self._ledger.drafting_round(skipped=True)
        return False

    def end_round(self, r: DraftRound) -> None:
        """Round ``r`` is over, however it ended: it is remembered with what it priced (a
        round cut short, because its boundary passed or its step's observation came first,
        launched nothing more: drafting that comes too late is worth nothing), and its CPU
        where it was measured (``r.cpu_ns``). Nothing is charged to it after this."""
        if not r.open:
            return
        r.open = False
        if not self.on:
            return  # (launching everything, the rounds' worth does not matter)
        self._rounds.rounds[r.kind].append(r.kept())
        if r.cpu_ns is not None and self.measures_drafting:
            self._costs.drafting.setdefault(r.kind, _Mean()).add(max(0, r.cpu_ns) * 1e-9)

    # ------------------------------------------------------------------ pricing

    def fork(
        self, action: Action, *, kind: str, source: str, distance: int, score: float, drafted_in: DraftRound | None = None
    ) -> Decision:
        """Price a speculative fork of ``action`` (``kind``: TARGET, PROVISIONAL or ROUTED)
        ``distance`` steps ahead of the verified history (``drafted_in``: the drafting round
        that proposed it, which records its figures)."""
        label = tool_label(action)
        c = Candidate(kind, source, label, distance, score)
        costs = self._costs
        now = self._clock.now_ns()
        tool, decode, step = costs.tool_s(action, label), costs.decode_s(), costs.mean_tool_s()
        if kind == TARGET or (kind == ROUTED and distance == 0):
            # emitted once the ``distance`` steps before it (decode and tool) and its own
            # decode are done, counted from the boundary
            elapsed = (now - self._boundary_ns) * 1e-9
            window = max(0.0, distance * (decode + step) + costs.decode_s(action) - elapsed)
        else:
            # a continuation's action: emitted when the step in flight commits (if its draft
            # was right), then after the steps between
            window = self._remaining_s(now) + max(0, distance - 1) * (decode + step)
        # a wrong guess runs until a step changes the state (JASV prunes it then)
        busy = min(tool, window + costs.steps_valid() * (decode + step))
        # missed at its step, it may still be emitted later from the same state (JASV keeps
        # it while it stays valid): within LATE_STEPS steps, it has run for up to as long
        late = min(tool, window + min(costs.steps_valid(), LATE_STEPS) * (decode + step))
        cpu = costs.cpu_ratio(label) * busy
        return self._decide(
            c, hide_s=min(tool, window), cpu_s=cpu, decode_s=0.0, fork=True, late_hide_s=late, drafted_in=drafted_in
        )

    def branch(
        self,
        action: Action,
        *,
        source: str,
        level: int,
        score: float,
        tool_if_hit_s: float | None = None,
        drafted_in: DraftRound | None = None,
    ) -> Decision:
        """Price an observation branch: a continuation decoded on a drafted observation of
        ``action`` (the step in flight at level 1), ``level`` drafted observations deep.
        ``tool_if_hit_s``: the tool time of ``action`` if the draft is right (EVD's
        ``T(c)``: a timeout message means a long tool), which bounds what the branch hides;
        what it wastes if wrong is bounded by the tool time expected of ``action``."""
        label = tool_label(action)
        c = Candidate(BRANCH, source, label, level, score)
        costs = self._costs
        now = self._clock.now_ns()
        before = max(0, level - 1) * costs.mean_tool_s()
        decode = costs.decode_s()
        waste = min(decode, self._remaining_s(now) + before)
        if tool_if_hit_s is not None and level == 1 and self._inflight is not None:
            elapsed = (now - self._emitted_ns) * 1e-9
            hide = min(decode, max(tool_if_hit_s - elapsed, OVERRUN * elapsed))
        else:
            hide = waste
        # a wrong branch's stream takes this host's CPU while it decodes (its local price)
        return self._decide(
            c, hide_s=hide, cpu_s=waste * self.stream_cores(), decode_s=waste, fork=False, drafted_in=drafted_in
        )

    def pool(self, label: str, *, probability: float, hide_s: float, cpu_s: float, source: str = "pool") -> Decision:
        """Price a SpecBox pool fork (an environment warmed for tool ``label``) that would
        hide ``hide_s`` and use ``cpu_s`` (the pool's estimates), ``probability`` the
        pool's score that it is used. The pool reports its outcome with :meth:`outcome`
        and releases ``decision.lease`` when done."""
        c = Candidate(POOL, source, label, 0, probability)
        return self._decide(c, hide_s=max(0.0, hide_s), cpu_s=max(0.0, cpu_s), decode_s=0.0, fork=True)

    def _p(self, c: Candidate) -> float:
        try:
            p = min(1.0, max(0.0, float(self._hits.p_hit(c))))
            if math.isnan(p):
                raise ValueError("p(hit) is NaN")
        except Exception as exc:
            self._failed("the hit model's p(hit)", exc)
            p = min(1.0, max(0.0, c.score))
        return p

    def _decide(
        self,
        c: Candidate,
        *,
        hide_s: float,
        cpu_s: float,
        decode_s: float,
        fork: bool,
        late_hide_s: float = 0.0,
        drafted_in: DraftRound | None = None,
    ) -> Decision:
        p = self._p(c)
        # a fork missed at its step that is emitted later (a late hit) hides ``late_hide_s``
        late = (1.0 - p) * self._p(_late(c)) if late_hide_s > 0 else 0.0
        snap = self.snapshot() if self.on else None
        cfg = self._config
        memory_s = 0.0
        if fork and snap is not None and snap.memory_available_bytes:
            memory_s = MEMORY_PRICE_S * FORK_MEMORY_BYTES / snap.memory_available_bytes
        rest = decode_s * cfg.decode_price + memory_s
        waste = cpu_s * cpu_price(cfg.cpu_price, snap) + rest
        overhead = self._costs.overhead_s()
        cost = (1.0 - p - late) * waste + overhead
        benefit = p * hide_s + late * late_hide_s
        if drafted_in is not None:
            drafted_in.add((benefit - overhead, 1.0 - p - late, cpu_s, rest))
        lease = None
        if not self.on:
            reason = "off"
            # the host's budget is a limit the user set, not a price: it holds with the
            # controller off too
            if fork and self.budget is not None:
                lease = self.budget.try_acquire()
                if lease is None:
                    reason = "budget"
        elif fork and memory_low(snap):
            reason = "memory"
        elif benefit <= cost:
            reason = "price"
        elif self.guarded and waste > 0 and self._guard.since_probe < PROBE_EVERY:
            reason = "guard"  # (a guess that costs nothing if wrong is not held back)
        else:
            reason = "probe" if self.guarded and waste > 0 else "admitted"
            if fork and self.budget is not None:
                lease = self.budget.try_acquire()
                if lease is None:
                    reason = "budget"
            if reason == "probe":
                self._guard.since_probe = 0
        launch = reason in ("admitted", "probe", "off")
        if launch:
            self._launches += 1
        self._ledger.decided(reason)
        return Decision(launch, reason, c, p, benefit, cost, lease)

    # ------------------------------------------------------------------ outcomes

    def outcome(self, decision: Decision | None, hit: bool) -> None:
        """The outcome of a branch (launched or refused: ``decision``): its draft was the
        real observation (``hit``) or not. (Forks' outcomes: :meth:`resolve`.)"""
        if decision is not None:
            self._observe(decision.candidate, hit)

    def _observe(self, candidate: Candidate, hit: bool) -> None:
        try:
            self._hits.observe(candidate, hit)
        except Exception as exc:
            self._failed("the hit model's observe", exc)

    def priced_fork(self, decision: Decision, origin: str, key: str, step: int) -> None:
        """A fork of action ``key`` from version ``origin`` was priced while step ``step`` is
        the next to commit: launched or refused, its outcome is learned at its target step
        (``step + distance``, :meth:`resolve`)."""
        target = step + decision.candidate.distance
        self._pending.setdefault(target, []).append((decision.candidate, origin, key))
        self._pending_n += 1
        if self._pending_n > MAX_PENDING:
            # a run whose steps never come (far lookahead): forget the furthest
            far = max(self._pending)
            self._pending_n -= len(self._pending.pop(far))

    def resolve(self, step: int, version: str, key: str) -> None:
        """Step ``step`` executes action ``key`` from ``version``: every fork priced for this
        step (or an earlier one) would have hit iff it is that action from that version
        (JASV), whether it was launched or refused. One that missed its step may still hit
        later, from the same version (a late hit, learned apart: :meth:`pruned`)."""
        late = self._late
        if late:
            for _, c in late.pop((version, key), ()):
                self._observe(_late(c), True)
            for origin_key in [k for k, cs in late.items() if cs[0][0] < step - LATE_STEPS]:
                for _, c in late.pop(origin_key):  # not emitted within LATE_STEPS steps: a miss
                    self._observe(_late(c), False)
        pending = self._pending
        if not pending:
            return
        for target in [t for t in pending if t <= step]:
            entries = pending.pop(target)
            self._pending_n -= len(entries)
            for c, origin, k in entries:
                hit = origin == version and k == key
                self._observe(c, hit)
                if not hit and origin == version:
                    late.setdefault((origin, k), []).append((target, c))
        if len(late) > MAX_PENDING:
            late.pop(next(iter(late)))

    def pruned(self, version: str) -> None:
        """The committed version is ``version``: forks that missed their step from any
        other version can never hit late."""
        late = self._late
        for origin_key in [k for k in late if k[0] != version]:
            for _, c in late.pop(origin_key):
                self._observe(_late(c), False)

    def wasted_fork(self, action: Action, tool_ns: int, cpu_ns: int | None) -> None:
        """A speculative fork nobody used ran ``tool_ns`` more (using ``cpu_ns``): its CPU,
        at the host's price now, is the step's cost in the guard's window."""
        cpu_s = cpu_ns * 1e-9 if cpu_ns is not None else tool_ns * 1e-9 * self._costs.cpu_ratio(tool_label(action))
        if cpu_s > 0:
            self._step_cost_s += cpu_s * self.price()

    def wasted_decode(self, decoded_ns: int) -> None:
        """A provisional continuation was cancelled after decoding ``decoded_ns``: its decode
        at ``decode_price`` and its stream's CPU at the host's price now."""
        if decoded_ns > 0:
            price = self._config.decode_price + self.stream_cores() * self.price()
            self._step_cost_s += decoded_ns * 1e-9 * price
