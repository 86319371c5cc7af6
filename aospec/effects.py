"""Which actions can change the filesystem.

``step_effect(step)`` trusts what the recorder knew (``state_changed``, or exact version
hashes before/after) and otherwise classifies the action with ``classify_action``. The
classifier is conservative: it answers ``Effect.READ_ONLY`` only when it can show that
the action cannot write to the filesystem, and ``Effect.MAY_CHANGE`` whenever it is
unsure.

Shell commands (tool ``bash``) are read-only when every simple command in them is on a
read-only allowlist (``ls``, ``cat``, ``grep``, ``find`` without ``-delete``/``-exec``,
``git status``/``diff``/``log``, ``sed`` without ``-i`` and without ``w``/``e`` commands,
...), no output is redirected to a file other than ``/dev/null``, there is no
heredoc, and every command substitution (``$(...)``, backticks, ``<(...)``) is itself
read-only. The command is lexed by :mod:`aospec.shell` (split on ``;``, ``&&``, ``||``,
``|``, ``&``, newlines and parentheses after quote-aware tokenisation); whatever the lexer
cannot follow is MAY_CHANGE.

Other tools: the non-action (``Action.none()``) and a reply to the user (``respond``) are
read-only; tools named ``get_*``, ``search_*``, ``list_*``, ``calculate`` and ``think``
(tau-bench's read-only tools) are read-only; any other tool may change state.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from aospec.shell import (
    SUBSTITUTION,
    ShellSyntaxError,
    extract_substitutions,
    redirection,
    simple_commands,
    tokens,
)
from aospec.types import Action, Effect, Step

__all__ = ["classify_action", "classify_command", "step_effect"]


def step_effect(step: Step) -> Effect:
    """The filesystem effect of a recorded step: recorded knowledge first, else the classifier."""
    if step.state_changed is not None:
        return Effect.MAY_CHANGE if step.state_changed else Effect.READ_ONLY
    if step.version_before is not None and step.version_after is not None:
        return Effect.READ_ONLY if step.version_before == step.version_after else Effect.MAY_CHANGE
    return classify_action(step.action)


_READ_ONLY_TOOLS = frozenset(("none", "respond", "calculate", "think"))
_READ_ONLY_TOOL_PREFIXES = ("get_", "search_", "list_")


def classify_action(action: Action) -> Effect:
    """Whether ``action`` can change the filesystem (conservative: unsure -> MAY_CHANGE)."""
    if action.tool == "bash":
        cmd = action.command
        if cmd is None or set(action.args) != {"command"}:
            return Effect.MAY_CHANGE
        return classify_command(cmd)
    if action.tool in _READ_ONLY_TOOLS or action.tool.startswith(_READ_ONLY_TOOL_PREFIXES):
        return Effect.READ_ONLY
    return Effect.MAY_CHANGE


class _Unsure(Exception):
    """The command cannot be shown read-only."""


@functools.lru_cache(maxsize=8192)
def classify_command(command: str) -> Effect:
    """Classify one shell command line (which may hold several commands)."""
    try:
        _check_command(command, depth=0)
    except (_Unsure, ShellSyntaxError, RecursionError):  # RecursionError: absurdly nested wrappers (env env env ...)
        return Effect.MAY_CHANGE
    return Effect.READ_ONLY


# ---------------------------------------------------------------- redirections and commands

_MAX_DEPTH = 8


def _check_redirect_op(op: str) -> None:
    redir = redirection(op)
    if "<<" in redir and "<<<" not in redir:
        raise _Unsure  # heredoc: its body usually feeds a write
    if "<>" in redir:
        raise _Unsure  # opens the file read-write (creating it)


def _check_redirect(op: str, target: tuple[str, bool] | None) -> None:
    redir = redirection(op)
    if ">" not in redir:
        if target is None or target[1]:
            raise _Unsure
        return  # input redirection or here-string
    if target is None or target[1]:
        raise _Unsure
    word = target[0]
    if redir.endswith(">&") and (word.isdigit() or word == "-"):
        return  # duplicates a file descriptor
    if word == "/dev/null":
        return
    raise _Unsure


# fmt: off
_ALWAYS_READ_ONLY = frozenset((
    "ls", "cat", "head", "tail", "grep", "egrep", "fgrep", "zgrep", "wc", "pwd", "echo", "printf",
    "which", "type", "whereis", "stat", "du", "df", "nl", "cut", "cmp", "diff", "md5sum", "sha1sum",
    "sha224sum", "sha256sum", "sha384sum", "sha512sum", "b2sum", "cksum", "printenv", "whoami", "id",
    "uname", "ps", "pgrep", "true", "false", "test", "[", "[[", ":", "basename", "dirname", "realpath",
    "readlink", "seq", "sleep", "od", "hexdump", "strings", "column", "tr", "rev", "tac", "paste",
    "join", "comm", "fold", "fmt", "expand", "unexpand", "jq", "free", "uptime", "nproc", "lscpu",
    "lsblk", "lsof", "groups", "locale", "getconf", "arch", "tty", "cd", "pushd", "popd", "export",
    "unset", "alias", "set", "shopt", "exit", "return", "wait", "zcat", "bzcat", "xzcat", "ss",
    "netstat", "ip", "hash", "sort", "uniq", "date", "read", "mapfile", "readarray", "let", "declare",
    "local", "typeset", "break", "continue", "shift",
))
# fmt: on
_SYSTEM_BIN_DIRS = frozenset(("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin"))
_KEYWORDS = frozenset(("{", "}", "!", "then", "do", "else", "fi", "done", "if", "while", "until", "elif", "time"))
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\])?\+?=")


def _check_command(command: str, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise _Unsure
    subs: list[str] = []
    flat = extract_substitutions(command, subs)
    for inner in subs:
        _check_command(inner, depth + 1)
    for simple in simple_commands(tokens(flat)):
        for op, target in simple.redirects:
            _check_redirect_op(op)
            _check_redirect(op, target)
        _check_simple(simple.words)


def _check_simple(words: list[str]) -> None:
    i = 0
    while i < len(words) and (words[i] in _KEYWORDS or _ASSIGNMENT.match(words[i])):
        i += 1
    words = words[i:]
    if not words:
        return
    name = words[0]
    args = words[1:]
    if name in ("for", "select"):
        if len(args) >= 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", args[0]) and (len(args) == 1 or args[1] == "in"):
            return
        raise _Unsure
    directory, _, base = name.rpartition("/")
    if directory in _SYSTEM_BIN_DIRS:
        name = base
    if name == SUBSTITUTION or "/" in name:
        raise _Unsure
    checker = _CHECKERS.get(name)
    if checker is not None:
        checker(args)
    elif name in _ALWAYS_READ_ONLY:
        _extra_checks(name, args)
    else:
        raise _Unsure


def _short_flags(args: list[str]) -> set[str]:
    """Letters of short options, e.g. {'n', 'i'} for ['-ni', 'x']."""
    out: set[str] = set()
    for a in args:
        if a == "--":
            break
        if a.startswith("-") and not a.startswith("--") and len(a) > 1:
            out.update(a[1:])
    return out


def _long(args: list[str], *names: str) -> bool:
    return any(a.split("=", 1)[0] in names for a in args if a.startswith("--"))


def _positionals(args: list[str], with_value: frozenset[str] = frozenset()) -> list[str]:
    out: list[str] = []
    skip = False
    rest = False
    for a in args:
        if skip:
            skip = False
            continue
        if rest or a == "-" or not a.startswith("-"):
            out.append(a)
        elif a == "--":
            rest = True
        elif a in with_value:
            skip = True
    return out


def _extra_checks(name: str, args: list[str]) -> None:
    """Allowlisted commands that still have a writing option."""
    if name in ("sort",) and ("o" in _short_flags(args) or _long(args, "--output")):
        raise _Unsure
    if name == "uniq" and len(_positionals(args, frozenset(("-f", "-s", "-w")))) > 1:
        raise _Unsure  # uniq INPUT OUTPUT writes OUTPUT
    if name == "date" and ("s" in _short_flags(args) or _long(args, "--set")):
        raise _Unsure
    if name == "ip" and any(a in ("add", "del", "delete", "set", "change", "replace", "flush") for a in args):
        raise _Unsure
    if name == "hash" and args:
        raise _Unsure


def _check_find(args: list[str]) -> None:
    bad = ("-delete", "-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fprint0", "-fprintf", "-fls")
    if any(a in bad for a in args):
        raise _Unsure


def _check_tree(args: list[str]) -> None:
    if "-o" in args or any(a.startswith("-o") and len(a) > 2 and not a.startswith("--") for a in args):
        raise _Unsure


def _check_file(args: list[str]) -> None:
    if "C" in _short_flags(args) or _long(args, "--compile"):
        raise _Unsure


def _check_rg(args: list[str]) -> None:
    if _long(args, "--pre"):
        raise _Unsure


def _check_hostname(args: list[str]) -> None:
    if _positionals(args) or _long(args, "--file") or "F" in _short_flags(args):
        raise _Unsure


def _check_env(args: list[str]) -> None:
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-i", "--ignore-environment", "-0", "--null", "-"):
            i += 1
        elif a in ("-u", "--unset"):
            i += 2
        elif a.startswith("--unset=") or _ASSIGNMENT.match(a):
            i += 1
        elif a.startswith("-"):
            raise _Unsure
        else:
            break
    if i < len(args):
        _check_simple(args[i:])


def _check_command_builtin(args: list[str]) -> None:
    if args and args[0] in ("-v", "-V"):
        return
    if args and args[0].startswith("-"):
        raise _Unsure
    if args:
        _check_simple(args)


def _check_exec_like(args: list[str]) -> None:
    if args and args[0].startswith("-"):
        raise _Unsure
    if args:
        _check_simple(args)


def _check_timeout(args: list[str]) -> None:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        a = args[i]
        if a in ("-s", "--signal", "-k", "--kill-after"):
            i += 2
        elif a in ("--preserve-status", "--foreground", "-v", "--verbose") or a.startswith(
            ("--signal=", "--kill-after=")
        ):
            i += 1
        else:
            raise _Unsure
    if i >= len(args):
        raise _Unsure
    _check_simple(args[i + 1 :] or ["true"])


def _check_nice(args: list[str]) -> None:
    i = 0
    if args and args[0] in ("-n", "--adjustment"):
        i = 2
    elif args and re.fullmatch(r"-(n)?-?\d+|--adjustment=-?\d+", args[0]):
        i = 1
    if i < len(args):
        _check_simple(args[i:])


_XARGS_VALUE = frozenset(("-I", "-i", "-n", "-P", "-L", "-l", "-d", "-E", "-e", "-s", "--max-args", "--max-procs"))
_XARGS_FLAG = frozenset(("-0", "--null", "-r", "--no-run-if-empty", "-t", "--verbose", "-x", "--exit"))


def _check_xargs(args: list[str]) -> None:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        a = args[i]
        if a in _XARGS_FLAG:
            i += 1
        elif a in _XARGS_VALUE:
            i += 2
        elif a[:2] in _XARGS_VALUE and len(a) > 2 and not a.startswith("--"):
            i += 1  # -n1, -I{}
        elif a.split("=", 1)[0] in _XARGS_VALUE and "=" in a:
            i += 1
        else:
            raise _Unsure
    _check_simple(args[i:] or ["echo"])


_GIT_READ_ONLY = frozenset(("status", "diff", "log", "show", "rev-parse", "ls-files", "branch"))
# -c is refused: config can name programs git runs (diff.external, core.pager, ...)
_GIT_GLOBAL_VALUE = frozenset(("-C", "--git-dir", "--work-tree", "--namespace"))
_GIT_GLOBAL_FLAG = frozenset(("--no-pager", "-P", "--no-optional-locks", "--bare", "--no-replace-objects"))
_GIT_BRANCH_LIST_FLAGS = frozenset(
    (
        "-a", "--all", "-r", "--remotes", "-v", "-vv", "--verbose", "--list", "-l", "--show-current",
        "--no-color", "--color", "--merged", "--no-merged", "--contains", "--no-contains", "--sort",
        "--points-at", "--format", "--column", "--no-column", "-i", "--ignore-case", "--abbrev", "--no-abbrev",
        "-q", "--quiet",
    )
)  # fmt: skip


def _check_git(args: list[str]) -> None:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        a = args[i]
        if a in _GIT_GLOBAL_VALUE:
            i += 2
        elif a in _GIT_GLOBAL_FLAG or a.split("=", 1)[0] in _GIT_GLOBAL_VALUE:
            i += 1
        else:
            raise _Unsure
    if i >= len(args):
        return  # plain `git` prints usage
    sub, rest = args[i], args[i + 1 :]
    if sub not in _GIT_READ_ONLY:
        raise _Unsure
    if _long(rest, "--output") or any(a.startswith("--ext-diff") or a == "--textconv" for a in rest):
        raise _Unsure
    if sub == "branch":
        listing = "--list" in rest or "-l" in rest
        for a in rest:
            if a.startswith("-"):
                if a.split("=", 1)[0] not in _GIT_BRANCH_LIST_FLAGS:
                    raise _Unsure
            elif not listing:
                raise _Unsure  # `git branch NAME` creates a branch


_SED_SIMPLE_CMDS = set("pdDqQ=nNlhHgGxzF{}!")
_SED_TO_EOL_CMDS = set("aic")  # text output only, to the end of the line
_SED_LABEL_CMDS = set(":btT")


def _sed_script_read_only(script: str) -> bool:
    """True when a sed script has no w/W/e/r-to-exec command and no s///w or s///e flag."""
    i, n = 0, len(script)

    def skip_regex(j: int, delim: str) -> int:
        while j < n:
            if script[j] == "\\":
                j += 2
                continue
            if script[j] == delim:
                return j + 1
            j += 1
        raise _Unsure

    try:
        while i < n:
            c = script[i]
            if c in " \t\n;":
                i += 1
                continue
            # addresses
            if c.isdigit() or c == "$":
                i += 1
                while i < n and (script[i].isdigit() or script[i] in "~,+$"):
                    i += 1
                continue
            if c == "/":
                i = skip_regex(i + 1, "/")
                while i < n and script[i] in "IM":
                    i += 1
                continue
            if c == "\\" and i + 1 < n:
                i = skip_regex(i + 2, script[i + 1])
                continue
            if c in ",+~":
                i += 1
                continue
            if c in _SED_SIMPLE_CMDS:
                i += 1
                continue
            if c in _SED_TO_EOL_CMDS or c in "rR":
                j = script.find("\n", i)
                i = n if j < 0 else j + 1
                continue
            if c in _SED_LABEL_CMDS:
                i += 1
                while i < n and script[i] not in ";\n}":
                    i += 1
                continue
            if c in "sy":
                if i + 1 >= n or script[i + 1] in "\\\n":
                    return False
                d = script[i + 1]
                i = skip_regex(i + 2, d)
                i = skip_regex(i, d)
                if c == "s":
                    while i < n and script[i] not in ";\n}":
                        if script[i] not in "gpiImM0123456789 \t":
                            return False  # w FILE or e
                        i += 1
                continue
            return False  # w, W, e, v, unknown
    except _Unsure:
        return False
    return True


