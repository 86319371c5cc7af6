"""What the MCP sandbox server and the MCP proxy share: the call predictors, the
arrival-order gate, the trust configuration and the result helpers.

Predictors propose the calls likely to come next; the server runs them speculatively
(in sandbox forks, or against the upstream at the current state epoch) and serves a
result only when the real call matches (same tool, same canonical arguments: the
:attr:`aospec.types.Action.key`) and the state it ran on is still the committed one.
"""

from __future__ import annotations

import inspect
import json
import os
import stat
import sys
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types

from aospec.types import Action, History

__all__ = [
    "REPLY_FIRST_S",
    "ArrivalGate",
    "Predictor",
    "RepeatPredictor",
    "TransitionPredictor",
    "DrafterPredictor",
    "MergedDrafter",
    "combine",
    "calls_drafters",
    "drafter_from_traces",
    "error_result",
    "load_transitions",
    "load_trust",
    "prefetch_cap",
    "propose",
    "result_meta",
    "text_result",
]

#: The key of aospec's entry in a CallToolResult's ``_meta``.
META_KEY = "aospec"


#: How long a server waits after a call returned before drafting the next speculations
#: (drafters are CPU work that never yields): every task ready to run, the transport's
#: writer of that reply among them, runs before the timer fires.
REPLY_FIRST_S = 0.005


def prefetch_cap(max_forks: int) -> int:
    """How many of ``max_forks`` live forks (speculative calls) prefetched calls may hold:
    half, at least one; none of none."""
    return max(1, max_forks // 2) if max_forks > 0 else 0


class ArrivalGate:
    """Executes calls one at a time, in the order their handlers were entered.

    The MCP SDK starts one task per incoming request, in the order the transport delivered
    them; the first thing each tools/call handler does is take a ticket here, so calls
    run in delivery order (anyio's Lock wakes waiters first-come first-served)."""

    def __init__(self) -> None:
        self._lock = anyio.Lock()
        self.tickets = 0

    async def __aenter__(self) -> int:
        self.tickets += 1
        ticket = self.tickets
        await self._lock.acquire()
        return ticket

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


# -- results ---------------------------------------------------------------------------------


def text_result(text: str, *, is_error: bool = False) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=is_error)


def error_result(message: str) -> types.CallToolResult:
    """A tool error (``isError: true``): the model sees the message, the call failed."""
    return text_result(message, is_error=True)


def result_meta(result: types.CallToolResult, **fields: Any) -> types.CallToolResult:
    """A copy of ``result`` with aospec's fields under ``_meta.aospec`` (clients ignore it)."""
    meta = dict(result.meta or {})
    meta[META_KEY] = {**meta.get(META_KEY, {}), **fields}
    return result.model_copy(update={"meta": meta})


# -- predictors ------------------------------------------------------------------------------

#: A predictor: given the call just committed (None before the first) and the text of its
#: result, the calls to run speculatively next, most likely first (a list, or an awaitable
#: of one).
Predictor = Callable[[Action | None, str], "list[Action] | Awaitable[list[Action]]"]


class RepeatPredictor:
    """Speculates the ``k`` most recently used distinct calls that ``eligible`` accepts
    (read-only ones by default): agents re-read the same files and re-run the same tests
    and listings after every edit. Call ``observe`` with every committed call."""

    def __init__(self, eligible: Callable[[Action], bool], k: int = 2, memory: int = 64) -> None:
        self.eligible = eligible
        self.k = k
        self.memory = memory
        self._recent: OrderedDict[str, Action] = OrderedDict()

    def observe(self, action: Action) -> None:
        if not self.eligible(action):
            return
        self._recent.pop(action.key, None)
        self._recent[action.key] = action
        while len(self._recent) > self.memory:
            self._recent.popitem(last=False)

    def __call__(self, last: Action | None, observation: str = "") -> list[Action]:
        if last is not None:
            self.observe(last)
        return list(reversed(self._recent.values()))[: self.k]


