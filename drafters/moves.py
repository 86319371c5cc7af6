"""MovesActionDrafter: next actions from the harness's recurring moves and what the
history names.

Agents repeat a few moves: write a script, then run it; edit a file, then re-run the
command that tested it; build, then run what was built. The drafter folds the history into
what those moves need (incrementally, per trajectory):

- the files each step wrote (:func:`aospec.drafters.trajectory.written_paths`: heredocs,
  redirections, ``cp``/``mv``/``tee``/``sed -i``, ...), most recent first;
- the *check* commands: what the agent ran right after a write (``python test.py``,
  ``pytest -x``, ``make && ./app``), most recent first, with whether the last run failed;
- how this trajectory runs a script of each kind (``python3 x.py``, ``timeout 60 python
  x.py``: the command with the script's path as a slot), else how the training traces do;
- what a build produced (``gcc -o app ...`` -> ``./app``).

Its candidates (each named by its *rule*):

- ``run-written``: after a step that wrote a script, that script run the way this
  trajectory (or training) runs scripts of its kind;
- ``check``: after a step that wrote anything, the check commands, most recent first
  (``edit -> re-run the failing test``);
- ``run-built``: after a successful build, the built program;
- lookahead (offset ``k > 0``): the check commands again, ``k`` steps ahead, "after the
  next edit" (the actor edits, then re-runs). A fork for such a target passes JASV only
  where the steps between leave the filesystem as it was (``--state-model blind`` counts
  them; exact versions do not), so they are offered only with ``lookahead_writes=True``.

:meth:`MovesActionDrafter.propose_routed` (a :class:`aospec.protocols.RoutedActionDrafter`)
completes the program a stream router named mid-decode: the candidates above whose
program it is, then that program on the files the history wrote or read (a script of a
matching kind for interpreters, any file for viewers), then this trajectory's earlier
commands of that program.

**Probabilities.** :meth:`MovesActionDrafter.fit` replays the drafter on the training
traces' true histories and counts, per (rule, rank), how often the candidate was the next
action (for routed candidates: given the router's label of it); a candidate's probability
is that Beta(1, 1) posterior mean. Candidates found by several rules get the noisy-or.
"""

from __future__ import annotations

import dataclasses
import functools
import posixpath
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aospec.drafters._shell import HistoryIndex, entities
from aospec.drafters.trajectory import parse_observation, written_paths

from aospec.effects import classify_action
from aospec.errors import ConfigError
from aospec.protocols import ActionDraft
from aospec.shell import program_label
from aospec.types import Action, Effect, History, Trace, Turn

__all__ = ["MovesActionDrafter"]

