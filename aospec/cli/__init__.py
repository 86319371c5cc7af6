"""The ``aospec`` command line: a dispatcher over verbs that packages register.

A verb is an entry point in the group ``aospec.commands`` whose object is a
``register(subparsers)`` callable: it adds its subcommand with ``subparsers.add_parser(...)``
and sets ``func`` (``parser.set_defaults(func=handler)``), a handler that takes the parsed
namespace and returns an exit status. aospec's own packages register their verbs this way
in pyproject.toml (``sweep``/``replay``/``traces`` by replay, ``train`` by training,
``sandbox``); any installed distribution can add one the same way (docs/architecture.md).
The dispatcher imports nothing above the engine: running a verb loads only that verb's
entry point; ``aospec --help`` loads them all. Handlers import heavy packages inside
themselves, so help stays fast.

A verb whose optional dependency is missing (``aospec run`` without httpx, ``aospec mcp``
without the MCP SDK) ends with one line naming the install (:func:`aospec._lazy.missing_extra`),
whether the import fails when the verb loads or when it runs; a mistyped option prints the
verb's usage, not the top level's; a file the verb cannot write (an unwritable working
directory) is one error line naming it.

Every verb runs inside :func:`aospec.signals.interrupt_on_signals`: SIGTERM and SIGHUP
take SIGINT's path (``KeyboardInterrupt``, or the cancellation asyncio, trio or uvicorn
start on SIGINT), so a verb that cleans up on Ctrl-C cleans up on ``kill`` too.

The output helpers a verb needs (``add_format_option``, ``print_json``, ``print_records``,
``print_fields``, ``print_table``) are exported here.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points

from aospec import __version__
from aospec._lazy import missing_extra
from aospec.cli._common import add_alias, add_format_option, print_fields, print_json, print_records, print_table
from aospec.errors import AospecError
from aospec.signals import interrupt_on_signals, interrupting_signal

__all__ = [
    "COMMANDS_GROUP",
    "CommandLoadError",
    "add_alias",
    "add_format_option",
    "build_parser",
    "command_entry_points",
    "main",
    "print_fields",
    "print_json",
    "print_records",
    "print_table",
]

#: The entry-point group of ``aospec`` verbs.
COMMANDS_GROUP = "aospec.commands"


class CommandLoadError(AospecError):
    """A verb's entry point could not be imported or failed to register."""


def command_entry_points() -> list[EntryPoint]:
    """The installed ``aospec.commands`` entry points, by verb name (one per name: when two
    distributions register the same name, aospec's own wins, else the first by distribution
    name, and the others are named in a warning)."""
    by_name: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=COMMANDS_GROUP):
        by_name.setdefault(ep.name, []).append(ep)
    chosen = []
    for name in sorted(by_name):
        eps = sorted(by_name[name], key=lambda ep: (_dist(ep) != "aospec", _dist(ep), ep.value))
        if len(eps) > 1:
            others = ", ".join(f"{ep.value} ({_dist(ep)})" for ep in eps[1:])
            _warn(f"command {name!r} is registered more than once; using {eps[0].value} ({_dist(eps[0])}), not {others}")
        chosen.append(eps[0])
    return chosen


def _dist(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "?"


def _warn(message: str) -> None:
    print(f"aospec: warning: {message}", file=sys.stderr)


def _register(ep: EntryPoint, sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    where = f"{ep.value}" + (f" from the {_dist(ep)} distribution" if _dist(ep) != "?" else "")
    try:
        register = ep.load()
    except Exception as exc:
        missing = missing_extra(exc, purpose=f"aospec {ep.name}")
        if missing is not None:
            raise CommandLoadError(str(missing)) from None
        raise CommandLoadError(f"command {ep.name!r} could not be loaded ({where}): {type(exc).__name__}: {exc}") from None
    if not callable(register):
        raise CommandLoadError(f"command {ep.name!r}: {where} is not a register(subparsers) callable")
    try:
        register(sub)
    except Exception as exc:
        raise CommandLoadError(f"command {ep.name!r} failed to register ({where}): {type(exc).__name__}: {exc}") from None


def _new_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser = argparse.ArgumentParser(
        prog="aospec",
        description="Co-speculate tool actions and observations to make LLM agents faster, losslessly.",
    )
    parser.add_argument("--version", action="version", version=f"aospec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, sub


def build_parser(commands: Iterable[EntryPoint] | None = None) -> argparse.ArgumentParser:
    """The parser with every verb of ``commands`` (default: the installed entry points). A
    verb that fails to load is left out with a warning on stderr."""
    parser, sub = _new_parser()
    eps = command_entry_points() if commands is None else list(commands)
    if not eps:
        _warn(f"no verbs registered under the {COMMANDS_GROUP!r} entry points: is aospec installed (pip install -e .)?")
    for ep in eps:
        try:
            _register(ep, sub)
        except CommandLoadError as exc:
            _warn(f"{exc}; left out")
    return parser


def _verb(argv: Sequence[str]) -> str | None:
    """The verb of a command line: its first argument that is not an option (the top-level
    parser's options take no value); None when top-level help comes first."""
    for a in argv:
        if a in ("-h", "--help"):
            return None
        if not a.startswith("-"):
            return a
    return None


def _innermost(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``argv`` names: ``aospec sandbox exec ...`` -> exec's."""
    for a in argv:
        subs = [x for x in parser._actions if isinstance(x, argparse._SubParsersAction)]
        if subs and a in subs[0].choices:
            parser = subs[0].choices[a]
    return parser


def main(argv: Sequence[str] | None = None, *, commands: Iterable[EntryPoint] | None = None) -> int:
    """Run ``aospec`` with ``argv`` (default: ``sys.argv[1:]``) over ``commands`` (default:
    the installed ``aospec.commands`` entry points); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    eps = command_entry_points() if commands is None else list(commands)
    verb = _verb(argv)
    mine = [ep for ep in eps if ep.name == verb]
    if mine:
        parser, sub = _new_parser()
        try:
            _register(mine[0], sub)
        except CommandLoadError as exc:
            print(f"aospec: error: {exc}", file=sys.stderr)
            return 2
    else:
        parser = build_parser(eps)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse leaves a subcommand's unknown options to the top-level parser, whose usage
        # says nothing about the verb: the verb's own parser reports them
        _innermost(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with interrupt_on_signals():  # SIGTERM and SIGHUP clean up as Ctrl-C does (aospec.signals)
            return int(args.func(args) or 0)
    except AospecError as exc:
        print(f"aospec: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        missing = missing_extra(exc, purpose=f"aospec {args.command}")
        if missing is None:
            raise
        print(f"aospec: error: {missing}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        # e.g. results/ in an unwritable working directory: one line naming the path
        where = f"cannot access {os.path.abspath(exc.filename)}: " if isinstance(exc.filename, str) else ""
        print(f"aospec: error: {where}{exc.strerror or exc} (for output, --out chooses another place)", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = interrupting_signal(exc)
        if signum == signal.SIGINT:
            print("aospec: interrupted", file=sys.stderr)
        else:
            print(f"aospec: terminated by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
