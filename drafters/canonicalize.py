"""Optional canonicalisation of inconsequential observation fields, for draft acceptance.

Off by default. With ``EngineConfig(accept="canonical")`` a drafted observation is
*accepted* if it equals the real one after replacing process ids, temporary file names
and/or timestamps by placeholders; what the actor finally sees (the committed history) is
always the real observation, never the draft or the canonical form. Accepting such a draft
is an approximation the user opts into: the continuation decoded on the draft saw
different bytes, so the run stays lossless only if the actor's next action does not
depend on the canonicalised fields (docs/engine.md).

Fields: ``pids`` (``pid 123``, ``PID: 123``, job lines ``[1] 12345``), ``temp_names``
(``/tmp/tmpab12_x9q``, ``tmp.Xy12AbC9zQ``), ``times`` (ISO 8601 and ``HH:MM:SS`` times,
``ls -l`` dates), ``durations`` (``0.53s``, ``12 ms``, ``real 0m1.2s``; not in the default set).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from aospec.errors import ConfigError

__all__ = ["DEFAULT_FIELDS", "FIELDS", "Canonicalizer", "all_fields", "canonicalizer"]

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"

_RULES: dict[str, tuple[tuple[re.Pattern[str], str], ...]] = {
    "pids": (
        (re.compile(r"(?im)\b(pid|process)(\s*[:=#]?\s*)\d+\b"), r"\1\2<PID>"),
        (re.compile(r"(?m)^(\[\d+\][+-]?\s+)\d+\s*$"), r"\1<PID>"),
    ),
    "temp_names": (
        (re.compile(r"\btmp[a-z0-9_]{8}\b"), "<TMP>"),
        (re.compile(r"\btmp\.[A-Za-z0-9]{10}\b"), "<TMP>"),
    ),
    "times": (
        (re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"), "<TIME>"),
        (re.compile(rf"\b{_MONTH}\s+\d{{1,2}}\s+(?:\d{{1,2}}:\d{{2}}|\d{{4}})\b"), "<TIME>"),
        (re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b"), "<TIME>"),
    ),
    "durations": (
        (re.compile(r"\b\d+m\d+(?:\.\d+)?s\b"), "<DUR>"),
        (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|s|sec|secs|seconds)\b"), "<DUR>"),
    ),
}

FIELDS = tuple(_RULES)
DEFAULT_FIELDS = ("pids", "temp_names", "times")


class Canonicalizer:
    """Replaces the chosen inconsequential fields by placeholders."""

    def __init__(self, fields: Sequence[str] = DEFAULT_FIELDS) -> None:
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ConfigError(f"unknown canonicalisation field(s) {unknown}; known: {', '.join(FIELDS)}")
        if not fields:
            raise ConfigError("a canonicaliser needs at least one field (or leave canonicalisation off)")
        self.fields = tuple(f for f in FIELDS if f in fields)
        self._rules = tuple(rule for f in self.fields for rule in _RULES[f])

    def canonical(self, text: str) -> str:
        """``text`` with every chosen field replaced by its placeholder."""
        for pattern, repl in self._rules:
            text = pattern.sub(repl, text)
        return text

    def equivalent(self, draft: str, real: str) -> bool:
        """Whether ``draft`` may be accepted for ``real``: byte-identical, or equal once
        canonicalised."""
        return draft == real or self.canonical(draft) == self.canonical(real)

    def __repr__(self) -> str:
        return f"Canonicalizer({list(self.fields)!r})"


def all_fields() -> Canonicalizer:
    """A Canonicalizer of every field, durations included."""
    return Canonicalizer(FIELDS)


def canonicalizer(spec: bool | str | Sequence[str] | None) -> Canonicalizer | None:
    """A Canonicalizer from a config value: None/False/"off" -> None (exact acceptance),
    True/"on"/"default" -> the default fields, "all" -> every field, "pids,times" (or
    "pids+times", usable inside a replay policy spec) or a list -> those fields."""
    if spec is None or spec is False or spec in ("", "off", "none"):
        return None
    if spec is True or spec in ("on", "default"):
        return Canonicalizer()
    if spec == "all":
        return all_fields()
    if isinstance(spec, str):
        return Canonicalizer([f.strip() for f in re.split(r"[,+]", spec) if f.strip()])
    return Canonicalizer(list(spec))