#: How a script of each kind runs when the trajectory has not shown it (the training
#: traces' most common form replaces it in fit).
_DEFAULT_RUNNERS = {".py": "python {}", ".sh": "bash {}", ".js": "node {}", ".rb": "ruby {}", ".pl": "perl {}"}
_SCRIPT_EXTS = frozenset(_DEFAULT_RUNNERS)
_BUILD = re.compile(r"(?:^|&&\s*|;\s*)(?:gcc|g\+\+|cc|clang\+?\+?|rustc|go build)(?:-\d+(?:\.\d+)*)?(?=\s)[^;&|]*?\s-o\s+(\S+)")
_MAX_CHECKS = 4
_MAX_FILES = 6
_MAX_LOOKAHEAD = 4
#: Ways of running a script of one kind offered besides the trajectory's own (``python3 {}``,
#: ``timeout 300 python {}``, ...): the training trajectories' most common.
_MAX_FORMS = 10
#: The interpreter a runner form must name before the script's slot, per kind of script
#: (``sed -i '1d' {}`` names the script but does not run it).
_INTERPRETERS = {
    ".py": re.compile(r"python[\d.]*"),
    ".sh": re.compile(r"(?:ba|da|z)?sh"),
    ".js": re.compile(r"node(?:js)?"),
    ".rb": re.compile(r"ruby"),
    ".pl": re.compile(r"perl"),
}
#: ``pip install`` as a program and its arguments (``pip3``, ``python3 -m pip``).
_PIP = re.compile(r"((?:python[\d.]*\s+-m\s+)?pip[\d.]*)\s+install\s+(.*)")
#: What names a missing Python module in an observation (the module or library name).
_MISSING = (
    re.compile(r"No module named '([A-Za-z_][\w.]*)'"),
    re.compile(r"requires the ([A-Za-z][\w-]*) library but it was not found"),
)
#: An import failing by the agent's own message (``python -c "import x" || echo "x not available"``).
_NOT_AVAILABLE = re.compile(r"not (?:available|installed|found)|ImportError|ModuleNotFoundError", re.IGNORECASE)
_IMPORT = re.compile(r"(?:^|[;\s\"'])(?:from\s+([A-Za-z_]\w*)\s+import|import\s+([A-Za-z_]\w*))")
#: Distribution names of modules whose import name differs (a missing ``sklearn`` is installed
#: as ``scikit-learn``); any other module is installed under its own name, lowercased.
_DISTRIBUTIONS = {
    "sklearn": "scikit-learn", "cv2": "opencv-python", "PIL": "pillow", "yaml": "pyyaml", "bs4": "beautifulsoup4",
    "skimage": "scikit-image", "Crypto": "pycryptodome", "dateutil": "python-dateutil", "attr": "attrs",
    "dotenv": "python-dotenv", "jwt": "pyjwt", "magic": "python-magic", "serial": "pyserial", "usb": "pyusb",
    "docx": "python-docx", "pptx": "python-pptx", "fitz": "pymupdf", "google": "protobuf",
}  # fmt: skip
_STDLIB = frozenset(sys.stdlib_module_names)
#: pip options that take a value (the next word, without ``=``): not packages.
_PIP_VALUED = frozenset(("-t", "--target", "-c", "--constraint", "-f", "--find-links", "--extra-index-url", "--timeout",
                         "--trusted-host", "--prefix", "--root", "--cache-dir", "--platform", "--python-version",
                         "--implementation", "--abi", "--src", "--upgrade-strategy", "--progress-bar", "--log",
                         "--proxy", "--retries", "--exists-action", "--cert", "--client-cert", "--only-binary",
                         "--no-binary", "--report", "--config-settings", "-C", "--global-option", "--python"))  # fmt: skip
_VIEWERS = frozenset(("cat", "head", "tail", "less", "more", "wc", "nl", "grep"))
_TIMEOUT = "timed out and has been killed"
#: One entry of ``ls -l``: its type letter and its name (symlinks' targets cut off).
_LS_LONG = re.compile(r"^([-dlcbps])[rwxsStT-]{9}[.+@]?\s+\d+\s+\S+\s+\S+\s+[\d,]+\s+\w{3}\s+\d+\s+[\d:]+\s+(.+?)(?: -> .*)?$")
_LS_SIMPLE = re.compile(r"ls((?:\s+-[A-Za-z1]+)*)(?:\s+([^\s;&|<>*?$`'\"]+))?\s*")
#: Extensions of files an agent reads with ``cat`` (not archives, images, weights).
_TEXT_EXTS = frozenset((".py", ".txt", ".md", ".json", ".csv", ".c", ".h", ".cpp", ".hpp", ".sh", ".yaml", ".yml",
                        ".toml", ".cfg", ".ini", ".js", ".ts", ".go", ".rs", ".java", ".rb", ".log", ".xml", ".html",
                        ".sql", ".conf", ".tsv", ""))  # fmt: skip


def _runner_of(command: str, path: str) -> str | None:
    """``command`` with ``path`` as the ``{}`` slot, when it runs that script (its first
    line names it as a word and holds nothing after it but arguments)."""
    first = command.split("\n", 1)[0]
    if "\n" in command or "<<" in first or len(first) > 200:
        return None
    words = first.split()
    if path not in words:
        return None
    k = words.index(path)
    if k == 0:
        return None
    escaped = [w.replace("{", "{{").replace("}", "}}") for w in words]
    return " ".join([*escaped[:k], "{}", *escaped[k + 1 :]])


