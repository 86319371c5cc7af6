"""Chat prompts for the language-model drafters, shared by drafting and training.

Observation model (the LM plays the *environment*): the system message states the
task; every past turn is a ``user`` message with the action and an ``assistant`` message
with its observation; the last ``user`` message is the action in flight. The target is
the observation text followed by the tokenizer's end token.

Action model (the LM plays the *agent*): past turns are ``assistant`` action / ``user``
observation; the target is the next ``depth`` actions joined by :data:`ACTION_SEPARATOR`.

Prompts are cut to a token budget by keeping the task and the newest turns; single long
texts are cut in the middle (head and tail kept), marked with :data:`ELISION`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aospec.types import Action, History, canonical_json

__all__ = [
    "ACTION_SEPARATOR",
    "ELISION",
    "PromptBudget",
    "action_messages",
    "observation_messages",
    "parse_action",
    "render_action",
]

ELISION = "\n[... {n} characters elided ...]\n"
ACTION_SEPARATOR = "\n<|next|>\n"

_OBS_SYSTEM = (
    "You are the environment of a software agent. The agent's task:\n{task}\n\n"
    "Each user message is a command the agent runs; reply with exactly the output the "
    "environment shows for it."
)
_ACT_SYSTEM = (
    "You are a software agent working on this task:\n{task}\n\n"
    "Reply with the next command to run."
)

_TOOL_RE = re.compile(r"^@([A-Za-z_][\w.\-]*) (\{.*\})$", re.S)

Messages = list[dict[str, str]]
TokenCounter = Callable[[str], int]


def render_action(action: Action) -> str:
    """Text of an action in prompts: a bash command as is, another tool as ``@tool {json}``."""
    command = action.command
    if command is not None and len(action.args) == 1:
        return command
    return f"@{action.tool} {canonical_json(action.to_json()['args'])}"


def parse_action(text: str) -> Action | None:
    """Inverse of :func:`render_action`; None when ``text`` is empty or malformed."""
    if not text.strip():
        return None
    m = _TOOL_RE.match(text)
    if m is None:
        return Action.bash(text)
    try:
        args = json.loads(m.group(2))
        return Action(m.group(1), args) if isinstance(args, dict) else None
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PromptBudget:
    """Token limits of a prompt: the whole prompt, the task text, and any single text."""

    total: int = 1536
    task: int = 256
    text: int = 384

    def __post_init__(self) -> None:
        if min(self.total, self.task, self.text) <= 0 or self.task >= self.total:
            raise ValueError(f"invalid prompt budget {self}")


def clip(text: str, max_tokens: int, count: TokenCounter) -> str:
    """Cut ``text`` in the middle so that it counts at most ``max_tokens`` (approximately
    for the elision marker itself)."""
    n = count(text)
    if n <= max_tokens:
        return text
    keep = max(16, int(len(text) * max_tokens / n * 0.9))
    for _ in range(4):
        head = keep * 2 // 3
        tail = keep - head
        cut = text[:head] + ELISION.format(n=len(text) - keep) + text[len(text) - tail:]
        if count(cut) <= max_tokens or keep <= 16:
            return cut
        keep = max(16, keep * 3 // 4)
    return cut


def _fit_turns(
    system: str,
    turns: Sequence[tuple[str, str]],
    last: str | None,
    roles: tuple[str, str],
    budget: PromptBudget,
    count: TokenCounter,
) -> Messages:
    overhead = 6  # role markers per message, roughly
    used = count(system) + overhead
    tail: Messages = []
    if last is not None:
        last = clip(last, budget.text, count)
        used += count(last) + overhead
        tail = [{"role": roles[0], "content": last}]
    kept: list[Messages] = []
    for first, second in reversed(turns):
        a = clip(first, budget.text, count)
        b = clip(second, budget.text, count)
        cost = count(a) + count(b) + 2 * overhead
        if used + cost > budget.total:
            break
        used += cost
        kept.append([{"role": roles[0], "content": a}, {"role": roles[1], "content": b}])
    messages: Messages = [{"role": "system", "content": system}]
    for pair in reversed(kept):
        messages.extend(pair)
    return messages + tail


def observation_messages(history: History, action: Action, budget: PromptBudget, count: TokenCounter) -> Messages:
    """Chat messages asking for the observation of ``action`` after ``history``."""
    system = _OBS_SYSTEM.format(task=clip(history.task, budget.task, count))
    turns = [(render_action(t.action), t.observation) for t in history.turns]
    return _fit_turns(system, turns, render_action(action), ("user", "assistant"), budget, count)


def action_messages(history: History, budget: PromptBudget, count: TokenCounter) -> Messages:
    """Chat messages asking for the next action(s) after ``history``."""
    system = _ACT_SYSTEM.format(task=clip(history.task, budget.task, count))
    turns = [(render_action(t.action), t.observation) for t in history.turns]
    messages = _fit_turns(system, turns, None, ("assistant", "user"), budget, count)
    if len(messages) == 1:  # chat templates want a user turn before the first reply
        messages.append({"role": "user", "content": "Begin."})
    return messages
