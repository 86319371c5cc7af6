"""The seams of aospec, as structural protocols (never inherited).

Each seam is small. Cancellation is not part of any seam: the engine cancels work by
cancelling the anyio cancel scope around the awaited call, so every implementation must
be cancel-safe (release what it holds when ``anyio.get_cancelled_exc_class()`` is raised).

In-package implementations for tests live in :mod:`aospec.testing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aospec.types import Action, History, Trace

__all__ = [
    "ActionDraft",
    "ActionDrafter",
    "Actor",
    "Kernel",
    "ObservationCanonicalizer",
    "ObservationDraft",
    "ObservationDrafter",
    "Sandbox",
    "Trainable",
    "TraceSource",
]


@runtime_checkable
class Actor(Protocol):
    """The model that decodes the next action.

    ``decode`` starts decoding from ``history`` (which may end in a drafted, provisional
    observation) and returns the finished action. Cancelling the caller's scope cancels
    the decode.
    """

    async def decode(self, history: History) -> Action: ...


@runtime_checkable
class Sandbox(Protocol):
    """An environment that executes actions and can be forked copy-on-write.

    ``version`` identifies the filesystem state exactly (equal states of equal lineage
    have equal versions); it is up to date whenever no ``execute`` is in flight.
    ``fork`` returns an isolated child whose origin version is this sandbox's current
    version; ``commit(child)`` makes the child's state this sandbox's state (the child is
    consumed); ``discard`` throws this sandbox (a fork) away and releases everything.
    """

    @property
    def version(self) -> str: ...

    async def execute(self, action: Action) -> str: ...

    async def fork(self) -> Sandbox: ...

    async def commit(self, fork: Sandbox) -> None: ...

    async def discard(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ObservationDraft:
    """A candidate observation for an action in flight.

    ``probability`` is the drafter's estimate that the real observation is byte-identical
    to ``text``. ``template`` names the mined pattern the text instantiates, when known
    (the EVD pattern kernel groups observations by it). ``tokens`` is how many tokens the
    drafter generated for it (0 for non-generative drafters); replay charges drafting
    time in virtual time from it.
    """

    text: str
    probability: float
    template: str | None = None
    tokens: int = 0


@runtime_checkable
class ObservationDrafter(Protocol):
    """Proposes up to ``n`` candidate observations of ``action`` after ``history``."""

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]: ...


@dataclass(frozen=True, slots=True)
class ActionDraft:
    """A candidate target action: ``offset`` 0 is the next action the actor will emit
    after the history, 1 the one after it, and so on. ``tokens`` as for ObservationDraft."""

    action: Action
    offset: int
    probability: float
    tokens: int = 0


@runtime_checkable
class ActionDrafter(Protocol):
    """Proposes up to ``width`` target actions, ``depth`` steps ahead at most."""

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]: ...


@runtime_checkable
class Kernel(Protocol):
    """Similarity between a candidate observation and historical observations, for EVD.

    ``similarities(c, obs)[j]`` is ``K(c, obs[j])`` in [0, 1]; EVD estimates a candidate's
    tool time as ``sum_j K(c, o_j) T_j / sum_j K(c, o_j)``.
    """

    def similarities(self, candidate: str, observations: Sequence[str]) -> Sequence[float]: ...


@runtime_checkable
class ObservationCanonicalizer(Protocol):
    """Maps an observation to a canonical form with inconsequential fields (process ids,
    temp names, times) replaced; used only when the engine accepts drafts canonically
    (``EngineConfig(accept="canonical")``), never to change what the actor sees."""

    def canonical(self, text: str) -> str: ...


@runtime_checkable
class Trainable(Protocol):
    """A drafter that learns from training traces before use (never from eval traces)."""

    def fit(self, traces: Sequence[Trace]) -> None: ...


@runtime_checkable
class TraceSource(Protocol):
    """Yields canonical traces."""

    def traces(self) -> Iterator[Trace] | Iterable[Trace]: ...
