"""Command results and how they become observation text.

``run`` gives a :class:`CommandResult`; ``execute`` gives text, rendered by the sandbox's
formatter: anything with ``format(action, result) -> str``. The runtime favours no harness:
its default, ``raw``, is the output alone (and a timeout marker). A harness that wants its
own text chooses its formatter (``SandboxConfig(formatter=...)``) and owns how that text
reads back: ``mini-swe-agent`` reproduces mini-swe-agent 1.7's templates byte for byte (so
observations match recorded tb1 traces; ``aospec run``'s agent uses it), and
:meth:`MiniSweAgentFormatter.parse` is its inverse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aospec._lazy import import_object
from aospec.types import Action

__all__ = [
    "FORMATTERS",
    "CommandResult",
    "MiniSweAgentFormatter",
    "ObservationFormatter",
    "OutputBuffer",
    "RawFormatter",
    "SandboxStatistics",
    "TIMEOUT_RETURNCODE",
    "get_formatter",
]

TIMEOUT_RETURNCODE = 124


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did. ``output`` is stdout and stderr interleaved as written.

    ``returncode`` is the command's exit status (128 + N when a signal N killed it), and
    124 when it timed out (as with coreutils ``timeout``), on every backend.
    ``limits_hit`` names the limits the command ran into (``timeout``, ``memory`` — its
    own limit or a memory budget —, ``pids``, ``disk``, ``file_size``: a write failed
    with EFBIG/SIGXFSZ, or a file it wrote reached the limit); ``truncated`` is True when
    the output exceeded the capture cap and its middle was dropped.
    """

    returncode: int
    output: str
    timed_out: bool
    duration_s: float
    limits_hit: tuple[str, ...] = ()
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class SandboxStatistics:
    """Counters of one sandbox (``sandbox.statistics()``)."""

    commands: int
    forks: int
    commits: int
    freezes: int = 0
    stack_depth: int = 0
    compactions: int = 0
    #: overlay mounts that fell back to ``index=off`` (hard links may break on copy-up there)
    index_off_mounts: int = 0


@runtime_checkable
class ObservationFormatter(Protocol):
    """Turns an executed action and its result into the observation text."""

    def format(self, action: Action, result: CommandResult) -> str: ...


_TOO_LONG = (
    "<warning>\n"
    "The output of your last command was too long.\n"
    "Please try a different command that produces less output.\n"
    "If you're looking at a file you can try use head, tail or sed to view a smaller number of lines selectively.\n"
    "If you're using grep or find and it produced too much output, you can use a more selective search pattern.\n"
    "If you really need to see something from the full command's output, you can redirect output to a file and then search in that file.\n"
    "</warning>"
)


#: What :meth:`MiniSweAgentFormatter.format` writes for a finished command: the return
#: code, then the output, or for a long output a warning and the output's head.
_FINISHED = re.compile(
    r"\A<returncode>(-?\d+)</returncode>\n(?:<warning>.*?</warning>\n?)?<(output|output_head)>\n", re.DOTALL
)
_TIMED_OUT = re.compile(
    r"\AThe last command <command>.*?</command> timed out and has been killed\.\n"
    r"The output of the command was:\n <output>\n(.*)\n</output>\n"
    r"Please try another command and make sure to avoid those requiring interactive input\.\Z",
    re.DOTALL,
)


class MiniSweAgentFormatter:
    """mini-swe-agent 1.7's ``action_observation_template`` and ``timeout_template``, and
    their inverse (:meth:`parse`)."""

    def __init__(self, max_chars: int = 10000) -> None:
        self.max_chars = max_chars

    def format(self, action: Action, result: CommandResult) -> str:
        out = result.output
        if result.timed_out:
            cmd = action.command if action.command is not None else action.key
            return (
                f"The last command <command>{cmd}</command> timed out and has been killed.\n"
                f"The output of the command was:\n <output>\n{out}\n</output>\n"
                "Please try another command and make sure to avoid those requiring interactive input."
            )
        head = f"<returncode>{result.returncode}</returncode>\n"
        if len(out) < self.max_chars:
            return head + _short(out)
        elided = len(out) - self.max_chars
        half = self.max_chars // 2
        return (
            f"{head}{_TOO_LONG}<output_head>\n{out[:half]}\n</output_head>\n"
            f"<elided_chars>\n{elided} characters elided\n</elided_chars>\n"
            f"<output_tail>\n{out[-half:]}\n</output_tail>"
        )

    @staticmethod
    def parse(observation: str) -> CommandResult | None:
        """The result :meth:`format` rendered as ``observation`` (None when it is not such a
        text: a format error, another harness's text). Of an elided output only the head
        comes back (``truncated``); a timed-out command comes back with return code 124;
        the duration is not in the text (0)."""
        m = _FINISHED.match(observation)
        if m is not None:
            body = observation[m.end() :]
            head = m.group(2) == "output_head"
            end = body.find("\n</output_head>") if head else body.rfind("</output>")
            output = body[:end] if end >= 0 else body
            return CommandResult(int(m.group(1)), output, timed_out=False, duration_s=0.0, truncated=head)
        m = _TIMED_OUT.match(observation)
        if m is not None:
            return CommandResult(
                TIMEOUT_RETURNCODE, m.group(1), timed_out=True, duration_s=0.0, limits_hit=("timeout",)
            )
        return None


def _short(out: str) -> str:
    # jinja's ``{{ output.output -}}`` strips the whitespace *after* the expression in the
    # template (the newline before ``</output>``), not the output's own.
    return f"<output>\n{out}</output>"


class RawFormatter:
    """The output alone (plus the timeout marker when the command timed out)."""

    def format(self, action: Action, result: CommandResult) -> str:
        return result.output + ("\n[timed out]" if result.timed_out else "")


FORMATTERS = {
    "mini-swe-agent": "aospec.runtime.observation:MiniSweAgentFormatter",
    "raw": "aospec.runtime.observation:RawFormatter",
}


def get_formatter(spec: str | ObservationFormatter) -> ObservationFormatter:
    """A formatter by registry name or dotted path (classes are instantiated), or as given."""
    if not isinstance(spec, str):
        return spec
    obj = import_object(spec, FORMATTERS, "observation formatter")
    return obj() if isinstance(obj, type) else obj


class OutputBuffer:
    """Collects output up to ``cap`` bytes, keeping the head and the tail beyond it."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.frozen = False

    def freeze(self) -> None:
        """Keep what was added so far and ignore what comes later: when a timeout strikes,
        what the kill makes the command's shell print ("Killed") is not its output."""
        self.frozen = True

    def add(self, chunk: bytes) -> None:
        if self.frozen:
            return
        room = self.cap - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            half = self.cap // 2
            if len(self.tail) > half:
                self.dropped += len(self.tail) - half
                del self.tail[: len(self.tail) - half]

    def text(self) -> tuple[str, bool]:
        if not self.dropped and not self.tail:
            return self.head.decode("utf-8", "replace"), False
        if not self.dropped:
            return (self.head + self.tail).decode("utf-8", "replace"), False
        keep = self.head[: self.cap // 2]
        dropped = self.dropped + len(self.head) - len(keep)
        return (
            keep.decode("utf-8", "replace")
            + f"\n[... {dropped} bytes of output dropped ...]\n"
            + self.tail.decode("utf-8", "replace"),
            True,
        )
