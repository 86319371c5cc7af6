"""The ``aospec`` command line.

Each module ``aospec/cli/<name>.py`` (not starting with ``_``) contributes subcommands
through ``register(subparsers)``; handlers set with ``parser.set_defaults(func=...)``
take the parsed namespace and return an exit status. Modules import heavy packages only
inside their handlers, so ``aospec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from aospec import __version__
from aospec.errors import AospecError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aospec",
        description="Co-speculate tool actions and observations to make LLM agents faster, losslessly.",
    )
    parser.add_argument("--version", action="version", version=f"aospec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AospecError as exc:
        print(f"aospec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aospec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
