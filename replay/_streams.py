"""What a stream router reads of a recorded step, built below ``specbox`` (replay may not
import it: tests/test_layers.py).

- :func:`step_stream` is :func:`aospec.streams.step_stream` (which specbox's routers use
  too) with each tool-call piece as an OpenAI chat-completions chunk dict (the form
  :class:`aospec.protocols.StreamingActor` reports), which ``aospec.specbox.routers.parse_chunk``
  turns back into the same ``ToolCallDelta``; text pieces are the same strings.
- :func:`tool_label` (:func:`aospec.streams.tool_label`, re-exported): the label a router
  names, which routed action drafters need.
- :class:`UnionRouter` joins several stream routers (``router=a+b`` of a replay policy).

tests/replay/test_replay_routing.py checks the first two against specbox on recorded traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aospec import streams
from aospec.streams import tokenize, tool_label
from aospec.types import History, Step

__all__ = ["UnionRouter", "step_stream", "tokenize", "tool_label"]


def _call_chunk(name: str | None, arguments: str) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    return {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": function}]}}]}


def step_stream(step: Step) -> list[object]:
    """The stream the actor decoded for ``step`` (:func:`aospec.streams.step_stream`), each
    tool-call piece an OpenAI chat-completions chunk dict."""
    return streams.step_stream(step, _call_chunk)


class UnionRouter:
    """Stream routers read side by side (an :class:`aospec.protocols.StreamRouter`): a tool
    fires when any member fires it, once per decode; once a member that is exact
    (``exact = True``, e.g. specbox's ParseRouter) has fired, nothing more fires in that
    decode, as in specbox's union assembly: the tool is known."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.members = tuple(members)
        self.name = "+".join(str(getattr(m, "name", type(m).__name__)) for m in self.members)

    def session(self, history: History | None = None) -> _UnionSession:
        """One decode's session of every member; ``history`` (the branch's, where the engine
        knows it) is passed on to each member's ``session``."""
        return _UnionSession(self.members, history)


class _UnionSession:
    __slots__ = ("_done", "_fired", "_sessions")

    def __init__(self, members: Sequence[Any], history: History | None = None) -> None:
        opened = [m.session() if history is None else m.session(history) for m in members]
        self._sessions = [(s, bool(getattr(m, "exact", False))) for s, m in zip(opened, members, strict=True)]
        self._fired: set[str] = set()
        self._done = False

    def feed(self, delta: object) -> list[Any]:
        out: list[Any] = []
        for session, exact in self._sessions:
            if self._done:
                break
            for event in session.feed(delta):
                if event.tool not in self._fired:
                    self._fired.add(event.tool)
                    out.append(event)
                if exact:
                    self._done = True
                    break
        return out
