"""Shared helpers of the non-LM drafters: shell command features and an incremental
per-history index (so per-step work does not grow with the history).

The features split a command's first line with the tolerant splitting of
:mod:`aospec.shell` (``loose_segments``/``loose_words``), which never fails on a line the
strict lexer refuses."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

from aospec.shell import SETUP_PROGRAMS, first_line, loose_segments, loose_words
from aospec.types import Action, History, Turn

__all__ = ["HistoryIndex", "command_class", "command_contexts", "entities", "program"]

_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_WRAPPERS = {"sudo", "nohup", "time", "exec", "env", "stdbuf", "nice"}
_PATHLIKE = re.compile(r"^(?:[\w.~-]*/[\w./~@+-]*|[\w.@+-]+\.[A-Za-z][\w]{0,7})$")


def _words(segment: str) -> list[str]:
    words = loose_words(segment)
    k = 0
    while k < len(words):
        w = words[k]
        if _ASSIGN.match(w) or w in _WRAPPERS:
            k += 1
        elif w == "timeout" and k + 1 < len(words):
            k += 2
            while k < len(words) and words[k].startswith("-"):
                k += 1
        else:
            break
    return words[k:]


def program(command: str) -> str:
    """The program that does the work: first word of the last segment of the first line
    that is not a setup command (``cd``, ``source``, ``export``, ...:
    :data:`aospec.shell.SETUP_PROGRAMS`), wrappers (sudo, timeout N, env X=1) skipped.
    A feature, not the routing label (:func:`aospec.shell.program_label`: the first
    program, quote-aware)."""
    prog = ""
    for seg in loose_segments(first_line(command)):
        words = _words(seg)
        if not words or words[0] in SETUP_PROGRAMS:
            continue
        if seg is not None and prog and words[0] in ("head", "tail", "grep", "wc", "sort", "less", "cat"):
            continue  # a pipeline filter after the real program
        prog = words[0].rsplit("/", 1)[-1]
    return prog


def command_class(command: str) -> str:
    """A coarse description of a command: program, script kind and output handling."""
    first = first_line(command)
    prog = program(command)
    words = _words(first.split("&&")[-1])
    kind = ""
    if prog.startswith("python"):
        prog = "python"
        if "-c" in words:
            kind = "-c"
        elif "-m" in words:
            i = words.index("-m")
            kind = "-m " + (words[i + 1] if i + 1 < len(words) else "")
        elif any(w.endswith(".py") for w in words):
            kind = "script"
    elif prog in ("pip", "pip3", "apt-get", "apt", "git", "npm", "cargo", "go", "make", "docker", "conda", "uv"):
        sub = [w for w in words[1:] if not w.startswith("-")]
        prog = "pip" if prog == "pip3" else prog
        kind = sub[0] if sub else ""
    flags = []
    if "<<" in first:
        flags.append("heredoc")
    if re.search(r"(?<![0-9&<])>(?!&)\s*(?!/dev/null)\S", first):
        flags.append("redirect")
    if first.rstrip().endswith("&") and not first.rstrip().endswith("&&"):
        flags.append("background")
    if "|" in first.replace("||", ""):
        flags.append("pipe")
    return f"{prog}:{kind}:{','.join(flags)}"


def command_contexts(action: Action) -> tuple[str, ...]:
    """Backoff contexts for an action, most specific first (always ends with "")."""
    cmd = action.command
    if cmd is None:
        return (f"tool:{action.tool}", "")
    cls = command_class(cmd)
    prog = cls.split(":", 1)[0]
    return (cls, prog, "")


def entities(command: str) -> list[str]:
    """Path-like tokens of the command line (first line only: never a heredoc body),
    redirect and ``tee`` targets first, each once."""
    first = first_line(command)
    targets: list[str] = []
    others: list[str] = []
    words = loose_words(first)
    for k, w in enumerate(words):
        w2 = w.strip("'\"")
        if w in (">", ">>", "tee") and k + 1 < len(words):
            t = words[k + 1].strip("'\"")
            if t != "/dev/null" and t not in targets:
                targets.append(t)
        elif w.startswith(">") and len(w) > 1 and not w.startswith(">&"):
            t = w.lstrip(">").strip("'\"")
            if t and t != "/dev/null" and t not in targets:
                targets.append(t)
        elif _PATHLIKE.match(w2) and w2 not in others:
            others.append(w2)
    return targets + [o for o in others if o not in targets]


S = TypeVar("S")


class HistoryIndex(Generic[S]):
    """State folded over a history's turns, updated incrementally.

    ``fold(state, index, turn)`` mutates ``state`` with one more turn. When a history
    extends the one indexed last (the same turn objects), only the new turns are folded;
    any other history rebuilds from ``make()``.
    """

    def __init__(self, make: Callable[[], S], fold: Callable[[S, int, Turn], None]) -> None:
        self._make = make
        self._fold = fold
        self._turns: tuple[Turn, ...] = ()
        self._task: str | None = None
        self.state: S = make()

    def update(self, history: History) -> S:
        turns = history.turns
        n = len(self._turns)
        if history.task != self._task or len(turns) < n or (n and turns[n - 1] is not self._turns[n - 1]):
            self.state = self._make()
            self._task = history.task
            n = 0
        for i in range(n, len(turns)):
            self._fold(self.state, i, turns[i])
        self._turns = turns
        return self.state