class TransitionPredictor:
    """A first-order transition table: after call A, speculate the calls that followed A
    most often (``table[A.key]``, most frequent first, at most ``k``)."""

    def __init__(self, table: Mapping[str, Sequence[Action]], k: int = 2) -> None:
        self.table = {key: list(v) for key, v in table.items()}
        self.k = k

    @classmethod
    def fit(cls, sequences: Iterable[Sequence[Action]], k: int = 2) -> TransitionPredictor:
        """Count transitions in ``sequences`` (e.g. the actions of recorded traces)."""
        counts: dict[str, Counter[str]] = {}
        actions: dict[str, Action] = {}
        for seq in sequences:
            prev: Action | None = None
            for action in seq:
                if action.is_none:
                    prev = None
                    continue
                actions[action.key] = action
                if prev is not None:
                    counts.setdefault(prev.key, Counter())[action.key] += 1
                prev = action
        table = {
            key: [actions[nk] for nk, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]
            for key, c in counts.items()
        }
        return cls(table, k)

    def __call__(self, last: Action | None, observation: str = "") -> list[Action]:
        if last is None:
            return []
        return self.table.get(last.key, [])[: self.k]


def combine(*predictors: Predictor, k: int) -> Callable[[Action | None, str], Awaitable[list[Action]]]:
    """The predictors' proposals in order, without repeats, at most ``k``."""

    async def predict(last: Action | None, observation: str = "") -> list[Action]:
        out: dict[str, Action] = {}
        for p in predictors:
            proposed = p(last, observation)
            if inspect.isawaitable(proposed):
                proposed = await proposed
            for a in proposed:
                out.setdefault(a.key, a)
        return list(out.values())[:k]

    return predict


async def propose(predictor: Predictor, last: Action | None, observation: str) -> list[Action]:
    """What ``predictor`` proposes, awaited if it is asynchronous."""
    proposed = predictor(last, observation)
    if inspect.isawaitable(proposed):
        proposed = await proposed
    return list(proposed)


class DrafterPredictor:
    """An aospec :class:`~aospec.protocols.ActionDrafter` as a predictor: the session's
    calls and result texts so far are its history; it proposes the next call (offset 0)."""

    def __init__(self, drafter: Any, k: int = 2, task: str = "", keep: Callable[[Action], bool] | None = None) -> None:
        self.drafter = drafter
        self.k = k
        self.history = History(task=task)
        self.keep = keep

    async def __call__(self, last: Action | None, observation: str = "") -> list[Action]:
        if last is not None:
            self.history = self.history.extend(last, observation)
        # with a filter (the proxy's trusted tools), ask for more: a slot taken by a call that
        # would be refused anyway is a slot lost
        width = self.k if self.keep is None else 4 * self.k
        drafts = await self.drafter.propose(self.history, width, 1)
        keep = self.keep or (lambda a: True)
        return [d.action for d in drafts if d.offset == 0 and not d.action.is_none and keep(d.action)][: self.k]


MAX_CONFIG_BYTES = 64 << 20


