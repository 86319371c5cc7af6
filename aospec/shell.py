"""The shell lexer: command substitutions, quote-aware tokens and simple commands.

:func:`extract_substitutions` replaces each command substitution of a command line by a
placeholder word and collects the substituted commands; :func:`tokens` splits what is left
into words (unquoted) and operators; :func:`simple_commands` groups the tokens into simple
commands with their redirections. The lexer is strict: whatever it cannot follow
(unbalanced quotes, a heredoc body, escapes inside backticks) raises
:class:`ShellSyntaxError`, so a caller that must be sound (the effect rules in
:mod:`aospec.effects`) can refuse it.

:func:`first_line`, :func:`loose_segments` and :func:`loose_words` are the tolerant
whitespace split of a command's first line that the drafters' command features use
(drafters/_shell.py): they never fail, which features need (about one first line in eight
of the tb1 traces has an unbalanced quote, e.g. ``python -c "`` followed by a script), and
the drafters' learned contexts are keyed by them.

:func:`program_label` is a command's routing label (the program that does the work, past
``cd DIR &&``-style prefixes); :func:`streamed_program_label` is the same rule on a command
that is still streaming: the label once no more text can change it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = [
    "FD_MARK",
    "SETUP_PROGRAMS",
    "SUBSTITUTION",
    "ShellSyntaxError",
    "SimpleCommand",
    "extract_substitutions",
    "first_line",
    "redirection",
    "loose_segments",
    "loose_words",
    "program_label",
    "simple_commands",
    "streamed_program_label",
    "tokens",
]


class ShellSyntaxError(ValueError):
    """The lexer cannot follow the command line."""


# ---------------------------------------------------------------- substitutions

#: The word that stands for a command substitution in :func:`extract_substitutions`'s output.
SUBSTITUTION = "__aospec_subst__"
#: The word that stands for a file-descriptor number before a redirection (``2>``).
FD_MARK = "__aospec_fd__"
_FD = re.compile(r"\d+(?=[<>])")
_WORD_START = frozenset(" \t\r\n;&|()<>")
#: What extract_substitutions copies as it is: no quote, substitution, redirection or
#: file-descriptor number starts in it (escape pairs included, so a word of any length is
#: one match, not a loop iteration per character).
_PLAIN = re.compile(r"""(?:[^\\'"`$<>\d]++|\\[^\n]|\$(?![({])|(?<=[^ \t\r\n;&|()<>])\d++)*+""")
_PAREN_PLAIN = re.compile(r"""(?:[^\\'"`()]++|\\.)*+""", re.DOTALL)
_DOUBLE_PLAIN = re.compile(r"""(?:[^\\"`$]++|\\.|\$(?!\())*+""", re.DOTALL)


def _match_paren(s: str, i: int) -> int:
    """Index of the ``)`` closing the ``(`` at ``s[i-1]``, quote- and nesting-aware."""
    depth = 1
    n = len(s)
    while i < n:
        i = _PAREN_PLAIN.match(s, i).end()  # type: ignore[union-attr]  # matches the empty string
        if i >= n:
            break
        c = s[i]
        if c == "\\":
            i += 2
        elif c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                raise ShellSyntaxError("unbalanced quotes or parentheses")
            i = j + 1
        elif c == '"':
            i = _skip_double(s, i + 1)
        elif c == "`":
            i = _match_backtick(s, i + 1) + 1
        else:
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return i
            i += 1
    raise ShellSyntaxError("unbalanced quotes or parentheses")


def _match_backtick(s: str, i: int) -> int:
    j = s.find("`", i)
    if s.find("\\", i, j if j >= 0 else len(s)) >= 0:
        raise ShellSyntaxError("an escape inside backticks")  # its meaning depends on nesting; not modelled
    if j < 0:
        raise ShellSyntaxError("unbalanced quotes or parentheses")
    return j


def _skip_double(s: str, i: int) -> int:
    """Index just after the double-quoted string whose opening quote is at ``s[i-1]``."""
    n = len(s)
    while i < n:
        i = _DOUBLE_PLAIN.match(s, i).end()  # type: ignore[union-attr]  # matches the empty string
        if i >= n:
            break
        c = s[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        elif c == "`":
            i = _match_backtick(s, i + 1) + 1
        elif c == "$" and s.startswith("$(", i):
            i = _match_paren(s, i + 2) + 1
        else:
            i += 1
    raise ShellSyntaxError("unbalanced quotes or parentheses")


def extract_substitutions(s: str, subs: list[str]) -> str:
    """``s`` with every command substitution (``$(...)``, backticks, ``<(...)``, ``>(...)``)
    replaced by the word :data:`SUBSTITUTION` and every file-descriptor number before a
    redirection by :data:`FD_MARK`; arithmetic ``$((...))`` becomes ``0``. The substituted
    commands are appended to ``subs``. Raises ShellSyntaxError on anything it cannot follow."""
    out: list[str] = []
    i = 0
    n = len(s)
    in_double = False
    while i < n:
        j = _PLAIN.match(s, i).end()  # type: ignore[union-attr]  # matches the empty string
        if j > i:
            out.append(s[i:j])
            i = j
            if i >= n:
                break
        c = s[i]
        if c == "\\":
            if s.startswith("\n", i + 1):
                i += 2  # line continuation: bash removes it
                continue
            out.append(s[i : i + 2])
            i += 2
        elif c == "'" and not in_double:
            j = s.find("'", i + 1)
            if j < 0:
                raise ShellSyntaxError("unbalanced quotes or parentheses")
            out.append(s[i : j + 1])
            i = j + 1
        elif c == '"':
            in_double = not in_double
            out.append(c)
            i += 1
        elif c == "`":
            j = _match_backtick(s, i + 1)
            subs.append(s[i + 1 : j])
            out.append(SUBSTITUTION)
            i = j + 1
        elif c == "$" and s.startswith("$((", i):
            j = _match_paren(s, i + 2)  # the outer ")" of "$(( ... ))"
            inner = s[i + 3 : j]
            if "$(" in inner or "`" in inner or s[j - 1] != ")":
                raise ShellSyntaxError("a substitution inside arithmetic expansion")
            out.append("0")
            i = j + 1
        elif (c == "$" or (c in "<>" and not in_double)) and s.startswith("(", i + 1):
            j = _match_paren(s, i + 2)
            subs.append(s[i + 2 : j])
            out.append(SUBSTITUTION)
            i = j + 1
        elif c == "$" and s.startswith("${", i):
            j = s.find("}", i)
            if j < 0 or "$(" in s[i:j] or "`" in s[i:j]:
                raise ShellSyntaxError("an unclosed or substituting parameter expansion")
            out.append(s[i : j + 1])
            i = j + 1
        elif c == "<" and not in_double and s.startswith("<<", i):
            if not s.startswith("<<<", i):
                raise ShellSyntaxError("a heredoc (its body is not lexed)")
            out.append("<<<")  # a here-string only feeds stdin
            i += 3
        elif c.isdigit() and not in_double and (i == 0 or s[i - 1] in _WORD_START) and (fd := _FD.match(s, i)):
            out.append(f" {FD_MARK} ")  # "2>": a file descriptor number, not an argument
            i = fd.end()
        else:
            out.append(c)
            i += 1
    if in_double:
        raise ShellSyntaxError("an unclosed double quote")
    return "".join(out)


# ---------------------------------------------------------------- tokens and simple commands

_PUNCT = "();<>|&\n"
_PUNCT_SET = frozenset(_PUNCT)
_SEPARATORS = frozenset(";&|()\n")


_RAW_TOKEN = re.compile(r"[ \t\r]*(?:([();<>|&\n]+)|(['\"])|([^ \t\r();<>|&\n'\"][^ \t\r();<>|&\n]*))?")
_DOUBLE_QUOTED = re.compile(r'"((?:[^"\\]++|\\.)*+)"', re.DOTALL)  # possessive: no backtracking
_UNQUOTED = re.compile(r"(?:[^'\"\\]++|\\.)++", re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_DOUBLE_ESCAPE = re.compile(r'\\(["\\])')


def _raw_tokens(s: str) -> Iterator[str]:
    """The tokens of the non-POSIX pass (blanks: space, tab, carriage return): a run of
    operator characters ``();<>|&`` and newlines; a quoted string up to its closing quote
    (nothing after it joins it); or a word up to a blank or an operator character (quotes
    inside it kept as they are). This is the structure stdlib ``shlex.shlex(s, posix=False,
    punctuation_chars=...)`` with ``whitespace_split`` gives, found by regular expressions:
    shlex grows each token a character at a time, quadratic in a word's length."""
    i, n = 0, len(s)
    while i < n:
        m = _RAW_TOKEN.match(s, i)
        assert m is not None  # the pattern matches the empty string
        if m.group(2) is not None:
            j = s.find(m.group(2), m.end())
            if j < 0:
                raise ShellSyntaxError("No closing quotation")
            yield s[m.start(2) : j + 1]
            i = j + 1
        elif m.group(1) is not None or m.group(3) is not None:
            yield m.group(1) if m.group(1) is not None else m.group(3)
            i = m.end()
        else:
            return  # only blanks were left


def _unquote(word: str) -> str:
    """A word as POSIX quoting reads it (what stdlib ``shlex.split(word, posix=True)`` gives,
    joined): ``'...'`` literally, ``"..."`` with only ``\\"`` and ``\\\\`` unescaped, and
    outside quotes a backslash escaping the next character. Linear in the word's length."""
    out: list[str] = []
    i, n = 0, len(word)
    while i < n:
        c = word[i]
        if c == "'":
            j = word.find("'", i + 1)
            if j < 0:
                raise ShellSyntaxError("No closing quotation")
            out.append(word[i + 1 : j])
            i = j + 1
            continue
        m = (_DOUBLE_QUOTED if c == '"' else _UNQUOTED).match(word, i)
        if m is None:
            raise ShellSyntaxError("No closing quotation" if c == '"' else "No escaped character")
        out.append(_drop_escapes(m.group(1), double=True) if c == '"' else _drop_escapes(m.group(), double=False))
        i = m.end()
    return "".join(out)


_MARK = "\uf8ff"  # a private-use character: stands for an escaped backslash meanwhile


def _drop_escapes(text: str, *, double: bool) -> str:
    """``text`` without its escaping backslashes: inside double quotes only those before
    ``"`` or ``\\``, outside quotes all. Backslashes pair up left to right, as
    ``str.replace`` replaces (a regular expression's template costs a Python call per
    match)."""
    if "\\" not in text:
        return text
    if _MARK in text:
        return (_DOUBLE_ESCAPE if double else _ESCAPE).sub(lambda m: m.group(1), text)
    text = text.replace("\\\\", _MARK)
    text = text.replace('\\"', '"') if double else text.replace("\\", "")
    return text.replace(_MARK, "\\")


def tokens(s: str) -> Iterator[tuple[str, bool]]:
    """(token, is_operator) pairs, lazily. Structure comes from a non-POSIX pass that keeps
    quotes on words (so a quoted ``'|'`` stays a word) and never joins an unquoted operator
    into a word; each word is then unquoted as POSIX quoting reads it (the two passes of
    stdlib shlex, in linear time: :func:`_raw_tokens`, :func:`_unquote`). Raises
    ShellSyntaxError on unbalanced quotes or a dangling escape."""
    for tok in _raw_tokens(s):
        if tok[0] in _PUNCT_SET:
            yield tok, True
        elif "'" in tok or '"' in tok or "\\" in tok:
            yield _unquote(tok), False
        else:
            yield tok, False


@dataclass(slots=True)
class SimpleCommand:
    """The words of one simple command and its redirections: (operator, target) pairs, the
    target ``(word, is_operator)`` or None when the line ends after the operator. An
    operator token may carry separators too (``;>``, ``)<``)."""

    words: list[str] = field(default_factory=list)
    redirects: list[tuple[str, tuple[str, bool] | None]] = field(default_factory=list)


def redirection(op: str) -> str:
    """The redirection part of an operator token (``;>`` -> ``>``, ``&>`` stays)."""
    return op.lstrip(";()|&\n") if op[0] in ";()|\n" else op


def simple_commands(toks: Iterator[tuple[str, bool]]) -> Iterator[SimpleCommand]:
    """Group :func:`tokens` into simple commands (split on ``;``, ``&&``, ``||``, ``|``, ``&``,
    newlines and parentheses), lazily: a caller that refuses a command stops the scan before
    the rest is tokenised. :data:`FD_MARK` words are dropped; a command with neither words
    nor redirections is not yielded."""
    cur = SimpleCommand()
    for tok, op in toks:
        if not op:
            if tok != FD_MARK:
                cur.words.append(tok)
            continue
        if "<" in tok or ">" in tok:
            cur.redirects.append((tok, next(toks, None)))
            if not any(c in _SEPARATORS for c in tok.rstrip("<>&|")):
                continue
        if cur.words or cur.redirects:
            yield cur
        cur = SimpleCommand()
    if cur.words or cur.redirects:
        yield cur


# ---------------------------------------------------------------- loose splitting (drafter features)

_LOOSE_SEGMENT = re.compile(r"\s*(?:&&|\|\||;|\||\n)\s*")


def first_line(command: str) -> str:
    """The command's first line (never a heredoc body)."""
    return command.split("\n", 1)[0]


def loose_segments(line: str) -> list[str]:
    """``line`` split on ``&&``, ``||``, ``;``, ``|`` and newlines, quotes ignored (never fails)."""
    return _LOOSE_SEGMENT.split(line)


def loose_words(segment: str) -> list[str]:
    """Whitespace-separated words of ``segment``, quotes kept (never fails)."""
    return segment.split()


# ---------------------------------------------------------------- program labels (routing)

#: Programs that only set up where or how the next command runs (directory, environment,
#: shell options, resource limits). Agents prefix most commands with one (``cd /app && ...``),
#: so a label skips them when another program follows.
SETUP_PROGRAMS = frozenset({"cd", "pushd", "popd", "export", "unset", "source", ".", "set", "shopt", "umask", "ulimit"})
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_NOT_PROGRAMS = frozenset({"{", "}", "!"})  # a brace group, a negated pipeline: the program follows
_WORD_END = frozenset(" \t\r\n;&|()<>")


def _first_program(words_of: Iterator[list[str]]) -> tuple[str | None, str | None]:
    """(first program, first program not in SETUP_PROGRAMS) of the simple commands' words,
    ``VAR=value``, ``{`` and ``!`` skipped; the second is None when every program is a setup one."""
    first: str | None = None
    for words in words_of:
        prog = next((w for w in words if w not in _NOT_PROGRAMS and not _ASSIGNMENT.match(w)), None)
        if prog is None:
            continue
        if prog not in SETUP_PROGRAMS:
            return first or prog, prog
        first = first or prog
    return first, None


@functools.lru_cache(maxsize=1024)  # a router session labels its whole history per decode
def program_label(command: str) -> str:
    """The routing label of a shell command line: the program of its first simple command
    (split on ``&&``, ``||``, ``;``, ``|``, ``&``, newlines and parentheses; ``VAR=value``
    and the ``{`` of a brace group skipped) that is not in :data:`SETUP_PROGRAMS`, else the first program (``cd /x`` is
    ``cd``). Quote-aware (:func:`tokens`); the loose split when the lexer cannot follow the
    line; ``bash`` when there is no word at all."""
    try:
        first, prog = _first_program(c.words for c in simple_commands(tokens(command)))
    except ShellSyntaxError:
        first, prog = _first_program(loose_words(seg) for seg in loose_segments(command))
    return prog or first or "bash"


def streamed_program_label(prefix: str, *, final: bool = False) -> str | None:
    """:func:`program_label` of a command line of which only ``prefix`` has streamed, or None
    while more text could still change it: a program counts once its word is complete (a
    blank or an operator follows, or the lexer stopped in a later token), and a setup
    program only when the line is ``final`` (the stream or the code block ended)."""
    if final:
        return program_label(prefix)
    toks: list[tuple[str, bool]] = []
    try:
        toks.extend(tokens(prefix))
    except ShellSyntaxError:
        pass  # a quote still open: the tokens before it are complete
    else:
        if toks and prefix[-1] not in _WORD_END:
            toks.pop()  # the last word may still grow
    return _first_program(c.words for c in simple_commands(iter(toks)))[1]
