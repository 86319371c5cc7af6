"""Options shared by subcommands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_format_option", "add_trace_input_options", "load_trace_inputs", "print_fields", "print_json"]

#: Default of ``--max-file-mb`` (replay.io.MAX_FILE_BYTES in MiB; not imported, to keep --help light).
_DEFAULT_MAX_FILE_MB = 256
#: Skipped files named one per line on stderr before the rest are only counted.
_SKIPPED_LISTED = 20


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


def add_trace_input_options(parser: argparse.ArgumentParser) -> None:
    """``--skip-invalid`` and ``--max-file-mb`` for subcommands that read trace files."""
    parser.add_argument(
        "--skip-invalid",
        action="store_true",
        help="skip trace files that fail to import (each is named on stderr, the count goes in the summary) "
        "instead of stopping at the first bad set",
    )
    parser.add_argument(
        "--max-file-mb",
        type=float,
        default=_DEFAULT_MAX_FILE_MB,
        metavar="MIB",
        help=f"largest trace file to read, in MiB (default {_DEFAULT_MAX_FILE_MB})",
    )


def load_trace_inputs(paths: Sequence[Any], args: argparse.Namespace, *, format: str = "auto") -> Any:
    """Import ``paths`` under the options of :func:`add_trace_input_options`; returns a
    ``replay.io.LoadedTraces``. Skipped files are named on stderr (the first few, then a count)."""
    from aospec.errors import ConfigError, TraceImportError
    from replay.io import import_traces

    mib = args.max_file_mb
    if not (math.isfinite(mib) and mib > 0):
        raise ConfigError(f"--max-file-mb must be a positive number, got {mib:g}")
    try:
        loaded = import_traces(paths, format, max_file_bytes=max(1, int(mib * 2**20)), skip_invalid=args.skip_invalid)
    except TraceImportError as exc:
        if exc.hint and not args.skip_invalid:
            raise TraceImportError(exc.errors, hint="--skip-invalid imports the rest") from None
        raise
    for err in loaded.skipped[:_SKIPPED_LISTED]:
        print(f"aospec: skipped {err}", file=sys.stderr)
    if len(loaded.skipped) > _SKIPPED_LISTED:
        print(f"aospec: skipped {len(loaded.skipped) - _SKIPPED_LISTED} more invalid files", file=sys.stderr)
    return loaded