@dataclass
class _State:
    step: int = 0
    written: dict[str, int] = field(default_factory=dict)  # path -> last step that wrote it
    seen: dict[str, int] = field(default_factory=dict)  # path -> last step that named it
    last_written: tuple[str, ...] = ()
    checks: list[Action] = field(default_factory=list)  # most recent last
    failed: set[str] = field(default_factory=set)  # check keys whose last run failed
    runners: dict[str, str] = field(default_factory=dict)  # extension -> "python3 {}"
    forms: dict[str, list[str]] = field(default_factory=dict)  # extension -> interpreter forms, most recent last
    pip: str = ""  # how this trajectory runs pip ("pip3", "python -m pip")
    missing: tuple[str, ...] = ()  # distributions the last step showed missing
    pending: tuple[str, ...] = ()  # packages of a failed multi-package install not yet installed one by one
    ran_script: str | None = None  # the script the last step ran with an interpreter
    built: tuple[str, ...] = ()
    listed: tuple[tuple[str, str], ...] = ()  # (path, "d" or "-") the last step's ls showed
    unread: dict[str, int] = field(default_factory=dict)  # listed text files not yet read -> step listed
    task_paths: tuple[str, ...] | None = None
    task_files: tuple[str, ...] = ()  # text files the task names (relative ones too)
    task_commands: tuple[str, ...] = ()  # command lines the task quotes ("./cli_tool weights.json image.png")
    shown: dict[str, int] = field(default_factory=dict)  # path -> last step a viewer (cat, head, ...) showed it
    ls_flags: str = ""
    last_ok: bool = True
    by_label: dict[str, list[Action]] = field(default_factory=lambda: defaultdict(list))


@functools.lru_cache(maxsize=1 << 14)
def _entities(command: str) -> tuple[str, ...]:
    return tuple(entities(command))


@functools.lru_cache(maxsize=1 << 14)
def _bash(command: str) -> Action:
    return Action.bash(command)


def _copy(state: _State) -> _State:
    """A copy of ``state`` that folding one more turn does not change ``state`` through."""
    return dataclasses.replace(
        state,
        written=dict(state.written),
        seen=dict(state.seen),
        shown=dict(state.shown),
        checks=list(state.checks),
        failed=set(state.failed),
        runners=dict(state.runners),
        forms={k: list(v) for k, v in state.forms.items()},
        unread=dict(state.unread),
        by_label=defaultdict(list, {k: list(v) for k, v in state.by_label.items()}),
    )


@functools.lru_cache(maxsize=1 << 14)
def _ext(path: str) -> str:
    base = posixpath.basename(path)
    return base[base.rfind(".") :] if "." in base else ""


