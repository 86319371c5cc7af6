"""``sed -i SCRIPT`` applied to known text, for the commands GNU sed agents use to edit.

:func:`sed_edit` runs scripts of ``s/RE/REPL/FLAGS`` (flags ``g``, ``I``, a count of 1) and
``d`` commands, each optionally behind an address (a line number, ``$``, ``N,M``,
``/RE/``), separated by ``;`` or newlines. Basic (default) and extended (``-E``) regular
expressions are translated to Python's: groups, intervals, ``\\+``/``\\?`` (GNU), bracket
expressions with POSIX classes, ``\\w``/``\\s``/``\\b``/``\\<``/``\\>``, back-references.
Alternation (``|``) is refused: POSIX picks the longest match, Python the first. Anything
else gives None.
"""

from __future__ import annotations

import re

__all__ = ["sed_edit"]

_CLASSES = {
    "alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z", "lower": "a-z",
    "space": r" \t\n\r\f\v", "blank": r" \t", "punct": r"!-/:-@\[-`{-~", "xdigit": "0-9A-Fa-f",
}  # fmt: skip
_ESCAPES = {"w": r"\w", "W": r"\W", "s": r"\s", "S": r"\S", "b": r"\b", "B": r"\B", "<": r"\b", ">": r"\b",
            "n": r"\n", "t": r"\t", "`": r"\A", "'": r"\Z"}  # fmt: skip


class _Refused(Exception):
    pass


def _bracket(src: str, i: int) -> tuple[str, int]:
    """The bracket expression starting at ``src[i] == "["`` as a Python class; its end."""
    j = i + 1
    out = ["["]
    if j < len(src) and src[j] == "^":
        out.append("^")
        j += 1
    if j < len(src) and src[j] == "]":
        out.append(r"\]")
        j += 1
    while j < len(src):
        c = src[j]
        if c == "]":
            out.append("]")
            return "".join(out), j + 1
        if src.startswith("[:", j):
            k = src.find(":]", j)
            if k < 0 or src[j + 2 : k] not in _CLASSES:
                raise _Refused
            out.append(_CLASSES[src[j + 2 : k]])
            j = k + 2
            continue
        if src.startswith("[=", j) or src.startswith("[.", j):
            raise _Refused
        out.append("\\\\" if c == "\\" else ("\\[" if c == "[" else c))
        j += 1
    raise _Refused


def _regex(src: str, extended: bool) -> str:
    out: list[str] = []
    i = 0
    while i < len(src):
        c = src[i]
        if c == "\\":
            if i + 1 >= len(src):
                raise _Refused
            d = src[i + 1]
            i += 2
            if d == "|":
                raise _Refused
            if not extended and d in "(){}+?":
                out.append(d)
            elif d.isdigit():
                out.append("\\" + d)
            elif d in _ESCAPES:
                out.append(_ESCAPES[d])
            elif d.isalnum():
                raise _Refused
            else:
                out.append(re.escape(d))
            continue
        if c == "[":
            cls, i = _bracket(src, i)
            out.append(cls)
            continue
        if c == "|" and extended:
            raise _Refused
        if c in "(){}+?|" and not extended:
            out.append(re.escape(c))
        elif c == "*" and (not out or out[-1] in ("^", "(")):
            out.append(r"\*")
        else:
            out.append(c)
        i += 1
    pattern = "".join(out)
    try:
        re.compile(pattern)
    except re.error:
        raise _Refused from None
    return pattern


def _replacement(src: str) -> list[tuple[str, str | int]]:
    """``("text", s)`` and ``("group", n)`` pieces of a replacement (``&`` is group 0)."""
    out: list[tuple[str, str | int]] = []
    i = 0
    while i < len(src):
        c = src[i]
        if c == "\\" and i + 1 < len(src):
            d = src[i + 1]
            if d.isdigit():
                out.append(("group", int(d)))
            elif d == "n":
                out.append(("text", "\n"))
            elif d == "t":
                out.append(("text", "\t"))
            elif d in "ULElu":
                raise _Refused
            else:
                out.append(("text", d))
            i += 2
        elif c == "&":
            out.append(("group", 0))
            i += 1
        else:
            out.append(("text", c))
            i += 1
    return out


