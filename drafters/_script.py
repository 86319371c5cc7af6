"""A shell command line as a structure the trajectory drafters can evaluate.

:func:`parse_script` turns a command into a :class:`Script`: pipelines joined by ``&&``,
``||``, ``;`` or newlines, each pipeline a sequence of :class:`Command` (words, redirections
with their file-descriptor numbers, a heredoc body). Words are split and unquoted by the
strict lexer of :mod:`aospec.shell` (:func:`aospec.shell.tokens`); what that lexer leaves
implicit is made explicit first, in one quote-aware scan:

- heredocs (``<<EOF`` / ``<<'EOF'`` / ``<<-EOF``) are cut out of the text, their bodies kept
  on the command (an unquoted delimiter's body is literal only without ``$``, backquotes
  and backslashes: otherwise it is marked as expanding);
- a file-descriptor number before a redirection (``2>``, ``2>&1``) becomes part of the
  redirection;
- anything whose meaning depends on the running shell marks the script as *not literal*:
  parameter expansion and command substitution outside single quotes (``$X``, ``$(..)``,
  backquotes), unquoted globs (``*``, ``?``, ``[``), a leading ``~``, comments, brace
  groups, subshells, background jobs and shell keywords.

A script that is not literal still parses (its structure is known), so that what it
*writes* can be recognised; the drafters never compute the output of a command that is
not literal. Parsing never raises: a line the lexer cannot follow gives None.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from aospec.shell import ShellSyntaxError, extract_substitutions, tokens

__all__ = ["Command", "Pipeline", "Redirect", "Script", "parse_script"]

_HEREDOC = re.compile(r"<<(-?)[ \t]*(?:'([^'\n]+)'|\"([^\"\n]+)\"|\\?([A-Za-z_][A-Za-z0-9_]*))")
_FD_WORD = "__aospec_fd{}__"
_FD_RE = re.compile(r"__aospec_fd(\d)__")
_HEREDOC_WORD = "__aospec_heredoc{}__"
_HEREDOC_RE = re.compile(r"__aospec_heredoc(\d+)__")
_KEYWORDS = frozenset(("if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac",
                       "function", "select", "{", "}", "!", "[[", "]]"))  # fmt: skip
_LIST_OPS = frozenset(("&&", "||", ";", "\n"))
#: One operator of a run of operator characters the lexer returns as one token (``&&\n``).
_OPERATOR = re.compile(r"&&|\|\||>>|>&|&>|<>|;;|[;|&<>()\n]")


@dataclass(frozen=True, slots=True)
class Redirect:
    """``fd`` redirected: ``op`` is ``>``, ``>>``, ``<`` or ``>&`` (to ``target`` fd) ."""

    fd: int
    op: str
    target: str


@dataclass(frozen=True, slots=True)
class Command:
    """One simple command: its words, redirections and heredoc body (None: none;
    ``heredoc_literal`` False: the body expands ``$``/backquotes, so its text is unknown)."""

    words: tuple[str, ...]
    redirects: tuple[Redirect, ...] = ()
    heredoc: str | None = None
    heredoc_literal: bool = True


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Commands joined by ``|`` (one command is a pipeline of one)."""

    commands: tuple[Command, ...]


@dataclass(frozen=True, slots=True)
class Script:
    """``pipelines[0] ops[0] pipelines[1] ...``: ops are ``&&``, ``||`` or ``;`` (newlines
    read as ``;``). ``literal``: nothing in the text depends on the running shell (module
    doc); ``background``: some command ran with ``&`` (its output and effects are timing)."""

    pipelines: tuple[Pipeline, ...]
    ops: tuple[str, ...]
    literal: bool
    background: bool = False

    @property
    def commands(self) -> tuple[Command, ...]:
        return tuple(c for p in self.pipelines for c in p.commands)


