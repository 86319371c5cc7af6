"""What an actor streamed for a recorded step, for stream routers (aospec.specbox.routers) and the
replay actor's streaming decode (replay/actor.py): one definition below both layers.

- :func:`tokenize` cuts text into stream tokens with GPT-2's pre-tokeniser pattern (a letter
  run or 1-3 digits with its leading space, a punctuation run, whitespace: about one BPE
  token per piece); ``"".join(tokenize(t)) == t``.
- :func:`step_stream` is the stream the actor decoded for a step, cut at the end of its
  action; each tool-call piece is built by the caller's ``call`` (specbox: a
  ``ToolCallDelta``; replay: an OpenAI chat-completions chunk dict, the form
  :class:`aospec.protocols.StreamingActor` reports).
- :func:`tool_label` is the label a router names: a shell command's program past
  ``cd DIR &&``-style setup (:func:`aospec.shell.program_label`), else the tool name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from aospec.shell import program_label
from aospec.types import Action, Step

__all__ = ["step_stream", "tokenize", "tool_label"]

#: GPT-2's pre-tokeniser pattern: about one BPE token per piece.
_TOKEN = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|_+|\s+(?!\S)|\s+")


def tokenize(text: str) -> list[str]:
    """``text`` cut into stream tokens (see ``_TOKEN``); ``"".join(tokenize(t)) == t``."""
    return _TOKEN.findall(text)


def tool_label(action: Action) -> str:
    """The routing label of ``action``: for a shell command, its program
    (:func:`aospec.shell.program_label`: the first program past ``cd``/``export``/``source``
    -style setup commands and ``VAR=value`` assignments; ``cd /x`` alone is ``cd``);
    otherwise the tool name."""
    cmd = action.command
    return action.tool if cmd is None else program_label(cmd)


def step_stream(step: Step, call: Callable[[str | None, str], object]) -> list[object]:
    """The stream the actor decoded for ``step``, cut at the end of its action.

    - A shell step: its reply text up to the end of the command inside it (the closing fence
      and anything after are left out), else the action rendered as a fenced bash block;
      tokenised with :func:`tokenize`.
    - A tool call of any other tool (tau-bench): the reply text (only the first call of a
      reply carries it) as tokens, then ``call(name, "")``, then the arguments JSON (as the
      model streams it: ``json.dumps``, keys in call order) cut into tokens, each
      ``call(None, piece)``.
    - ``respond``: its content text as tokens. ``none``: the reply text as tokens.
    """
    action = step.action
    cmd = action.command
    reply = step.reply or ""
    if cmd is not None:
        at = reply.find(cmd) if reply and cmd else -1
        if at >= 0:
            return tokenize(reply[: at + len(cmd)])
        return tokenize((reply + "\n\n" if reply else "") + f"```bash\n{cmd}")
    if action.tool == "respond":
        content = action.args.get("content")
        return tokenize(content if isinstance(content, str) and content else reply)
    if action.is_none:
        return tokenize(reply)
    out: list[object] = [*tokenize(reply)]
    out.append(call(action.tool, ""))
    args = json.dumps(dict(action.to_json()["args"]), ensure_ascii=False)
    out.extend(call(None, piece) for piece in tokenize(args))
    return out
