"""TrajectoryDrafter: exact outputs of deterministic commands, from the filesystem view
the trajectory implies.

The drafter keeps, per trajectory (folded incrementally over the history's turns), a
:class:`FileView`: what the history says about the filesystem and the environment.

- **Writes** it can follow exactly: heredocs (``cat <<'EOF' > f``), ``echo``/``printf``
  redirected to a file, ``tee``, ``cp``, ``mv``, ``mkdir``, ``touch``, ``rm``, ``chmod`` and
  ``sed -i`` (``s///``, ``d``) on content it knows; any command's stdout sent to a file by a
  modelled command (``cat a b > c``).
- **Reads** whose output it saw: ``cat f`` (the whole file), ``head``/``sed -n`` (some of
  its lines), ``pwd`` (the working directory), ``python -c "print(EXPR)"`` (the value of an
  expression, e.g. ``mteb.__version__``).
- **Everything else** that may write (by :func:`aospec.effects.classify_action`) makes
  everything known *stale*: still the best guess, but less sure (a ``python train.py`` may
  have rewritten any file).

For the action in flight it computes the output of commands whose result follows from the
view alone: ``cat``/``head``/``tail``/``wc``/``grep``/``sed -n``/``diff``/``cmp`` of known
content, ``test``/``[``, ``ls FILE``, ``echo``/``printf``/``pwd``/``basename``/``dirname``,
the writes above (silent on success), lists and pipelines of these (``&&``, ``||``, ``;``,
``|``, ``2>&1``, ``2>/dev/null``), and ``python -c`` programs that only import, assign
literals and print literals, f-strings and remembered values (:mod:`aospec.drafters._pyeval`).
A re-run of a command whose last output was seen, with nothing it names written since, is
drafted as that output. It **abstains** whenever anything is unknown: an unmodelled
program, a file it has not seen, shell expansions (``$X``, globs, substitutions), output
interleaving it cannot order, lines longer than the terminal may keep (``max_line_chars``),
an observation format it does not know.

The draft is rendered in the harness's observation format: mini-swe-agent's
``<returncode>N</returncode>\\n<output>\\n...</output>`` (:class:`aospec.runtime.observation.MiniSweAgentFormatter`,
long outputs included), recognised from the trajectory's own observations (or, before the
first one, from the training traces).

**Probabilities.** Every draft names the rule that made it (``rule``: ``pure`` for
commands that read nothing, ``file`` for file content, ``python``, ``python-import`` for
programs that import a non-standard-library module, ``value`` for remembered values,
``rerun``) and whether what it read is ``fresh`` or ``stale``. :meth:`TrajectoryDrafter.fit`
replays the drafter over the training traces' true histories and counts, per rule and
freshness, how often the draft was byte-identical: the probability is that Beta(1, 1)
posterior mean, backed off (Witten-Bell) to the freshness's pooled rate where a rule was
seldom seen. The counts are :attr:`TrajectoryDrafter.rule_counts`.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import re
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from aospec.drafters._pyeval import python_output, remembered_values
from aospec.drafters._script import Command, Pipeline, Script, parse_script
from aospec.drafters._sed import sed_edit
from aospec.drafters._shell import HistoryIndex
from aospec.runtime.observation import CommandResult, MiniSweAgentFormatter

from aospec.effects import classify_command
from aospec.protocols import ObservationDraft
from aospec.types import Action, Effect, History, Trace, Turn

__all__ = ["FileView", "TrajectoryDrafter", "parse_observation", "written_paths"]

#: mini-swe-agent's observation of a finished command (tb1, the runtime's ``mini-swe-agent`` formatter).
_MINI = re.compile(r"\A<returncode>(-?\d+)</returncode>\n<output>\n(.*)</output>\Z", re.DOTALL)
_MINI_ANY = re.compile(r"\A(?:<returncode>-?\d+</returncode>\n<(?:output|warning)>|The last command <command>)")
#: The unknown working directory: relative paths resolve below it until a ``pwd`` names it.
_CWD = "\x01cwd"


def parse_observation(text: str) -> tuple[int, str] | None:
    """(returncode, output) of a mini-swe-agent observation of a finished command, else None."""
    m = _MINI.match(text)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True, slots=True)
class _Entry:
    """What the view knows of one path: a ``file`` (``text`` its whole content, or None;
    ``lines`` some of its lines by number when the text is not known), a ``dir`` or
    ``absent``. ``epoch``: the view's epoch when it was last confirmed."""

    kind: str
    text: str | None = None
    lines: Mapping[int, str] = field(default_factory=dict)
    epoch: int = 0


@dataclass
class FileView:
    """The filesystem and environment a trajectory's history implies (module doc).

    ``entries`` maps normalised paths (absolute, or below the unknown working directory)
    to what is known of them; ``epoch`` counts steps that may have written anything
    (entries confirmed before the current epoch are stale); ``values`` maps Python
    expressions to what printing them showed; ``last_run`` maps an action key to the step
    and observation of its last run; ``written`` maps a path to the last step that wrote it.
    """

    entries: dict[str, _Entry] = field(default_factory=dict)
    cwd: str | None = None
    epoch: int = 0
    values: dict[str, tuple[str, int]] = field(default_factory=dict)
    last_run: dict[str, tuple[int, str, int]] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)
    last_write: int = -1
    steps: int = 0
    format_known: bool | None = None

    def resolve(self, path: str, cwd: str | None = None) -> str | None:
        """The view's key for ``path`` (None for an empty path or one above the unknown cwd)."""
        if not path or "\x00" in path:
            return None
        base = cwd if cwd is not None else (self.cwd or _CWD)
        full = posixpath.normpath(path if path.startswith("/") else f"{base}/{path}")
        if full.startswith("//"):
            full = full[1:]
        if not path.startswith("/") and base.startswith(_CWD) and not full.startswith(_CWD):
            return None
        return full

    def aliases(self, key: str) -> list[str]:
        """Keys that may name the same file as ``key`` while the working directory is unknown."""
        if self.cwd is not None:
            return []
        if key.startswith(_CWD):
            suffix = key[len(_CWD) :]
            return [k for k in self.entries if not k.startswith(_CWD) and k.endswith(suffix)]
        return [k for k in self.entries if k.startswith(_CWD) and key.endswith(k[len(_CWD) :])]


