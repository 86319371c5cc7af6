"""What a stream router reads of a recorded step, built below ``specbox`` (replay may not
import it: tests/test_layers.py).

- :func:`step_stream` is ``specbox.routers.step_stream`` with each tool-call piece as an
  OpenAI chat-completions chunk dict (the form :class:`aospec.protocols.StreamingActor`
  reports), which ``specbox.routers.parse_chunk`` turns back into the same
  ``ToolCallDelta``; text pieces are the same strings.
- :func:`tool_label` is ``specbox.routers.tool_label``: the label a router names (a shell
  command's program past ``cd DIR &&``-style setup, :func:`aospec.shell.program_label`;
  else the tool name), which routed action drafters need.
- :class:`UnionRouter` joins several stream routers (``router=a+b`` of a replay policy).

tests/replay/test_replay_routing.py checks the first two against specbox on recorded traces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from aospec.shell import program_label
from aospec.types import Action, History, Step

__all__ = ["UnionRouter", "step_stream", "tokenize", "tool_label"]

#: specbox.routers' token pattern (GPT-2's pre-tokeniser: about one BPE token per piece).
_TOKEN = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|_+|\s+(?!\S)|\s+")


def tokenize(text: str) -> list[str]:
    """``text`` cut into stream tokens; ``"".join(tokenize(t)) == t``."""
    return _TOKEN.findall(text)


def _call_chunk(name: str | None, arguments: str) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    return {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": function}]}}]}


def step_stream(step: Step) -> list[object]:
    """The stream the actor decoded for ``step``, cut at the end of its action: a shell
    step's reply up to the end of its command (else the command as a fenced bash block),
    ``respond``'s content, a non-action's reply, or another tool's reply text, then a chunk
    naming the function and its arguments JSON in token-sized chunks."""
    action = step.action
    cmd = action.command
    reply = step.reply or ""
    if cmd is not None:
        if reply and cmd and cmd in reply:
            text = reply[: reply.index(cmd) + len(cmd)]
        else:
            text = (reply + "\n\n" if reply else "") + f"```bash\n{cmd}"
        return list(tokenize(text))
    if action.tool == "respond":
        content = action.args.get("content")
        return list(tokenize(content if isinstance(content, str) and content else reply))
    if action.is_none:
        return list(tokenize(reply))
    out: list[object] = list(tokenize(reply))
    out.append(_call_chunk(action.tool, ""))
    args = json.dumps(dict(action.to_json()["args"]), ensure_ascii=False)
    out.extend(_call_chunk(None, piece) for piece in tokenize(args))
    return out


def tool_label(action: Action) -> str:
    """A shell action's program (:func:`aospec.shell.program_label`: the first program past
    ``cd``/``export``-style setup commands), else the tool name."""
    cmd = action.command
    return action.tool if cmd is None else program_label(cmd)


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
