"""The ``aospec`` verbs of the replay package, registered as ``aospec.commands`` entry points
(pyproject.toml): ``sweep`` and ``replay`` (:mod:`aospec.replay.cli.sweep`), ``traces``
(:mod:`aospec.replay.cli.traces`).

Every verb that reads traces takes them the same way (:func:`add_trace_inputs`): PATHs (files
or directories, any supported format) and/or ``--bundled`` (the tb1 sample shipped with
aospec); without either it is an error that says so.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from aospec.replay._input import MAX_FILE_BYTES

from aospec.errors import ConfigError, TraceImportError

__all__ = ["INPUT_FORMATS", "add_input_format", "add_input_limits", "add_trace_inputs", "load_trace_inputs", "trace_sources"]

#: The choices of ``--input-format``.
INPUT_FORMATS = ("auto", "aospec", "tb1", "mini-swe-agent", "tau-bench")
#: Default of ``--max-file-mb``.
_DEFAULT_MAX_FILE_MB = MAX_FILE_BYTES // 2**20
#: Skipped files named one per line on stderr before the rest are only counted.
_SKIPPED_LISTED = 20


def add_trace_inputs(parser: argparse.ArgumentParser, *, bundled_help: str, paths_help: str) -> None:
    """PATH... and ``--bundled``: the traces a verb reads."""
    parser.add_argument("paths", nargs="*", metavar="PATH", help=paths_help)
    parser.add_argument("--bundled", action="store_true", help=bundled_help)


def trace_sources(args: argparse.Namespace, *extra: Sequence[Any], missing: str) -> list[Any]:
    """The PATHs, then ``extra`` lists (e.g. ``--eval``), then the bundled sample when
    ``--bundled``; ConfigError ``missing`` when there are none."""
    from aospec.replay import bundled_traces_path

    sources: list[Any] = list(args.paths)
    for more in extra:
        sources.extend(more)
    if args.bundled:
        sources.append(bundled_traces_path())
    if not sources:
        raise ConfigError(missing)
    return sources


def add_input_format(parser: argparse.ArgumentParser) -> None:
    """``--input-format``: the format of every trace input (default: detect each file)."""
    parser.add_argument(
        "--input-format",
        choices=INPUT_FORMATS,
        default="auto",
        help="format of the inputs (default: detect each file)",
    )


def add_input_limits(parser: argparse.ArgumentParser) -> None:
    """``--skip-invalid`` and ``--max-file-mb`` for verbs that read trace files."""
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


def load_trace_inputs(
    paths: Sequence[Any], args: argparse.Namespace, *, format: str = "auto", as_refs: bool = False
) -> Any:
    """Import ``paths`` under the options of :func:`add_input_limits`; returns a
    :class:`aospec.replay.io.LoadedTraces`. Skipped files are named on stderr (the first few, then a count).
    With ``as_refs`` each trace is kept as a :class:`aospec.replay.sweep.TraceRef` (id, task, step
    count, file): the caller holds no steps, and whoever replays a trace reads it then."""
    from aospec.replay.io import import_traces

    mib = args.max_file_mb
    if not (math.isfinite(mib) and mib > 0):
        raise ConfigError(f"--max-file-mb must be a positive number, got {mib:g}")
    max_bytes = max(1, int(mib * 2**20))
    keep = None
    if as_refs:
        from aospec.replay.sweep import TraceRef

        def keep(trace: Any, file: Any) -> Any:
            return TraceRef.of(trace, file, format, max_file_bytes=max_bytes)

    try:
        loaded = import_traces(paths, format, max_file_bytes=max_bytes, skip_invalid=args.skip_invalid, keep=keep)
    except TraceImportError as exc:
        if exc.hint and not args.skip_invalid:
            raise TraceImportError(exc.errors, hint="--skip-invalid imports the rest") from None
        raise
    for err in loaded.skipped[:_SKIPPED_LISTED]:
        print(f"aospec: skipped {err}", file=sys.stderr)
    if len(loaded.skipped) > _SKIPPED_LISTED:
        print(f"aospec: skipped {len(loaded.skipped) - _SKIPPED_LISTED} more invalid files", file=sys.stderr)
    return loaded