class _Unknown(Exception):
    """The outcome cannot be computed from the view."""


@dataclass(slots=True)
class _Result:
    rc: int
    out: str = ""
    err: str = ""


class _Run:
    """One evaluation of a script against the view, its writes kept in an overlay."""

    def __init__(self, view: FileView, *, apply: bool = False) -> None:
        self.view = view
        self.overlay: dict[str, _Entry | None] = {}
        self.cwd: str | None = view.cwd
        self.stale = False
        self.rules: set[str] = set()
        self.apply = apply  # effects only: unknown outcomes drop what they may have written
        self.written: list[str] = []
        self.unmodelled_write = False
        self.final_rc: int | None = None  # effects mode: the step's return code, when known
        self.unknown_flow = False  # effects mode: which commands ran is no longer known
        self.moved = False  # a cd moved this run's shell: a later "..", through a link, is not the logical parent

    # ---------------------------------------------------------------- the view, overlaid

    def key(self, path: str) -> str:
        if self.moved and _has_dotdot(path):
            raise _Unknown
        k = self.view.resolve(path, self.cwd)
        if k is None:
            raise _Unknown
        return k

    def get(self, path: str) -> _Entry | None:
        k = self.key(path)
        if k in self.overlay:
            return self.overlay[k]
        return self.view.entries.get(k)

    def read(self, path: str) -> _Entry:
        """The entry of ``path``; _Unknown when nothing is known of it."""
        e = self.get(path)
        if e is None:
            raise _Unknown
        if e.epoch < self.view.epoch:
            self.stale = True
        return e

    def text(self, path: str) -> str | None:
        """Content of the file ``path`` (None: it does not exist); _Unknown if unknown."""
        e = self.read(path)
        if e.kind == "absent":
            return None
        if e.kind != "file" or e.text is None:
            raise _Unknown
        self.rules.add("file")
        return e.text

    def put(self, path: str, entry: _Entry | None) -> None:
        """Record ``entry`` for ``path`` (None: unknown); aliases become unknown, and so
        does everything once it is not known which commands of the step ran."""
        k = self.key(path)
        self.overlay[k] = None if self.unknown_flow else entry
        for a in self.view.aliases(k):
            self.overlay[a] = None
        self.written.append(k)

    def forget_below(self, path: str) -> None:
        k = self.key(path)
        for other in list(self.view.entries) + list(self.overlay):
            if other.startswith(k + "/"):
                self.overlay[other] = None
                self.written.append(other)  # (a re-run that names it must not count as fresh)
        self.put(path, None)

    def file(self, text: str) -> _Entry:
        return _Entry("file", text, {}, self.view.epoch)

    # ---------------------------------------------------------------- scripts

    def script(self, script: Script, final_rc: int | None = None) -> _Result:
        out: list[str] = []
        rc = 0
        run = True
        for k, pipeline in enumerate(script.pipelines):
            if k:
                op = script.ops[k - 1]
                run = op == ";" or (op == "&&" and rc == 0) or (op == "||" and rc != 0)
            if not run:
                continue
            r = self.pipeline(pipeline, final_rc if k == len(script.pipelines) - 1 else None, script, k)
            out.append(r.out)
            rc = r.rc
        return _Result(rc, "".join(out))

    def pipeline(self, pipeline: Pipeline, final_rc: int | None, script: Script, index: int) -> _Result:
        stdin: str | None = ""
        errs: list[str] = []
        r = _Result(0)
        for cmd in pipeline.commands:
            try:
                r = self.command(cmd, stdin)
            except _Unknown:
                if not self.apply:
                    raise
                r = self.unknown(cmd, final_rc, script, index)
            errs.append(r.err)
            stdin = r.out
        if (any(errs[:-1]) or (errs[-1] and r.out)) and not self.apply:
            raise _Unknown  # several streams: their interleaving is not known
        return _Result(r.rc, r.out + "".join(errs))

    def unknown(self, cmd: Command, final_rc: int | None, script: Script, index: int) -> _Result:
        """Effects mode: a command whose outcome is unknown. What it may write is dropped;
        its return code is taken from the step when the rest of the list cannot change it."""
        for redir in cmd.redirects:
            if redir.op in (">", ">>") and redir.target != "/dev/null":
                with contextlib.suppress(_Unknown):
                    self.put(redir.target, None)
        if cmd.words and classify_command(_join(cmd.words)) is Effect.MAY_CHANGE:
            self.unmodelled_write = True
        rest = script.ops[index:]
        if final_rc is not None:
            return _Result(final_rc)
        if all(op == "&&" for op in rest) and self.final_rc == 0:
            return _Result(0)
        self.unknown_flow = True
        return _Result(0 if all(op == "&&" for op in rest) else 1)

    # ---------------------------------------------------------------- one command

    def command(self, cmd: Command, stdin: str | None) -> _Result:
        words = list(cmd.words)
        if cmd.heredoc is not None:
            if not cmd.heredoc_literal:
                raise _Unknown
            stdin = cmd.heredoc
        out_target: tuple[str, bool] | None = None
        err_mode = "err"  # err, out (2>&1), null
        out_null = False
        for redir in cmd.redirects:
            if redir.fd == 0 and redir.op == "<":
                t = self.text(redir.target)
                if t is None:
                    raise _Unknown  # the shell's own message: sh and bash word it differently
                stdin = t
            elif redir.fd == 1 and redir.op in (">", ">>"):
                if err_mode == "out":
                    raise _Unknown  # `2>&1 > f`: stderr to the terminal, stdout to the file
                if redir.target == "/dev/null":
                    out_null = True
                else:
                    out_target = (redir.target, redir.op == ">>")
            elif redir.fd == 2 and redir.op == ">" and redir.target == "/dev/null":
                err_mode = "null"
            elif redir.fd == 2 and redir.op == ">&" and redir.target == "1":
                if out_target is not None or out_null:
                    raise _Unknown  # stderr goes where stdout went: to a file
                err_mode = "out"
            elif redir.fd == 1 and redir.op == ">&" and redir.target == "2":
                raise _Unknown
            else:
                raise _Unknown
        r = _Result(0) if not words else self.simple(words, stdin if stdin is not None else "")
        if err_mode == "out":
            if r.out and r.err:
                raise _Unknown
            r = _Result(r.rc, r.out + r.err)
        elif err_mode == "null":
            r = _Result(r.rc, r.out)
        if out_null:
            r = _Result(r.rc, "", r.err)
        elif out_target is not None:
            path, append = out_target
            old = ""
            if append:
                e = self.get(path)
                if e is not None and e.kind == "absent":
                    e = self.file("")
                if e is None or e.kind != "file" or e.text is None:
                    if self.apply:
                        self.put(path, None)
                        return _Result(r.rc, "", r.err)
                    raise _Unknown
                old = e.text
            e = self.get(path)
            if e is not None and e.kind == "dir":
                raise _Unknown
            self.put(path, self.file(old + r.out))
            r = _Result(r.rc, "", r.err)
        return r

    def simple(self, words: list[str], stdin: str) -> _Result:
        name = words[0]
        if "=" in name and not name.startswith("="):
            raise _Unknown  # VAR=value prefixes change the environment
        handler = _PROGRAMS.get(posixpath.basename(name) if name.startswith(("/bin/", "/usr/bin/")) else name)
        if handler is None:
            raise _Unknown
        return handler(self, words[1:], stdin)