def _check_sed(args: list[str]) -> None:
    scripts: list[str] = []
    positional: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-e", "--expression"):
            if i + 1 >= len(args):
                raise _Unsure
            scripts.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--expression="):
            scripts.append(a.split("=", 1)[1])
        elif a.startswith("--"):
            if a.split("=", 1)[0] not in (
                "--quiet",
                "--silent",
                "--regexp-extended",
                "--posix",
                "--null-data",
                "--separate",
                "--unbuffered",
                "--debug",
                "--sandbox",
            ) and not a.startswith("--line-length="):
                raise _Unsure  # --in-place, --file, ...
        elif a.startswith("-") and len(a) > 1:
            flags = a[1:]
            for k, ch in enumerate(flags):
                if ch in "nrEsuz":
                    continue
                if ch == "e":
                    rest = flags[k + 1 :]
                    if rest:
                        scripts.append(rest)
                    else:
                        if i + 1 >= len(args):
                            raise _Unsure
                        scripts.append(args[i + 1])
                        i += 1
                    break
                if ch == "l":
                    if not flags[k + 1 :]:
                        i += 1  # -l N: N is the option's value, not the script
                    break
                raise _Unsure  # -i (in place), -f (script file), unknown
        else:
            positional.append(a)
        i += 1
    if not scripts:
        if not positional:
            raise _Unsure
        scripts.append(positional[0])
    if not all(_sed_script_read_only(s) for s in scripts):
        raise _Unsure


