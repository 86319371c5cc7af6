"""The branches of a session's tree (Algorithm 1's ``B``, ``P`` and ``B'``).

A :class:`Branch` is one decode of the next action from a history: the verified one (level
0, ``B``), or one that ends in drafted observations (a provisional continuation, one of some
branch's ``P``). :class:`aospec.session.Session` grows and adopts them; a branch seals,
rebases, promotes and cancels its own subtree; :class:`aospec.drafting.Drafting` drafts for
them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from aospec.admission import Decision
from aospec.protocols import ObservationDraft
from aospec.types import Action, History

if TYPE_CHECKING:
    from anyio import TaskHandle

__all__ = ["Branch", "BranchState"]


class BranchState(enum.Enum):
    """The life of a :class:`Branch`.

    ``DECODING`` -> ``DECODED`` (or ``FAILED``) -> ``DRAFTING`` -> ``DRAFTED``; the branch
    being verified moves to ``SEALED`` when the real observation arrives before its
    drafting is over; any branch whose history can no longer happen moves to ``CANCELLED``.
    """

    DECODING = "decoding"  # the actor decodes the next action from the branch's history
    DECODED = "decoded"  # the action is known; no observation drafted for it yet
    FAILED = "failed"  # the decode raised: no action
    DRAFTING = "drafting"  # observation drafters run; continuations start as their drafts arrive
    DRAFTED = "drafted"  # drafting is over: the continuations are final
    SEALED = "sealed"  # the real observation came first: drafting stopped, no continuation will start
    CANCELLED = "cancelled"  # its history never happened: decode, drafting and continuations stopped


class Branch:
    """A decode of the next action from ``history``.

    ``level`` 0 decodes from the verified history (``B``); level ``k > 0`` from a history
    that ends in ``k`` drafted observations (``draft`` is the last one, ``probability``
    the product of their probabilities). ``continuations`` (``P``) maps the text of each
    drafted observation of ``action`` to the branch started on it; it is empty until the
    branch drafts. The decode runs from ``started_ns`` to ``decoded_ns``. ``decision`` is
    the speculation controller's verdict that started it; ``refused`` maps the texts of
    drafts of ``action`` the controller refused to theirs (their outcomes are learned when
    the real observation arrives).
    """

    __slots__ = (
        "_waiter",
        "action",
        "canonical_form",
        "continuations",
        "decision",
        "decode_task",
        "decoded_ns",
        "draft",
        "draft_task",
        "history",
        "level",
        "probability",
        "refused",
        "started_ns",
        "state",
    )

    def __init__(
        self, history: History, level: int, draft: ObservationDraft | None, probability: float, started_ns: int
    ) -> None:
        self.history = history
        self.level = level
        self.draft = draft
        self.probability = probability
        self.started_ns = started_ns
        self.decoded_ns = started_ns
        self.state = BranchState.DECODING
        self.action: Action | None = None
        self.canonical_form: str | None = None
        self.continuations: dict[str, Branch] = {}
        self.decode_task: TaskHandle[None] | None = None
        self.draft_task: TaskHandle[None] | None = None
        self.decision: Decision | None = None
        self.refused: dict[str, Decision] = {}
        self._waiter: anyio.Event | None = None

    def end_decode(self) -> None:
        """The decode is over (with or without an action): move on and wake waiters."""
        if self.state is BranchState.DECODING:
            self.state = BranchState.DECODED if self.action is not None else BranchState.FAILED
        if self._waiter is not None:
            self._waiter.set()

    async def wait_decoded(self) -> None:
        """Wait until the decode is over."""
        if self.state is BranchState.DECODING:
            if self._waiter is None:
                self._waiter = anyio.Event()
            await self._waiter.wait()

    def seal(self) -> bool:
        """The real observation of this branch's action has arrived: no continuation starts
        after it. True when drafting was still running (it lost the race and is cancelled)."""
        lost = self.state is BranchState.DRAFTING
        if lost:
            # Why: drafting that finishes after the real observation lost the race; its
            # continuations could only ever be discarded.
            assert self.draft_task is not None
            self.draft_task.cancel()
        if self.state in (BranchState.DECODED, BranchState.DRAFTING):
            self.state = BranchState.SEALED
        return lost

    def rebase(self, history: History) -> None:
        """Give this branch (and its subtree) ``history`` in place of the one it started on."""
        self.history = history
        if self.continuations and self.action is not None:
            for text, child in self.continuations.items():
                child.rebase(history.extend(self.action, text))

    def promote(self, obs_depth: int, predict: Callable[[Branch], None]) -> None:
        """Shift the subtree one level towards the verified history; ``predict`` starts
        drafting on the branches that now fall within ``obs_depth`` and have decoded."""
        self.level -= 1
        if self.continuations:
            for child in self.continuations.values():
                child.promote(obs_depth, predict)
        elif 0 < self.level < obs_depth and self.state is BranchState.DECODED:
            predict(self)

    def cancel(self, now_ns: int, cancelled: Callable[[Branch, int], None]) -> None:
        """Stop this branch and its subtree (their histories never happened); each branch
        stopped here is passed to ``cancelled`` with the decode time it spent (ns)."""
        if self.state is BranchState.CANCELLED:
            return
        self.state = BranchState.CANCELLED
        if self.decode_task is not None:
            self.decode_task.cancel()
        if self.draft_task is not None:
            self.draft_task.cancel()
        cancelled(self, (self.decoded_ns if self.action is not None else now_ns) - self.started_ns)
        for child in self.continuations.values():
            child.cancel(now_ns, cancelled)
        self.continuations = {}
