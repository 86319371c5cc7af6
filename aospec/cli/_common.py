"""Options shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_format_option", "print_fields", "print_json"]


def add_format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="table: human-readable (default); json: machine-readable JSON on stdout",
    )


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def print_fields(fields: dict[str, Any], fmt: str, *, width: int) -> None:
    """``fields`` as one JSON object (``--format json``) or one ``key value`` line each,
    keys padded to ``width``."""
    if fmt == "json":
        print_json(fields)
    else:
        for k, v in fields.items():
            print(f"{k:{width}} {v}")
