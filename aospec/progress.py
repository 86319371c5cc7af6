"""Rich progress bars for long work, quiet when stderr is not a terminal unless forced."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["progress", "track"]

T = TypeVar("T")

_console = Console(stderr=True)


@contextmanager
def progress(*, disable: bool | None = None) -> Iterator[Progress]:
    """A rich Progress on stderr; disabled by default when stderr is not a terminal."""
    if disable is None:
        disable = not sys.stderr.isatty()
    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console,
        disable=disable,
        transient=False,
    )
    with bar:
        yield bar


def track(items: Iterable[T], description: str, total: int | None = None, *, disable: bool | None = None) -> Iterator[T]:
    """Iterate ``items`` with a progress bar."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    with progress(disable=disable) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