def read_config_json(path: str | Path) -> Any:
    """The JSON of a configuration file; ValueError naming it when it is not a regular file
    (a FIFO would block the server's start forever), too large, or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: {st.st_size} bytes, over the {MAX_CONFIG_BYTES}-byte limit of a configuration")
        data = f.read(MAX_CONFIG_BYTES + 1)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None


def load_transitions(path: str | Path, k: int) -> TransitionPredictor:
    """A transition table from a JSON file: a list of ``{"after": ACTION, "next": [ACTION,
    ...]}`` where an ACTION is ``{"tool": NAME, "args": {...}}``."""
    data = read_config_json(path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a transition file is a JSON list of {{after, next}} objects")
    table: dict[str, list[Action]] = {}
    for i, row in enumerate(data):
        if not isinstance(row, Mapping) or set(row) != {"after", "next"} or not isinstance(row["next"], list):
            raise ValueError(f"{path}: entry {i} must be an object with exactly 'after' and 'next' (a list)")
        after = Action.from_json(row["after"])
        table.setdefault(after.key, []).extend(Action.from_json(a) for a in row["next"])
    return TransitionPredictor(table, k)


class MergedDrafter:
    """Several action drafters as one: their drafts, each action once (at its best
    probability), most probable first. A drafter that fails loses only its own drafts (the
    failure is counted in ``failures`` and named once on stderr): a guess must never fail
    the call it follows."""

    def __init__(self, drafters: Sequence[Any], who: str = "aospec mcp") -> None:
        self.drafters = tuple(drafters)
        self.failures = 0
        self.who = who  # how the note on stderr names the program

    async def propose(self, history: History, width: int, depth: int) -> list[Any]:
        best: dict[tuple[str, int], Any] = {}
        for d in self.drafters:
            try:
                drafts = list(await d.propose(history, width, depth))
            except Exception as exc:  # any drafter bug only costs its own guesses
                self.failures += 1
                if self.failures == 1:
                    print(
                        f"{self.who}: note: {type(d).__name__} failed ({type(exc).__name__}: {exc}); "
                        "its guesses are skipped",
                        file=sys.stderr,
                    )
                continue
            for draft in drafts:
                key = (draft.action.key, draft.offset)
                if key not in best or best[key].probability < draft.probability:
                    best[key] = draft
        return sorted(best.values(), key=lambda x: (x.offset, -x.probability, x.action.key))[:width]


def calls_drafters(traces: Sequence[Any], calibrate: bool = True) -> list[Any]:
    """aospec's history action drafter (``aospec.drafters.history``) and its calls drafter
    (``aospec.drafters.calls``: arguments taken from what earlier results showed), fitted on
    ``traces``, each ranking by probabilities calibrated on them
    (:func:`aospec.drafters.calibration.fit_action_calibration`; raw scores when the traces
    hold a single task, or without ``calibrate``): on the tau-bench airline trajectories the history drafter alone
    finds the next call 1 time in 100, and uncalibrated its confident repeats of calls
    already made outrank the calls drafter's right guesses (docs/drafters.md, "Calibration")."""
    from aospec.drafters.calibration import calibrated, fit_action_calibration
    from aospec.drafters.calls import CallsActionDrafter
    from aospec.drafters.history import HistoryActionDrafter

    out = []
    for name, make in (("history", HistoryActionDrafter), ("calls", CallsActionDrafter)):
        d = make()
        d.fit(traces)
        out.append(calibrated(d, name, fit_action_calibration(name, make, traces) if calibrate else None))
    return out


def drafter_from_traces(paths: Sequence[str], k: int, keep: Callable[[Action], bool] | None = None) -> DrafterPredictor:
    """:func:`calls_drafters` fitted on recorded traces (any format ``aospec traces`` reads),
    as one predictor; ``keep``: only the calls it accepts are proposed (the proxy's trusted
    tools)."""
    from aospec.replay.io import load_traces

    return DrafterPredictor(MergedDrafter(calls_drafters(load_traces(list(paths)))), k, keep=keep)


# -- trust -----------------------------------------------------------------------------------

_TRUST_KEYS = {"readOnly", "openWorld"}


def load_trust(path: str | Path) -> frozenset[str]:
    """The tools a trusted configuration allows to speculate.

    The file is JSON: ``{"tools": {"NAME": {"readOnly": true, "openWorld": false}, ...}}``
    with NAME the tool's name as the proxy lists it. A tool is speculated only when its
    entry says ``readOnly: true`` AND ``openWorld: false`` (both explicit); the upstream's
    own annotations are never consulted for this. Unknown keys are an error."""
    data = read_config_json(path)
    if not isinstance(data, Mapping) or set(data) - {"tools"} or not isinstance(data.get("tools", {}), Mapping):
        raise ValueError(f'{path}: a trust file is {{"tools": {{NAME: {{"readOnly": ..., "openWorld": ...}}}}}}')
    trusted = set()
    for name, entry in data.get("tools", {}).items():
        if not isinstance(entry, Mapping) or set(entry) - _TRUST_KEYS:
            raise ValueError(f"{path}: tool {name!r}: allowed keys are {sorted(_TRUST_KEYS)}")
        for key in entry:
            if not isinstance(entry[key], bool):
                raise ValueError(f"{path}: tool {name!r}: {key!r} must be true or false")
        if entry.get("readOnly") is True and entry.get("openWorld") is False:
            trusted.add(name)
    return frozenset(trusted)