def _join(words: Sequence[str]) -> str:
    import shlex

    return " ".join(shlex.quote(w) for w in words)


# -------------------------------------------------------------------- programs

def _flags(args: list[str], allowed: str, with_value: str = "") -> tuple[set[str], dict[str, str], list[str]]:
    """(short flags, option values, operands) of ``args``; _Unknown on any other option."""
    flags: set[str] = set()
    values: dict[str, str] = {}
    operands: list[str] = []
    k = 0
    only_operands = False
    while k < len(args):
        a = args[k]
        k += 1
        if only_operands or a == "-" or not a.startswith("-"):
            operands.append(a)
            continue
        if a == "--":
            only_operands = True
            continue
        if a.startswith("--"):
            raise _Unknown
        for j, ch in enumerate(a[1:], 1):
            if ch in with_value:
                rest = a[j + 1 :]
                if not rest:
                    if k >= len(args):
                        raise _Unknown
                    rest = args[k]
                    k += 1
                values[ch] = rest
                break
            if ch not in allowed:
                raise _Unknown
            flags.add(ch)
    return flags, values, operands


def _lines(text: str) -> list[str]:
    """Lines of ``text`` with their newlines (the last one may lack it)."""
    return text.splitlines(keepends=True)


def _count(value: str) -> int:
    if not value.isdigit():
        raise _Unknown
    return int(value)


def _numeric_option(args: list[str]) -> list[str]:
    """``head -5`` / ``tail -5`` as ``-n5``."""
    return [f"-n{a[1:]}" if re.fullmatch(r"-\d+", a) else a for a in args]


def _inputs(run: _Run, operands: list[str], stdin: str, program: str) -> list[tuple[str, str | None]]:
    if not operands:
        return [("-", stdin)]
    out = []
    for op in operands:
        out.append((op, stdin if op == "-" else run.text(op)))
    return out


def _missing(program: str, path: str) -> str:
    return f"{program}: {path}: No such file or directory\n"


def _cat(run: _Run, args: list[str], stdin: str) -> _Result:
    _, _, operands = _flags(args, "")
    out, err, rc = [], [], 0
    for name, text in _inputs(run, operands, stdin, "cat"):
        if text is None:
            err.append(_missing("cat", name))
            rc = 1
        else:
            out.append(text)
    if out and err:
        raise _Unknown
    return _Result(rc, "".join(out), "".join(err))


def _head_tail(tail: bool):
    def program(run: _Run, args: list[str], stdin: str) -> _Result:
        _, values, operands = _flags(_numeric_option(args), "q", "n")
        n_text = values.get("n", "10")
        from_start = tail and n_text.startswith("+")
        n = _count(n_text.lstrip("+"))
        if len(operands) > 1:
            raise _Unknown  # headers between files
        name, text = _inputs(run, operands, stdin, "tail" if tail else "head")[0]
        if text is None:
            prog = "tail" if tail else "head"
            return _Result(1, err=f"{prog}: cannot open '{name}' for reading: No such file or directory\n")
        lines = _lines(text)
        if from_start:
            picked = lines[max(0, n - 1) :]
        elif tail:
            picked = lines[-n:] if n else []
        else:
            picked = lines[:n]
        return _Result(0, "".join(picked))

    return program