_AWK_WRITE = re.compile(r"\bprintf?\b[^;{}\n]*>|\|")


def _check_awk(args: list[str]) -> None:
    program: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-F", "-v", "--field-separator", "--assign"):
            i += 2
            continue
        if a.startswith(("-F", "-v", "--field-separator=", "--assign=")):
            i += 1
            continue
        if a == "--":
            i += 1
            if i < len(args):
                program = args[i]
            break
        if a.startswith("-") and a != "-":
            raise _Unsure  # -f progfile, -i inplace, profiling and dump options write files
        program = a
        break
    if program is None:
        raise _Unsure
    if "system" in program or "getline" in program or _AWK_WRITE.search(program):
        raise _Unsure


_CHECKERS: dict[str, Callable[[list[str]], None]] = {
    "find": _check_find,
    "tree": _check_tree,
    "file": _check_file,
    "rg": _check_rg,
    "hostname": _check_hostname,
    "env": _check_env,
    "command": _check_command_builtin,
    "exec": _check_exec_like,
    "builtin": _check_exec_like,
    "timeout": _check_timeout,
    "nice": _check_nice,
    "xargs": _check_xargs,
    "git": _check_git,
    "sed": _check_sed,
    "awk": _check_awk,
    "gawk": _check_awk,
    "mawk": _check_awk,
}
