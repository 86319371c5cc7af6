"""Output helpers of the ``aospec`` verbs (re-exported by :mod:`aospec.cli` for packages that
add verbs): the ``--format`` option, JSON output, and tables that fit the terminal."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["add_alias", "add_format_option", "print_fields", "print_json", "print_records", "print_table"]

#: Width of one group of a table too wide for the terminal is at least this.
_MIN_GROUP_WIDTH = 40


def add_alias(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Accept ``old``, an option's deprecated spelling, as ``new`` (an option ``parser`` has):
    hidden from help, the same action and destination, and a one-line warning on stderr
    naming ``new`` when used. Kept for one release after the rename (docs/cli.md)."""
    action = next((a for a in parser._actions if new in a.option_strings), None)
    if action is None:
        raise ValueError(f"{parser.prog}: no option {new} to alias as {old}")
    alias = copy.copy(action)
    alias.option_strings, alias.help, alias.default, alias.required = [old], argparse.SUPPRESS, argparse.SUPPRESS, False
    cls = type(action)

    def call(self: argparse.Action, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"aospec: warning: {old} is deprecated, use {new}", file=sys.stderr)
        cls.__call__(self, parser, namespace, values, option)

    alias.__class__ = type(f"Deprecated{cls.__name__}", (cls,), {"__call__": call})
    parser._add_action(alias)


def add_format_option(parser: argparse.ArgumentParser, *, records: bool = False) -> None:
    """``--format table|json`` (and ``jsonl`` when the verb prints a list of ``records``)."""
    if records:
        parser.add_argument(
            "--format",
            choices=("table", "json", "jsonl"),
            default="table",
            help="table: human-readable (default); json: one JSON document (an array) on stdout; "
            "jsonl: JSON Lines, one object per line",
        )
    else:
        parser.add_argument(
            "--format",
            choices=("table", "json"),
            default="table",
            help="table: human-readable (default); json: machine-readable JSON on stdout",
        )


def print_json(obj: Any) -> None:
    """``obj`` as one line of JSON on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def print_records(records: Iterable[Any], fmt: str) -> None:
    """``records`` (JSON-ready objects) as one JSON array (``json``) or one object per line
    (``jsonl``)."""
    if fmt == "jsonl":
        for r in records:
            sys.stdout.write(json.dumps(r, sort_keys=False) + "\n")
    else:
        items = list(records)
        sys.stdout.write("[\n" + ",\n".join(json.dumps(r, sort_keys=False) for r in items) + ("\n]\n" if items else "]\n"))
    sys.stdout.flush()


def print_fields(fields: dict[str, Any], fmt: str, *, width: int) -> None:
    """``fields`` as one JSON object (``--format json``) or one ``key value`` line each,
    keys padded to ``width``."""
    if fmt == "json":
        print_json(fields)
    else:
        for k, v in fields.items():
            print(f"{k:{width}} {v}")


def print_table(table: Any, *, key_columns: int = 1, console: Any = None) -> None:
    """Print a ``rich.table.Table`` so that no cell is cut.

    On a terminal narrower than the table, headers wrap at spaces and, when that is not
    enough, the columns are printed in groups that fit, one below the other, each group
    repeating the first ``key_columns`` columns. Written to a file or a pipe, the table
    keeps its natural width.
    """
    from rich.console import Console
    from rich.measure import Measurement

    if console is None:
        console = Console() if sys.stdout.isatty() else Console(width=100_000)
    width = max(console.width, _MIN_GROUP_WIDTH)
    wide = Console(width=100_000)

    def measure(renderable: Any) -> Measurement:
        return Measurement.get(wide, wide.options, renderable)

    if measure(table).maximum <= width:
        console.print(table)
        return
    # Each column as narrow as its widest cell or its header's longest word: only headers wrap.
    widths = [
        max([measure(col.header).minimum, *(measure(c).maximum for c in col._cells)]) for col in table.columns
    ]
    keys = list(range(min(key_columns, len(table.columns))))
    groups: list[list[int]] = []
    current = list(keys)
    for i in range(len(keys), len(table.columns)):
        if len(current) > len(keys) and measure(_subtable(table, [*current, i], widths, title=False)).maximum > width:
            groups.append(current)
            current = list(keys)
        current.append(i)
    groups.append(current)
    for n, group in enumerate(groups):
        console.print(_subtable(table, group, widths, title=n == 0))


def _subtable(table: Any, columns: list[int], widths: list[int], *, title: bool) -> Any:
    """A copy of ``table`` with only ``columns`` (indices) at ``widths``, its title only when
    ``title``."""
    import copy

    sub = copy.copy(table)
    sub.columns = [
        dataclasses.replace(table.columns[c], _index=k, _cells=list(table.columns[c]._cells), width=widths[c])
        for k, c in enumerate(columns)
    ]
    sub.rows = list(table.rows)
    if not title:
        sub.title = None
    return sub