def _listing(command: str, observation: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """What a plain ``ls -l [DIR]`` showed: (path, type letter) of each entry (``.`` and
    ``..`` left out), and its flags."""
    m = _LS_SIMPLE.fullmatch(command)
    parsed = parse_observation(observation)
    if m is None or parsed is None or "l" not in (m.group(1) or ""):
        return (), ""
    base = (m.group(2) or "").rstrip("/")
    out = []
    for line in parsed[1].split("\n"):
        e = _LS_LONG.match(line)
        if e is not None and e.group(2) not in (".", ".."):
            out.append((f"{base}/{e.group(2)}" if base else e.group(2), e.group(1)))
    return tuple(out), " ".join((m.group(1) or "").split())


def _fold(state: _State, i: int, turn: Turn, label: Callable[[Action], str]) -> None:
    a = turn.action
    cmd = a.command
    parsed = parse_observation(turn.observation)
    ok = parsed is not None and parsed[0] == 0 and _TIMEOUT not in turn.observation[:200]
    if cmd is not None:
        if state.last_written and state.step == i and not written_paths(cmd):
            # what ran right after a write (and wrote nothing itself): a check command
            state.checks = [c for c in state.checks if c != a] + [a]
            del state.checks[:-_MAX_CHECKS]
        if a.key in {c.key for c in state.checks}:
            if ok:
                state.failed.discard(a.key)
            else:
                state.failed.add(a.key)
        named = _entities(cmd)
        state.ran_script = None
        for path in named:
            if _ext(path) in _SCRIPT_EXTS and (path in state.written or path in state.seen):
                r = _runner_of(cmd, path)
                if r is not None:
                    state.runners[_ext(path)] = r
                    if _is_interpreter_form(r, _ext(path)):
                        state.ran_script = path
                        lst = state.forms.setdefault(_ext(path), [])
                        if r in lst:
                            lst.remove(r)
                        lst.append(r)
        written = written_paths(cmd)
        for p in written:
            state.written[p] = i
        for p in named:
            state.seen[p] = i
        state.last_written = written
        m = _BUILD.search(cmd.split("\n", 1)[0])
        state.built = (m.group(1),) if m and ok else ()
        state.listed, state.ls_flags = _listing(cmd, turn.observation) if ok else ((), "")
        _fold_installs(state, cmd, turn.observation, ok)
        for path, kind in state.listed:
            if kind == "-" and _ext(path) in _TEXT_EXTS and path not in state.seen:
                state.unread[path] = i
        for path in named:
            state.unread.pop(path, None)
        lab = label(a)
        if lab in _VIEWERS:
            for path in named:
                state.shown[path] = i
        if not a.is_none:
            lst = state.by_label[lab]
            if a in lst:
                lst.remove(a)
            lst.append(a)
    else:
        state.last_written = ()
        state.built = ()
        state.listed = ()
        state.missing = ()
        state.pending = ()
        state.ran_script = None
    state.last_ok = ok
    state.step = i + 1


def _is_interpreter_form(form: str, ext: str) -> bool:
    """Whether runner ``form`` runs its script with an interpreter of the script's kind (a
    word of the slot's simple command before the slot names it)."""
    pattern = _INTERPRETERS.get(ext)
    words = form.split()
    if pattern is None or "{}" not in words:
        return False
    for w in reversed(words[: words.index("{}")]):
        if w in ("&&", "||", ";", "|", "&"):
            return False
        if pattern.fullmatch(posixpath.basename(w)):
            return True
    return False


def _pip_install(command: str) -> tuple[str, list[str]] | None:
    """(pip program, packages) of a one-line ``pip install`` command (options left out), else
    None; a command with anything after the install (``&& python x.py``) is not one."""
    if "\n" in command or any(op in command for op in ("&&", "||", ";", "|", ">", "<", "`", "$(")):
        return None
    m = _PIP.fullmatch(command.strip())
    if m is None:
        return None
    words = m.group(2).split()
    if any(w.startswith(("-r", "--requirement", "-e", "--editable", "--index-url", "-i")) for w in words):
        return None
    packages, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w.startswith("-"):
            skip = w in _PIP_VALUED
        elif "/" in w or ":" in w or w.startswith(".") or any(q in w for q in "'\"$*?"):
            return None  # a path, a URL or a word the shell rewrites: not a package name to retry alone
        else:
            packages.append(w)
    return " ".join(m.group(1).split()), packages


def _fold_installs(state: _State, cmd: str, observation: str, ok: bool) -> None:
    """Fold one command into what the install moves need: how pip runs here, which modules
    its observation shows missing, what a failed multi-package install left to do."""
    missing: dict[str, None] = {}
    head = observation[:20_000]
    for pattern in _MISSING:
        for m in pattern.finditer(head):
            module = m.group(1).split(".")[0]
            missing[_DISTRIBUTIONS.get(module, module.lower())] = None
    if not missing and _NOT_AVAILABLE.search(head) and "\n" not in cmd.strip() and "python" in cmd:
        for m in _IMPORT.finditer(cmd):
            module = m.group(1) or m.group(2)
            if module not in _STDLIB:
                missing[_DISTRIBUTIONS.get(module, module.lower())] = None
    install = _pip_install(cmd)
    if install is None:
        state.pending = ()  # the agent moved on
    else:
        state.pip, packages = install
        done = {p.lower() for p in packages}
        state.pending = tuple(p for p in state.pending if p.lower() not in done)
        if not ok and len(packages) > 1:
            state.pending = tuple(packages)
        for p in done:
            missing.pop(p, None)
    state.missing = tuple(missing)


class MovesActionDrafter:
    """Action drafter over recurring moves (see module doc).

    ``label``: the routing label of an action (a router's rule, e.g.
    :func:`aospec.streams.tool_label`; default: the program of a shell command, else the
    tool name). ``lookahead_writes``: also offer the check commands ``k`` steps ahead,
    after the next edit (module doc). ``max_candidates``: candidates per rule.
    """

    def __init__(
        self,
        label: Callable[[Action], str] | None = None,
        lookahead_writes: bool = False,
        max_candidates: int = 4,
        prior: float = 8.0,
    ) -> None:
        if max_candidates < 1:
            raise ConfigError(f"moves drafter: max_candidates must be >= 1, got {max_candidates}")
        self.label = label or _default_label
        self.lookahead_writes = lookahead_writes
        self.max_candidates = max_candidates
        self.prior = prior
        self._runners = dict(_DEFAULT_RUNNERS)
        self._forms: dict[str, list[str]] = {}
        self._pip = "pip"
        #: (rule, rank) -> (hits, candidates) on the training traces.
        self.rule_counts: dict[tuple[str, int], tuple[int, int]] = {}
        self._p_cache: dict[tuple[str, int], float] = {}
        self._p_next_write = 0.3
        self._index: HistoryIndex[_State] = HistoryIndex(_State, self._fold)

    def _fold(self, state: _State, i: int, turn: Turn) -> None:
        _fold(state, i, turn, self.label)

    def _state(self, history: History) -> _State:
        state = self._index.update(history)
        if state.task_paths is None:
            state.task_paths, state.task_files, state.task_commands = _task_info(history.task)
        return state

    # ---------------------------------------------------------------- candidates

    def _moves(self, state: _State) -> list[tuple[str, int, Action]]:
        """(rule, rank, action) candidates for the next action."""
        out: list[tuple[str, int, Action]] = []
        scripts = [p for p in state.last_written if _ext(p) in _SCRIPT_EXTS]
        for rank, path in enumerate(scripts[: self.max_candidates]):
            own = state.forms.get(_ext(path))
            runner = own[-1] if own else self._runners.get(_ext(path))
            if runner is not None:
                out.append(("run-written", rank, _bash(runner.format(path))))
        if scripts:
            ext, used = _ext(scripts[0]), {a.key for _, _, a in out}
            own = state.forms.get(ext, [])[::-1]
            rank = 0
            for form in dict.fromkeys([*own, *self._forms.get(ext, ())]):
                a = _bash(form.format(scripts[0]))
                if rank == _MAX_FORMS:
                    break
                if a.key not in used:
                    used.add(a.key)
                    out.append(("run-form", rank, a))
                    rank += 1
        pip = state.pip or self._pip
        for rank, package in enumerate(state.missing[: self.max_candidates]):
            out.append(("install-missing", rank, _bash(f"{pip} install {package}")))
        for rank, package in enumerate(state.pending[: self.max_candidates]):
            out.append(("split-install", rank, _bash(f"{pip} install {package}")))
        if state.last_written:
            checks = sorted(state.checks[::-1], key=lambda c: c.key not in state.failed)
            for rank, c in enumerate(checks[: self.max_candidates]):
                out.append(("check", rank, c))
        for rank, exe in enumerate(state.built):
            out.append(("run-built", rank, _bash(exe if "/" in exe else f"./{exe}")))
            runs = [c for c in state.task_commands if c.split()[0] in (exe, f"./{exe}")]
            for k, c in enumerate(runs[: self.max_candidates]):
                out.append(("run-built-task", k, _bash(c)))
        files = [p for p, kind in state.listed if kind == "-" and _ext(p) in _TEXT_EXTS]
        for rank, path in enumerate(files[: 2 * self.max_candidates]):
            out.append(("explore-file", rank, _bash(f"cat {path}")))
        older = sorted((p for p in state.unread if p not in files), key=lambda p: -state.unread[p])
        for rank, path in enumerate(older[: self.max_candidates]):
            out.append(("explore-unread", rank, _bash(f"cat {path}")))
        shown = [p for p in state.last_written if _ext(p) in _TEXT_EXTS and _ext(p) not in _SCRIPT_EXTS]
        for rank, path in enumerate(shown[: self.max_candidates]):
            out.append(("show-written", rank, _bash(f"cat {path}")))
        if state.ran_script is not None:
            # a script ran: the files the trajectory wrote besides it, read again (the test
            # ran, now the code it tested), and what the task asks for (the files it names,
            # the ones no viewer has shown yet first)
            again = sorted((p for p in state.written if p != state.ran_script and _ext(p) in _TEXT_EXTS and _ext(p)),
                           key=lambda p: -state.written[p])  # fmt: skip
            for rank, path in enumerate(again[: self.max_candidates]):
                out.append(("reread-written", rank, _bash(f"cat {path}")))
            named = [p for p in state.task_files if p != state.ran_script and p not in state.written]
            named.sort(key=lambda p: state.shown.get(p, -1))
            for rank, path in enumerate(named[: self.max_candidates]):
                out.append(("show-task-file", rank, _bash(f"cat {path}")))
        if state.task_paths:
            unseen = [p for p in state.task_paths if p not in state.seen]
            for rank, path in enumerate(unseen[: self.max_candidates]):
                if _ext(path) in _TEXT_EXTS and _ext(path):
                    out.append(("task-file", rank, _bash(f"cat {path}")))
                elif not _ext(path):
                    out.append(("task-dir", rank, _bash(f"ls -la {path}")))
                    out.append(("task-mkdir", rank, _bash(f"mkdir -p {path}")))
            parents = dict.fromkeys(posixpath.dirname(p) for p in state.task_paths)
            unlisted = [d for d in parents if d not in ("", "/") and d not in state.seen and d not in state.task_paths]
            for rank, path in enumerate(unlisted[:2]):
                out.append(("task-parent", rank, _bash(f"ls -la {path}")))
        dirs = [p for p, kind in state.listed if kind == "d"]
        for rank, path in enumerate(dirs[: self.max_candidates]):
            flags = f"ls {state.ls_flags} " if state.ls_flags else "ls "
            out.append(("explore-dir", rank, _bash(f"{flags}{path}/")))
            out.append(("explore-dir-bare", rank, _bash(f"{flags}{path}")))
        return out

    def _routed(self, state: _State, tool: str) -> list[tuple[str, int, Action]]:
        """(rule, rank, action) completions of program ``tool``."""
        out = [(f"routed-{r}", k, a) for r, k, a in self._moves(state) if self.label(a) == tool]
        files = sorted(set(state.written) | set(state.seen), key=lambda p: -max(state.written.get(p, -1), state.seen.get(p, -1)))
        rank = 0
        seen_keys = {a.key for _, _, a in out}
        for path in files:
            if rank >= self.max_candidates:
                break
            ext = _ext(path)
            runner = state.runners.get(ext) or self._runners.get(ext)
            if runner is not None and program_label(runner.format(path)) == tool:
                action = _bash(runner.format(path))
            elif tool in _VIEWERS and ext not in ("", "/"):
                action = _bash(f"{tool} {path}")
            else:
                continue
            if action.key not in seen_keys:
                seen_keys.add(action.key)
                out.append(("routed-file", rank, action))
                rank += 1
        for rank, a in enumerate(list(reversed(state.by_label.get(tool, ())))[: self.max_candidates]):
            if a.key not in seen_keys:
                seen_keys.add(a.key)
                out.append(("routed-earlier", rank, a))
        return out

    # ---------------------------------------------------------------- probabilities

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn how scripts are run (the most common form per kind of script, over the
        training trajectories), then each (rule, rank)'s hit rate on ``traces``."""
        runners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        interpreter_forms: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        pips: dict[str, int] = defaultdict(int)
        for trace in traces:
            state = _State()
            for i, step in enumerate(trace.steps):
                _fold(state, i, Turn(step.action, step.observation), self.label)
            for ext, r in state.runners.items():
                runners[ext][r] += 1
            for ext, used in state.forms.items():
                for f in used:
                    interpreter_forms[ext][f] += 1  # trajectories that ran scripts this way
            if state.pip:
                pips[state.pip] += 1
        self._runners = dict(_DEFAULT_RUNNERS)
        for ext, forms in runners.items():
            self._runners[ext] = max(forms, key=lambda f: (forms[f], f))
        self._forms = {
            ext: [f for f, _ in sorted(forms.items(), key=lambda x: (-x[1], x[0]))][:_MAX_FORMS]
            for ext, forms in interpreter_forms.items()
        }
        self._pip = max(pips, key=lambda p: (pips[p], p)) if pips else "pip"
        counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
        writes = after = 0
        for trace in traces:
            paths, files, commands = _task_info(trace.instruction or trace.task)
            state = _State(task_paths=paths, task_files=files, task_commands=commands)
            for i, step in enumerate(trace.steps):
                a = step.action
                for rule, rank, cand in self._moves(state):
                    c = counts[(rule, rank)]
                    c[0] += cand == a
                    c[1] += 1
                if not a.is_none:
                    for rule, rank, cand in self._routed(state, self.label(a)):
                        c = counts[(rule, rank)]
                        c[0] += cand == a
                        c[1] += 1
                if state.step and a.command is not None:
                    after += 1
                    writes += bool(written_paths(a.command))
                _fold(state, i, Turn(a, step.observation), self.label)
        self.rule_counts = {k: (v[0], v[1]) for k, v in counts.items()}
        self._p_cache = {}
        self._p_next_write = (writes + 1) / (after + 2)
        self._index = HistoryIndex(_State, self._fold)

    def _p(self, rule: str, rank: int) -> float:
        """The hit rate of ``rule``'s candidate of ``rank``: the (rule, rank) counts shrunk
        towards the rule's, shrunk towards all rules' of its kind (boundary or routed),
        ``prior`` pseudo-observations at each level."""
        found = self._p_cache.get((rule, rank))
        if found is None:
            found = self._p_cache[(rule, rank)] = self._estimate(rule, rank)
        return found

    def _estimate(self, rule: str, rank: int) -> float:
        routed = rule.startswith("routed-")
        h = n = hr = nr = 0
        for (r, _k), (hits, count) in self.rule_counts.items():
            if r.startswith("routed-") == routed:
                h, n = h + hits, n + count
            if r == rule:
                hr, nr = hr + hits, nr + count
        p = (h + 1) / (n + 2)
        p = (hr + self.prior * p) / (nr + self.prior)
        hk, nk = self.rule_counts.get((rule, rank), (0, 0))
        return (hk + self.prior * p) / (nk + self.prior)

    @staticmethod
    def _merge(items: list[tuple[Action, float]], offset: int) -> list[ActionDraft]:
        """One draft per action, at the highest of its rules' probabilities (the rules are
        far from independent: a noisy-or would overstate it)."""
        best: dict[str, tuple[Action, float]] = {}
        for a, p in items:
            if a.key not in best or p > best[a.key][1]:
                best[a.key] = (a, p)
        return [ActionDraft(a, offset, p) for a, p in best.values()]

    # ---------------------------------------------------------------- the seams

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if width <= 0:
            return []
        state = self._state(history)
        out = self._merge([(a, self._p(r, k)) for r, k, a in self._moves(state)], 0)
        frontier = [(state, d.action, d.probability) for d in sorted(out, key=lambda d: -d.probability)[:2]]
        for offset in range(1, min(depth, _MAX_LOOKAHEAD + 1)):
            # through read-only targets only (a target behind a write could never pass JASV):
            # the moves after each of the two most likely, as if it had run
            nxt: list[tuple[_State, Action, float]] = []
            for before, a, p in frontier:
                if a.command is None or classify_action(a) is not Effect.READ_ONLY:
                    continue
                after = _copy(before)
                _fold(after, after.step, Turn(a, ""), self.label)
                merged = self._merge([(b, p * self._p(r, k)) for r, k, b in self._moves(after)], offset)
                nxt += [(after, d.action, d.probability) for d in merged]
            nxt.sort(key=lambda x: -x[2])
            out += [ActionDraft(b, offset, q) for _, b, q in nxt[:width]]
            frontier = nxt[:2]
        if self.lookahead_writes and depth > 1 and state.checks:
            # after the next edit, the check commands again
            p_write = self._p_next_write
            for offset in range(1, min(depth, 10)):
                for rank, c in enumerate(state.checks[::-1][: self.max_candidates]):
                    p = p_write * self._p("check", rank) * (1 - p_write) ** (offset - 1)
                    out.append(ActionDraft(c, offset, p))
        out.sort(key=lambda d: (-d.probability, d.offset))
        return out[:width]

    async def propose_routed(self, history: History, tool: str, width: int) -> Sequence[ActionDraft]:
        """Completions of the program ``tool`` a router named for the action being decoded
        (offset 0, ``P(action | tool)`` as learned in :meth:`fit`), most likely first."""
        if width <= 0:
            return []
        state = self._state(history)
        drafts = self._merge([(a, self._p(r, k)) for r, k, a in self._routed(state, tool)], 0)
        drafts.sort(key=lambda d: (-d.probability, d.action.key))
        return drafts[:width]


#: A command line the task quotes: ``"./cli_tool weights.json image.png"``, `` `python x.py` ``.
_TASK_COMMAND = re.compile(r"[\"`]((?:\./[\w.-]+|python3?|bash|sh|node|make|pytest)(?: [^\"`\n]{1,200})?)[\"`]")
#: A file name with an extension the task names (``organization.json``, ``/app/ssl/server.pem``).
_TASK_FILE = re.compile(r"(?<![\w./-])((?:/|\./)?(?:[\w-]+/)*[\w-]+\.[A-Za-z]{1,5})(?![\w/-])")


@functools.lru_cache(maxsize=256)
def _task_info(task: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The task text's absolute paths (:func:`_task_paths`), the text files it names
    (relative ones too), and the command lines it quotes, each in order."""
    head = task[:20_000]
    files = dict.fromkeys(m.group(1) for m in _TASK_FILE.finditer(head) if _ext(m.group(1)) in _TEXT_EXTS)
    commands = dict.fromkeys(m.group(1).strip() for m in _TASK_COMMAND.finditer(head))
    return _task_paths(task), tuple(files), tuple(commands)


_TASK_PATH = re.compile(r"(?<![\w./-])((?:/|\./)?[\w.-]+(?:/[\w.-]+)*/?)(?![\w/-])")


@functools.lru_cache(maxsize=256)
def _task_paths(task: str) -> tuple[str, ...]:
    """Absolute paths (``/app/agent.py``, ``/app/data/``) the task text names, in order."""
    out: dict[str, None] = {}
    for m in _TASK_PATH.finditer(task[:20_000]):
        p = m.group(1).rstrip(".")
        if p.startswith("/") and p.count("/") >= 2 and not p.startswith("//") and len(p) <= 200:
            out[p.rstrip("/") or "/"] = None
    return tuple(out)


def _default_label(action: Action) -> str:
    cmd = action.command
    return action.tool if cmd is None else program_label(cmd)