def _scan(text: str) -> tuple[str, list[tuple[str, bool]], bool] | None:
    """(text with heredoc bodies cut and fd numbers made words, heredoc bodies with their
    literalness, whether the text is literal), or None when quotes do not balance."""
    out: list[str] = []
    bodies: list[tuple[str, bool]] = []
    pending: list[tuple[str, bool, bool]] = []  # (delimiter, strip tabs, quoted)
    literal = True
    i, n = 0, len(text)
    quote = ""
    at_word_start = True
    while i < n:
        c = text[i]
        if quote == "'":
            out.append(c)
            if c == "'":
                quote = ""
            i += 1
            continue
        if quote == '"':
            if c == "\\" and i + 1 < n:
                out.append(text[i : i + 2])
                i += 2
                continue
            if c in "$`":
                literal = False
            elif c == '"':
                quote = ""
            out.append(c)
            i += 1
            continue
        if c == "\\":
            if i + 1 < n and text[i + 1] == "\n":
                i += 2  # a line continuation
                continue
            out.append(text[i : i + 2])
            i += 2
            at_word_start = False
            continue
        if c in "'\"":
            quote = c
            out.append(c)
            i += 1
            at_word_start = False
            continue
        if c == "\n" and pending:
            # the bodies of the heredocs opened on this line follow it
            out.append("\n")
            i += 1
            for delim, strip, quoted in pending:
                body: list[str] = []
                while True:
                    if i >= n:
                        return None  # an unterminated heredoc
                    j = text.find("\n", i)
                    line = text[i:] if j < 0 else text[i:j]
                    i = n if j < 0 else j + 1
                    check = line.lstrip("\t") if strip else line
                    if check == delim:
                        break
                    body.append(check if strip else line)
                content = "".join(x + "\n" for x in body)
                bodies.append((content, quoted or not any(ch in content for ch in "$`\\")))
            pending = []
            at_word_start = True
            continue
        if c == "<" and text.startswith("<<", i) and not text.startswith("<<<", i):
            m = _HEREDOC.match(text, i)
            if m is None:
                return None
            delim = m.group(2) or m.group(3) or m.group(4)
            quoted = m.group(4) is None or text[m.start() : m.end()].find("\\") >= 0
            pending.append((delim, bool(m.group(1)), quoted))
            out.append(f" < {_HEREDOC_WORD.format(len(bodies) + len(pending) - 1)} ")
            i = m.end()
            at_word_start = True
            continue
        if c.isdigit() and at_word_start and i + 1 < n and text[i + 1] in "<>":
            out.append(f" {_FD_WORD.format(c)} ")
            i += 1
            continue
        if c in "$`" or c in "*?[" or (c == "~" and at_word_start) or (c == "#" and at_word_start) or c in "(){}":
            literal = False
        out.append(c)
        at_word_start = c in " \t\n;&|()<>"
        i += 1
    if quote or pending:
        return None
    return "".join(out), bodies, literal


@functools.lru_cache(maxsize=1 << 13)
def parse_script(command: str) -> Script | None:
    """The structure of ``command`` (module doc); None when it cannot be followed (unbalanced
    quotes, an unterminated heredoc, an operator the parser does not model)."""
    scanned = _scan(command)
    if scanned is None:
        return None
    text, bodies, literal = scanned
    try:
        if "$(" in text or "`" in text or "<(" in text or ">(" in text:
            text = extract_substitutions(text, [])  # each becomes one word (never literal)
        toks = [(t, True) if op else (t, False) for tok, op in tokens(text) for t in (_OPERATOR.findall(tok) if op else [tok])]
    except ShellSyntaxError:
        return None
    pipelines: list[Pipeline] = []
    ops: list[str] = []
    commands: list[Command] = []
    words: list[str] = []
    redirects: list[Redirect] = []
    heredoc: tuple[str, bool] | None = None
    background = False
    fd: int | None = None
    k = 0

    def end_command() -> bool:
        nonlocal words, redirects, heredoc
        if not words and not redirects and heredoc is None:
            return False
        body, body_literal = heredoc if heredoc is not None else (None, True)
        commands.append(Command(tuple(words), tuple(redirects), body, body_literal))
        words, redirects, heredoc = [], [], None
        return True

    def end_pipeline() -> bool:
        nonlocal commands
        if not commands:
            return False
        pipelines.append(Pipeline(tuple(commands)))
        commands = []
        return True

    while k < len(toks):
        tok, is_op = toks[k]
        k += 1
        if not is_op:
            m = _FD_RE.fullmatch(tok)
            if m is not None:
                fd = int(m.group(1))
                continue
            if tok in _KEYWORDS and not words:
                literal = False
            words.append(tok)
            continue
        if tok in ("<", ">", ">>", ">&", "&>", "<>"):
            if k >= len(toks) or toks[k][1]:
                return None
            target = toks[k][0]
            k += 1
            if tok == "<" and (m := _HEREDOC_RE.fullmatch(target)) is not None:
                heredoc = bodies[int(m.group(1))]
                fd = None
                continue
            if tok == "&>":
                redirects += [Redirect(1, ">", target), Redirect(2, ">&", "1")]
            elif tok == ">&":
                redirects.append(Redirect(1 if fd is None else fd, ">&", target))
            elif tok == "<>":
                return None
            else:
                redirects.append(Redirect((0 if tok == "<" else 1) if fd is None else fd, tok, target))
            fd = None
            continue
        if tok == "|":
            if not end_command():
                return None
            continue
        if tok == "&":
            background = True
            literal = False
            tok = ";"
        if tok in _LIST_OPS:
            had_command = end_command()
            if not end_pipeline():
                if had_command or tok == "\n" or tok == ";":
                    continue
                return None
            ops.append(";" if tok == "\n" else tok)
            continue
        return None  # (, ), ;;, <<< and other operators
    end_command()
    end_pipeline()
    while ops and len(ops) >= len(pipelines):
        ops.pop()  # a trailing ; or newline
    if not pipelines or len(ops) != len(pipelines) - 1:
        return None
    return Script(tuple(pipelines), tuple(ops), literal, background)
