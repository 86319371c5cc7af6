"""Canonical traces: reading, writing, importing and summarising agent trajectories.

``load_traces(paths)`` reads files and directories of every supported format (canonical
JSONL, tb1 step files, mini-swe-agent ``*.traj.json``, tau-bench trajectories);
``import_traces(paths, skip_invalid=True)`` also returns the bad files it skipped;
``write_jsonl``/``read_jsonl`` write and read the canonical JSONL of docs/trace-format.md;
``trace_stats`` summarises a trace set; ``bundled_traces_path()`` is the small tb1 sample
shipped in the package.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aospec.replay.io import FORMATS, LoadedTraces, dump_jsonl, import_traces, load_traces, read_jsonl, write_jsonl

if TYPE_CHECKING:
    from aospec.replay.stats import TraceStats, trace_stats

__all__ = [
    "FORMATS",
    "LoadedTraces",
    "TraceStats",
    "bundled_traces_path",
    "dump_jsonl",
    "import_traces",
    "load_traces",
    "read_jsonl",
    "trace_stats",
    "write_jsonl",
]


def bundled_traces_path() -> Path:
    """The directory of the tb1 sample bundled with the package (one run, see its NOTICE)."""
    return Path(str(resources.files("aospec.replay") / "data" / "tb1-sample"))


def __getattr__(name: str) -> Any:
    # aospec.replay.stats needs numpy: imported on first use, so the verbs register without it.
    if name in ("TraceStats", "trace_stats"):
        from aospec.replay import stats

        return getattr(stats, name)
    raise AttributeError(f"module 'aospec.replay' has no attribute {name!r}")