def _wc(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, _, operands = _flags(args, "lwc")
    if len(flags) != 1 or len(operands) > 1:
        raise _Unknown  # several counts are padded to widths wc computes from the files
    name, text = _inputs(run, operands, stdin, "wc")[0]
    if text is None:
        return _Result(1, err=_missing("wc", name))
    (f,) = flags
    value = text.count("\n") if f == "l" else len(text.split()) if f == "w" else len(text.encode())
    return _Result(0, f"{value}\n" if not operands else f"{value} {name}\n")


_REGEX_META = re.compile(r"[.\[\]*^$\\+?(){}|]")


def _grep(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, values, operands = _flags(args, "nivcFqwx", "e")
    pattern = values.get("e")
    if pattern is None:
        if not operands:
            raise _Unknown
        pattern, operands = operands[0], operands[1:]
    if len(operands) > 1:
        raise _Unknown  # file-name prefixes
    if "F" not in flags and _REGEX_META.search(pattern):
        raise _Unknown
    name, text = _inputs(run, operands, stdin, "grep")[0]
    if text is None:
        return _Result(2, err=f"grep: {name}: No such file or directory\n")
    needle = pattern.lower() if "i" in flags else pattern
    if "\n" in needle or not needle:
        raise _Unknown
    hits: list[str] = []
    for number, line in enumerate(_lines(text), 1):
        body = line[:-1] if line.endswith("\n") else line
        hay = body.lower() if "i" in flags else body
        if "w" in flags or "x" in flags:
            raise _Unknown
        found = needle in hay
        if found != ("v" in flags):
            hits.append((f"{number}:" if "n" in flags else "") + body + "\n")
    rc = 0 if hits else 1
    if "q" in flags:
        return _Result(rc)
    if "c" in flags:
        return _Result(rc, f"{len(hits)}\n")
    return _Result(rc, "".join(hits))


_SED_PRINT = re.compile(r"(\d+)(?:,(\d+|\$))?p")


def _sed(run: _Run, args: list[str], stdin: str) -> _Result:
    if args and args[0] == "-i":
        return _sed_in_place(run, args[1:])
    flags, values, operands = _flags(args, "n", "e")
    script = values.get("e")
    if script is None:
        if not operands:
            raise _Unknown
        script, operands = operands[0], operands[1:]
    m = _SED_PRINT.fullmatch(script.strip())
    if "n" not in flags or m is None or len(operands) > 1:
        raise _Unknown
    first = int(m.group(1))
    last = first if m.group(2) is None else (10**9 if m.group(2) == "$" else int(m.group(2)))
    if operands and first >= 1:
        e = run.read(operands[0])
        if e.kind == "file" and e.text is None and e.lines and m.group(2) != "$":
            wanted = range(first, max(first, last) + 1)
            if all(n in e.lines for n in wanted):
                run.rules.add("file")
                return _Result(0, "".join(e.lines[n] + "\n" for n in wanted))
    name, text = _inputs(run, operands, stdin, "sed")[0]
    if text is None:
        return _Result(2, err=f"sed: can't read {name}: No such file or directory\n")
    lines = _lines(text)
    if first < 1:
        raise _Unknown
    return _Result(0, "".join(lines[first - 1 : max(first, last)]))


def _sed_in_place(run: _Run, args: list[str]) -> _Result:
    _, values, operands = _flags(args, "E", "e")
    script = values.get("e")
    if script is None:
        if not operands:
            raise _Unknown
        script, operands = operands[0], operands[1:]
    if not operands:
        raise _Unknown
    for path in operands:
        e = run.get(path)
        if e is None or e.kind != "file" or e.text is None:
            if run.apply:
                run.put(path, None)
                continue
            raise _Unknown
        if e.epoch < run.view.epoch:
            run.stale = True
        edited = sed_edit(script, e.text, extended="-E" in args or "E" in values)
        if edited is None:
            if run.apply:
                run.put(path, None)
                continue
            raise _Unknown
        run.put(path, run.file(edited))
    run.rules.add("file")
    return _Result(0)


def _echo(run: _Run, args: list[str], stdin: str) -> _Result:
    newline = True
    if args and args[0] == "-n":
        newline, args = False, args[1:]
    if any("\\" in a for a in args) or (args and args[0] in ("-e", "-E")):
        raise _Unknown  # sh and bash differ on escapes and -e
    return _Result(0, " ".join(args) + ("\n" if newline else ""))


_PRINTF = re.compile(r"%(%|s|d)")


def _printf(run: _Run, args: list[str], stdin: str) -> _Result:
    if not args:
        raise _Unknown
    fmt, rest = args[0], list(args[1:])
    if re.search(r"\\[^n\\t]", fmt) or (re.search(r"%[^%sd]", fmt)):
        raise _Unknown
    fmt = fmt.replace("\\\\", "\x00").replace("\\n", "\n").replace("\\t", "\t").replace("\x00", "\\")
    slots = [m.group(1) for m in _PRINTF.finditer(fmt) if m.group(1) != "%"]
    if not slots:
        if rest:
            raise _Unknown
        return _Result(0, fmt.replace("%%", "%"))
    if len(rest) != len(slots):
        raise _Unknown  # printf reuses the format for extra arguments
    it = iter(rest)

    def fill(m: re.Match[str]) -> str:
        if m.group(1) == "%":
            return "%"
        v = next(it)
        if m.group(1) == "d" and not re.fullmatch(r"-?\d+", v):
            raise _Unknown
        return v

    return _Result(0, _PRINTF.sub(fill, fmt))


def _pwd(run: _Run, args: list[str], stdin: str) -> _Result:
    if args or run.cwd is None or run.cwd.startswith(_CWD):
        raise _Unknown
    return _Result(0, run.cwd + "\n")


def _cd(run: _Run, args: list[str], stdin: str) -> _Result:
    """``cd DIR``, followed only into a directory known to exist: a directory entry, or one
    holding a path known to exist (a file read under it); knowing a file under it is
    absent says nothing of the directory."""
    if len(args) != 1 or args[0].startswith(("-", "//")):
        raise _Unknown  # cd -, cd -L (to $HOME), //x (kept as written by pwd)
    e = run.get(args[0])
    key = run.key(args[0])
    if run.apply and (e is None or e.kind == "dir"):
        # a step's effects: its later commands ran in DIR if they ran at all
        run.cwd = key
        run.moved = True
        return _Result(0)
    if _has_dotdot(args[0]):
        raise _Unknown  # through a symbolic link, .. is not the logical parent
    if e is None and key == run.key("."):
        return _Result(0)  # the directory the shell is in
    if e is None:
        below = key.rstrip("/") + "/"
        e = next((v for k, v in _known(run) if k.startswith(below) and v is not None and v.kind != "absent"), None)
        if e is None:
            raise _Unknown
    elif e.kind != "dir":
        raise _Unknown
    if e.epoch < run.view.epoch:
        run.stale = True
    run.cwd = key
    run.moved = True
    return _Result(0)


def _has_dotdot(path: str) -> bool:
    return ".." in path.split("/")


def _known(run: _Run) -> Iterator[tuple[str, _Entry | None]]:
    """Every entry the run sees: its own, then the view's that it has not overlaid."""
    yield from run.overlay.items()
    for k, v in run.view.entries.items():
        if k not in run.overlay:
            yield k, v


def _true(rc: int):
    def program(run: _Run, args: list[str], stdin: str) -> _Result:
        return _Result(rc)

    return program


def _basename(run: _Run, args: list[str], stdin: str) -> _Result:
    if not args or len(args) > 2 or any(a.startswith("-") for a in args):
        raise _Unknown
    base = posixpath.basename(args[0].rstrip("/")) or "/"
    if len(args) == 2 and base.endswith(args[1]) and base != args[1]:
        base = base[: -len(args[1])]
    return _Result(0, base + "\n")


def _dirname(run: _Run, args: list[str], stdin: str) -> _Result:
    if len(args) != 1 or args[0].startswith("-"):
        raise _Unknown
    return _Result(0, (posixpath.dirname(args[0].rstrip("/")) or ".") + "\n")


def _test(bracket: bool):
    def program(run: _Run, args: list[str], stdin: str) -> _Result:
        if bracket:
            if not args or args[-1] != "]":
                raise _Unknown
            args = args[:-1]
        negate = False
        if args and args[0] == "!":
            negate, args = True, args[1:]
        if len(args) != 2 or args[0] not in ("-f", "-e", "-d", "-s"):
            raise _Unknown
        e = run.read(args[1])
        op = args[0]
        if op == "-e":
            ok = e.kind != "absent"
        elif op == "-d":
            ok = e.kind == "dir"
        elif op == "-f":
            ok = e.kind == "file"
        else:
            if e.kind == "file" and e.text is None:
                raise _Unknown
            ok = e.kind == "file" and bool(e.text)
        return _Result(0 if ok != negate else 1)

    return program


def _ls(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, _, operands = _flags(args, "1d")
    if not operands or len(operands) > 1:
        raise _Unknown  # a directory listing's order and columns depend on the terminal and locale
    e = run.read(operands[0])
    if e.kind == "absent":
        return _Result(2, err=f"ls: cannot access '{operands[0]}': No such file or directory\n")
    if e.kind != "file" and "d" not in flags:
        raise _Unknown
    return _Result(0, operands[0] + "\n")


def _diff_cmp(program: str):
    def run_it(run: _Run, args: list[str], stdin: str) -> _Result:
        _, _, operands = _flags(args, "q" if program == "diff" else "s")
        if len(operands) != 2:
            raise _Unknown
        a, b = run.text(operands[0]), run.text(operands[1])
        if a is None or b is None or a != b:
            raise _Unknown  # only equal files have an output this drafter can write
        return _Result(0)

    return run_it


def _parent_exists(run: _Run, path: str) -> bool:
    parent = posixpath.dirname(path.rstrip("/"))
    if parent in ("", "."):
        return True  # the working directory
    e = run.get(parent)
    return e is not None and e.kind == "dir"


def _mkdir(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, _, operands = _flags(args, "p")
    if not operands:
        raise _Unknown
    for path in operands:
        e = run.get(path)
        if e is not None and e.kind == "dir" and "p" in flags:
            continue
        if not run.apply and (
            (e is not None and e.kind != "absent") or ("p" not in flags and (e is None or not _parent_exists(run, path)))
        ):
            raise _Unknown  # it may exist already, or its parent may not
        run.put(path, _Entry("dir", epoch=run.view.epoch))
    return _Result(0)


def _touch(run: _Run, args: list[str], stdin: str) -> _Result:
    _, _, operands = _flags(args, "")
    if not operands:
        raise _Unknown
    for path in operands:
        e = run.get(path)
        if e is not None and e.kind == "absent" and _parent_exists(run, path):
            run.put(path, run.file(""))
        elif e is None:
            if not run.apply and not _parent_exists(run, path):
                raise _Unknown
            run.put(path, _Entry("file", None, {}, run.view.epoch))  # created, or an old file of unknown text
        elif e.kind == "absent" and not run.apply:
            raise _Unknown
    return _Result(0)


def _rm(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, _, operands = _flags(args, "rfRv")
    if not operands or "v" in flags:
        raise _Unknown
    for path in operands:
        e = run.get(path)
        if e is None and not run.apply and "f" not in flags:
            raise _Unknown
        if e is not None and e.kind == "absent" and "f" not in flags:
            raise _Unknown
        if e is not None and e.kind == "dir" and not flags & {"r", "R"}:
            raise _Unknown
        run.forget_below(path)
        run.put(path, _Entry("absent", epoch=run.view.epoch))
    return _Result(0)


def _cp_mv(move: bool):
    def program(run: _Run, args: list[str], stdin: str) -> _Result:
        flags, _, operands = _flags(args, "fv" if move else "frRpav")
        if len(operands) != 2 or "v" in flags:
            raise _Unknown
        src, dst = operands
        se = run.get(src)
        de = run.get(dst)
        if de is not None and de.kind == "dir":
            dst = posixpath.join(dst, posixpath.basename(src.rstrip("/")))
            de = run.get(dst)
        if se is None or se.kind == "absent":
            if not run.apply or se is not None:
                raise _Unknown
            run.forget_below(dst)  # an unknown source may be a directory: what it held moved too
            run.put(dst, None)
            if move:
                run.forget_below(src)
                run.put(src, None)
            return _Result(0)
        if se.kind == "dir":
            if not move and not flags & {"r", "R", "a"}:
                raise _Unknown
            if not run.apply:
                raise _Unknown  # the tree below it is not known
            run.forget_below(dst)
            run.put(dst, None)
        else:
            if se.epoch < run.view.epoch:
                run.stale = True
            run.put(dst, se)  # the copy is as fresh as what it copied
        if move:
            run.forget_below(src)
            run.put(src, _Entry("absent", epoch=run.view.epoch))
        return _Result(0)

    return program


def _chmod(run: _Run, args: list[str], stdin: str) -> _Result:
    if len(args) < 2 or (args[0].startswith("-") and args[0] not in ("-R",)):
        raise _Unknown
    for path in args[1:]:
        e = run.get(path)
        if (e is None or e.kind == "absent") and not run.apply:
            raise _Unknown
    return _Result(0)


def _tee(run: _Run, args: list[str], stdin: str) -> _Result:
    flags, _, operands = _flags(args, "a")
    for path in operands:
        old = ""
        if "a" in flags:
            e = run.get(path)
            if e is None or e.kind != "file" or e.text is None:
                if run.apply:
                    run.put(path, None)
                    continue
                raise _Unknown
            old = e.text
        run.put(path, run.file(old + stdin))
    return _Result(0, stdin)


def _python(run: _Run, args: list[str], stdin: str) -> _Result:
    if len(args) != 2 or args[0] != "-c":
        raise _Unknown
    found = python_output(args[1], {k: v for k, (v, _) in run.view.values.items()})
    if found is None:
        raise _Unknown
    output, uses, imports = found
    run.rules.add("python")
    if imports - _STDLIB:
        run.rules.add("python-import")
    for expr in uses:
        run.rules.add("value")
        if run.view.values[expr][1] < run.view.epoch:
            run.stale = True
    return _Result(0, output)


_STDLIB = frozenset(sys.stdlib_module_names)

_PROGRAMS = {
    "cat": _cat,
    "head": _head_tail(False),
    "tail": _head_tail(True),
    "wc": _wc,
    "grep": _grep,
    "sed": _sed,
    "echo": _echo,
    "printf": _printf,
    "pwd": _pwd,
    "cd": _cd,
    "true": _true(0),
    ":": _true(0),
    "false": _true(1),
    "basename": _basename,
    "dirname": _dirname,
    "test": _test(False),
    "[": _test(True),
    "ls": _ls,
    "diff": _diff_cmp("diff"),
    "cmp": _diff_cmp("cmp"),
    "mkdir": _mkdir,
    "touch": _touch,
    "rm": _rm,
    "cp": _cp_mv(False),
    "mv": _cp_mv(True),
    "chmod": _chmod,
    "tee": _tee,
    "python": _python,
    "python3": _python,
}


def _is_python(words: tuple[str, ...]) -> bool:
    return bool(words) and re.fullmatch(r"python(?:3(?:\.\d+)?)?", words[0]) is not None


# -------------------------------------------------------------------- folding the history


def _cd_prefix(view: FileView, script: Script) -> tuple[str | None, tuple[Pipeline, ...]] | None:
    """The directory a script's leading ``cd DIR &&`` commands move to (None: none) and the
    pipelines after them; None when a ``cd`` cannot be followed (no argument, ``cd -``, a
    path above the unknown cwd). A harness that runs each command in a new shell has its
    agent write ``cd /work/project && cat x.py``: what the output says is about that
    directory's files."""
    pipelines, ops, cwd = script.pipelines, script.ops, None
    while len(pipelines) > 1 and ops and ops[0] == "&&":
        (first, *more) = pipelines[0].commands
        if more or first.words[:1] != ("cd",) or first.redirects or first.heredoc is not None:
            break
        if len(first.words) != 2 or first.words[1].startswith(("-", "//")) or _has_dotdot(first.words[1]):
            return None
        cwd = view.resolve(first.words[1], cwd)
        if cwd is None:
            return None
        pipelines, ops = pipelines[1:], ops[1:]
    return cwd, pipelines


def _learn(view: FileView, script: Script, rc: int, output: str) -> None:
    """What a finished single command's output says about the filesystem (after leading
    ``cd DIR &&`` commands: about DIR's files)."""
    prefix = _cd_prefix(view, script)
    if prefix is None:
        return
    cwd, pipelines = prefix
    if len(pipelines) != 1 or len(pipelines[0].commands) != 1:
        return
    cmd = pipelines[0].commands[0]
    if cmd.redirects or cmd.heredoc is not None or not cmd.words or not script.literal:
        return
    words = cmd.words
    name, args = words[0], list(words[1:])
    if cwd is not None and any(_has_dotdot(a) for a in args):
        return  # after a cd, ".." through a link is not the logical parent
    try:
        if name == "cat" and len(args) == 1 and not args[0].startswith("-"):
            key = view.resolve(args[0], cwd)
            if key is None:
                return
            if rc == 0:
                view.entries[key] = _Entry("file", output, {}, view.epoch)
            elif output == _missing("cat", args[0]):
                view.entries[key] = _Entry("absent", epoch=view.epoch)
        elif name == "pwd" and cwd is None and not args and rc == 0 and re.fullmatch(r"/[^\n]*\n", output):
            _set_cwd(view, output[:-1])
        elif name in ("head", "sed") and rc == 0:
            first, count, path = _line_window(name, args)
            key = view.resolve(path, cwd)
            if key is None:
                return
            got = output.split("\n")
            if got and got[-1] == "":
                got.pop()
            e = view.entries.get(key)
            if e is not None and e.text is not None and e.epoch >= view.epoch:
                return
            lines = dict(e.lines) if e is not None and e.epoch >= view.epoch else {}
            lines.update({first + j: line for j, line in enumerate(got[:count])})
            view.entries[key] = _Entry("file", None, lines, view.epoch)
        elif _is_python(words) and cwd is None and len(args) == 2 and args[0] == "-c" and rc == 0:
            for expr, value in remembered_values(args[1], output):
                view.values[expr] = (value, view.epoch)
    except _Unknown:
        return


def _line_window(name: str, args: list[str]) -> tuple[int, int, str]:
    if name == "head":
        _, values, operands = _flags(_numeric_option(args), "", "n")
        if len(operands) != 1:
            raise _Unknown
        return 1, _count(values.get("n", "10")), operands[0]
    flags, _, operands = _flags(args, "n")
    if "n" not in flags or len(operands) != 2:
        raise _Unknown
    m = _SED_PRINT.fullmatch(operands[0].strip())
    if m is None or m.group(2) == "$":
        raise _Unknown
    first = int(m.group(1))
    last = first if m.group(2) is None else int(m.group(2))
    return first, max(0, last - first + 1), operands[1]


def _set_cwd(view: FileView, cwd: str) -> None:
    if view.cwd == cwd:
        return
    view.cwd = posixpath.normpath(cwd)
    moved = {}
    for k, e in view.entries.items():
        if k.startswith(_CWD):
            moved[posixpath.normpath(view.cwd + k[len(_CWD) :])] = e
        else:
            moved.setdefault(k, e)
    view.entries = moved


def _apply_effects(view: FileView, script: Script | None, action: Action, rc: int | None, i: int) -> None:
    """Fold the effects of step ``i`` (its return code ``rc`` when known) into the view."""
    cmd = action.command
    if cmd is None:
        if not action.is_none:
            view.epoch += 1  # another tool: it may have written anything
            view.last_write = i
        return
    if script is None:
        if classify_command(cmd) is Effect.MAY_CHANGE:
            view.epoch += 1
            view.last_write = i
        return
    run = _Run(view, apply=True)
    run.final_rc = rc
    # the words of a script that expands ($X, globs, substitutions) are not what ran: it
    # writes what it writes, with contents unknown
    run.unknown_flow = not script.literal
    try:
        run.script(script, rc)
    except _Unknown:
        run.unmodelled_write = True
    if run.unmodelled_write or script.background or (not script.literal and classify_command(cmd) is Effect.MAY_CHANGE):
        view.epoch += 1
        view.last_write = i
    if run.written:
        view.last_write = i
    for key, entry in run.overlay.items():
        # (a step that also wrote unmodelled leaves its own writes stale: the epoch moved past them)
        if entry is None:
            view.entries.pop(key, None)
        else:
            view.entries[key] = entry
    for key in run.written:
        view.written[key] = i


def _fold(view: FileView, i: int, turn: Turn) -> None:
    action = turn.action
    parsed = parse_observation(turn.observation)
    if view.format_known is None or turn.observation:
        view.format_known = bool(_MINI_ANY.match(turn.observation)) if not action.is_none else view.format_known
    script = parse_script(action.command) if action.command is not None else None
    _apply_effects(view, script, action, parsed[0] if parsed else None, i)
    if parsed is not None and script is not None:
        _learn(view, script, *parsed)
    if not action.is_none:
        view.last_run[action.key] = (i, turn.observation, view.epoch)
    view.steps = i + 1


@functools.lru_cache(maxsize=1 << 13)
def written_paths(command: str) -> tuple[str, ...]:
    """Paths ``command`` writes by the writes the view models (heredocs, redirections, cp,
    mv, touch, mkdir, sed -i, tee), in order, each once; () when it cannot be parsed."""
    script = parse_script(command)
    if script is None:
        return ()
    run = _Run(FileView(), apply=True)
    with contextlib.suppress(_Unknown):
        run.script(script, 0)
    out: dict[str, None] = {}
    for k in run.written:
        out[k[len(_CWD) + 1 :] if k.startswith(_CWD + "/") else k] = None
    return tuple(out)


# -------------------------------------------------------------------- the drafter


class TrajectoryDrafter:
    """Observation drafter over the trajectory's filesystem view (see module doc).

    ``max_line_chars``: abstain from drafts with a longer line (a recorded terminal may
    have wrapped it); None: learned in :meth:`fit` as the longest line of the training
    observations' 99.5th percentile. ``min_probability``: drop less likely drafts.
    ``backoff``: Witten-Bell pseudo-counts of a rule's pooled rate.
    """

    def __init__(self, max_line_chars: int | None = None, min_probability: float = 0.0, backoff: float = 2.0) -> None:
        self.max_line_chars = max_line_chars
        self.min_probability = min_probability
        self.backoff = backoff
        self._max_line = max_line_chars
        #: (rule, freshness) -> (hits, drafts) on the training traces.
        self.rule_counts: dict[tuple[str, ...], tuple[int, int]] = {}
        self._counts: dict[tuple[str, ...], tuple[int, int]] = {}
        self._mini_prior = True
        self._index: HistoryIndex[FileView] = HistoryIndex(FileView, _fold)

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn the line-length limit, the observation format and the hit rates from
        ``traces`` (the drafter replayed on their true histories)."""
        lengths = sorted(len(line) for t in traces for s in t.steps for line in s.observation.split("\n"))
        if self.max_line_chars is None:
            self._max_line = lengths[int(0.995 * (len(lengths) - 1))] if lengths else None
        firsts = [t.steps[0].observation for t in traces if t.steps and not t.steps[0].action.is_none]
        self._mini_prior = bool(firsts) and sum(bool(_MINI_ANY.match(o)) for o in firsts) >= 0.9 * len(firsts)
        counts: dict[tuple[str, ...], list[int]] = defaultdict(lambda: [0, 0])
        for trace in traces:
            view = FileView()
            for i, step in enumerate(trace.steps):
                if step.completed and not step.action.is_none:
                    for text, (rule, fresh) in self._candidates(view, step.action):
                        for cell in ((fresh,), (rule, fresh), (rule, fresh, step.action.key)):
                            c = counts[cell]
                            c[0] += text == step.observation
                            c[1] += 1
                _fold(view, i, Turn(step.action, step.observation))
        self.rule_counts = {k: (v[0], v[1]) for k, v in counts.items() if len(k) == 2}
        self._counts = {k: (v[0], v[1]) for k, v in counts.items()}
        self._index = HistoryIndex(FileView, _fold)

    def probability(self, rule: str, fresh: bool, action: Action | None = None) -> float:
        """The probability that a draft ``rule`` made from ``fresh`` (or stale) knowledge is
        byte-identical: the training hit rate of that exact action's drafts, backed off to
        the rule's, backed off to every draft's of that freshness (Beta(1, 1) at the root)."""
        f = "fresh" if fresh else "stale"
        h, n = self._counts.get((f,), (0, 0))
        p = (h + 1) / (n + 2)
        for cell in ((rule, f), (rule, f, action.key if action is not None else "")):
            h, n = self._counts.get(cell, (0, 0))
            p = (h + self.backoff * p) / (n + self.backoff)
        return p

    def _candidates(self, view: FileView, action: Action) -> list[tuple[str, tuple[str, str]]]:
        """(text, (rule, freshness)) drafts for ``action`` from ``view``."""
        cmd = action.command
        if cmd is None:
            return []
        out: list[tuple[str, tuple[str, str]]] = []
        script = parse_script(cmd)
        known_format = view.format_known if view.format_known is not None else self._mini_prior
        if script is not None and script.literal and not script.background and known_format:
            run = _Run(view)
            try:
                r: _Result | None = run.script(script)
            except (_Unknown, RecursionError):
                r = None
            if r is not None and self._fits(r.out):
                text = _FORMATTER.format(action, CommandResult(r.rc, r.out, False, 0.0))
                rule = next((x for x in _RULE_ORDER if x in run.rules), "pure")
                out.append((text, (rule, "stale" if run.stale else "fresh")))
        last = view.last_run.get(action.key)
        if last is not None and not out:  # (a computed output knows more than the last one)
            out.append((last[1], ("rerun", "fresh" if self._unchanged_since(view, last, script, cmd) else "stale")))
        return out

    @staticmethod
    def _unchanged_since(view: FileView, last: tuple[int, str, int], script: Script | None, cmd: str) -> bool:
        """Whether nothing a re-run of ``cmd`` may read was written since its last run: nothing
        at all, or (a read-only command) none of the paths it names and nothing unmodelled."""
        step, _, epoch = last
        if epoch < view.epoch:
            return False
        if view.last_write <= step:
            return True
        if script is None or classify_command(cmd) is not Effect.READ_ONLY:
            return False
        if any(c.words[:1] == ("cd",) for c in script.commands):
            return False  # its relative names are not the view's
        names = [view.resolve(w) for c in script.commands for w in c.words[1:]]
        names += [view.resolve(r.target) for c in script.commands for r in c.redirects]
        return not any(view.written.get(k, -1) > step for k in names if k is not None)

    def _fits(self, output: str) -> bool:
        return self._max_line is None or all(len(line) <= self._max_line for line in output.split("\n"))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if n <= 0 or action.command is None:
            return []
        view = self._index.update(history)
        drafts = []
        for text, (rule, fresh) in self._candidates(view, action):
            p = self.probability(rule, fresh == "fresh", action)
            if p >= self.min_probability:
                drafts.append(ObservationDraft(text, p))
        drafts.sort(key=lambda d: -d.probability)
        return drafts[:n]


_FORMATTER = MiniSweAgentFormatter()

#: When a draft used several rules, the least certain one names it.
_RULE_ORDER = ("value", "python-import", "python", "file", "pure")