def _split(script: str, i: int, delim: str) -> tuple[str, int]:
    """The text up to the next unescaped ``delim`` from ``i`` (``\\delim`` unescaped); its end."""
    out = []
    while i < len(script):
        c = script[i]
        if c == "\\" and i + 1 < len(script):
            out.append(script[i + 1] if script[i + 1] == delim else script[i : i + 2])
            i += 2
            continue
        if c == delim:
            return "".join(out), i + 1
        if c == "\n":
            raise _Refused
        out.append(c)
        i += 1
    raise _Refused


def _commands(script: str, extended: bool) -> list[tuple[tuple[str, object] | None, str, object]]:
    cmds = []
    i = 0
    n = len(script)
    while i < n:
        while i < n and script[i] in " \t\n;":
            i += 1
        if i >= n:
            break
        address: tuple[str, object] | None = None
        m = re.compile(r"(\d+)(?:,(\d+|\$))?|\$").match(script, i)
        if m is not None and m.group(0):
            if m.group(0) == "$":
                address = ("last", None)
            elif m.group(2) is None:
                address = ("line", int(m.group(1)))
            else:
                end = m.group(2)
                address = ("range", (int(m.group(1)), None if end == "$" else int(end)))
            i = m.end()
        elif script[i] == "/":
            body, i = _split(script, i + 1, "/")
            address = ("regex", re.compile(_regex(body, extended)))
        while i < n and script[i] in " \t":
            i += 1
        if i >= n:
            raise _Refused
        c = script[i]
        if c == "d":
            cmds.append((address, "d", None))
            i += 1
        elif c == "s":
            if i + 1 >= n or script[i + 1] in "\\\n":
                raise _Refused
            delim = script[i + 1]
            pattern, i = _split(script, i + 2, delim)
            repl, i = _split(script, i, delim)
            flags = 0
            count = 1
            while i < n and script[i] not in ";\n}":
                f = script[i]
                if f == "g":
                    count = 0
                elif f in "iI":
                    flags |= re.IGNORECASE
                elif f == "1":
                    pass
                elif f not in " \t":
                    raise _Refused
                i += 1
            regex = re.compile(_regex(pattern, extended), flags) if pattern else None
            if regex is None:
                raise _Refused  # the empty regex repeats the last one used
            cmds.append((address, "s", (regex, _replacement(repl), count)))
        else:
            raise _Refused
        while i < n and script[i] in " \t":
            i += 1
        if i < n and script[i] not in ";\n":
            raise _Refused
    return cmds


def _matches(address: tuple[str, object] | None, number: int, last: bool, line: str) -> bool:
    if address is None:
        return True
    kind, value = address
    if kind == "line":
        return number == value
    if kind == "last":
        return last
    if kind == "range":
        first, end = value  # type: ignore[misc]
        return number >= first and (end is None or number <= end)
    return value.search(line) is not None  # type: ignore[attr-defined]


def sed_edit(script: str, text: str, *, extended: bool = False) -> str | None:
    """``text`` after ``sed -i script`` (module doc), or None when the script is refused."""
    try:
        cmds = _commands(script, extended)
    except (_Refused, re.error, RecursionError):
        return None
    if not cmds:
        return None
    trailing = text.endswith("\n")
    lines = text.split("\n")
    if trailing:
        lines.pop()
    out = []
    for k, line in enumerate(lines, 1):
        last = k == len(lines)
        deleted = False
        for address, name, arg in cmds:
            if not _matches(address, k, last, line):
                continue
            if name == "d":
                deleted = True
                break
            regex, pieces, count = arg  # type: ignore[misc]

            def fill(m: re.Match[str], pieces=pieces) -> str:
                parts = []
                for kind, v in pieces:
                    if kind == "text":
                        parts.append(v)
                    else:
                        try:
                            parts.append(m.group(v) or "")  # type: ignore[arg-type]
                        except IndexError:
                            raise _Refused from None
                return "".join(parts)

            try:
                line = regex.sub(fill, line, count=count)
            except _Refused:
                return None
            if "\n" in line:
                return None  # later commands would see several lines in the pattern space
        if not deleted:
            out.append(line)
    if not out:
        return ""
    return "\n".join(out) + ("\n" if trailing else "")
