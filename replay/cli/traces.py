"""``aospec traces``: summarise trace sets and convert them to the canonical JSONL.

    aospec traces stats [PATH...] [--bundled] [--format table|json] [--plot tool-time.png]
    aospec traces convert [PATH...] [--bundled] -o OUT.jsonl [--format table|json]

PATH is any mix of files and directories in a supported format (canonical JSONL, tb1
step files, mini-swe-agent ``*.traj.json``, tau-bench trajectories), detected per file
unless ``--input-format`` names one; ``--bundled`` adds the tb1 sample bundled with aospec
(as for ``sweep`` and ``replay``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aospec.replay.cli import add_input_format, add_input_limits, add_trace_inputs, load_trace_inputs, trace_sources

from aospec.cli import add_format_option, print_json, print_table

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "traces",
        help="summarise and convert agent traces",
        description="Summarise agent trace sets and convert them to aospec's canonical JSONL (docs/trace-format.md).",
    )
    sub = parser.add_subparsers(dest="traces_command", required=True, metavar="SUBCOMMAND")

    stats = sub.add_parser(
        "stats",
        help="trials, steps, tool-time distribution, tokens and effect classes of a trace set",
        description=(
            "Print the size, tool-time distribution (p50/p90/p99 with numpy's linear method over steps "
            "whose tool time is known; share of tool time in calls >= 1 s), output tokens and filesystem "
            "effect classes of the traces under PATH."
        ),
    )
    _add_inputs(stats)
    add_format_option(stats)
    stats.add_argument("--plot", metavar="PNG", type=Path, help="also plot the tool-time distribution to this PNG")
    stats.set_defaults(func=_stats)

    convert = sub.add_parser(
        "convert",
        help="write traces of any supported format as canonical JSONL",
        description="Import the traces under PATH and write them, sorted by id, as one canonical JSONL file.",
    )
    _add_inputs(convert)
    convert.add_argument("-o", "--output", required=True, metavar="OUT", help="output .jsonl file ('-' for stdout)")
    add_format_option(convert)
    convert.set_defaults(func=_convert)


def _add_inputs(parser: argparse.ArgumentParser) -> None:
    add_trace_inputs(
        parser,
        paths_help="trace files or directories (searched recursively)",
        bundled_help="also read the tb1 sample bundled with aospec",
    )
    add_input_format(parser)
    add_input_limits(parser)


def _sources(args: argparse.Namespace) -> list[Any]:
    return trace_sources(args, missing="no traces: give PATH... or --bundled (the tb1 sample bundled with aospec)")


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} s" if v < 100 else f"{v:,.0f} s"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _stats(args: argparse.Namespace) -> int:
    from aospec.replay import trace_stats

    sources = _sources(args)
    loaded = load_trace_inputs(sources, args, format=args.input_format)
    traces = list(loaded.traces)
    stats = trace_stats(traces)
    plot = _plot(traces, stats, args.plot) if args.plot else None
    skipped = len(loaded.skipped) if args.skip_invalid else None
    if args.format == "json":
        out: dict[str, Any] = stats.to_json()
        out["paths"] = [str(p) for p in sources]
        if skipped is not None:
            out["skipped_files"] = skipped
            out["skipped"] = [str(e) for e in loaded.skipped]
        if plot:
            out["plot"] = str(plot)
        print_json(out)
        return 0
    _print_table(stats, [str(p) for p in sources], plot, skipped)
    return 0


def _print_table(stats: Any, paths: list[str], plot: Path | None, skipped: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Traces: {', '.join(paths)}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("trials", f"{stats.trials}"),
        ("steps", f"{stats.steps}"),
        ("tasks", f"{stats.tasks}"),
        ("harnesses", ", ".join(f"{k} ({v})" for k, v in stats.harnesses.items())),
        ("actor models", ", ".join(f"{k} ({v})" for k, v in stats.actor_models.items())),
        ("steps with tool time", f"{stats.timed_steps} ({stats.untimed_steps} unknown, excluded)"),
        ("tool time p50 / p90 / p99", " / ".join(_fmt_s(v) for v in (stats.tool_time_p50_s, stats.tool_time_p90_s, stats.tool_time_p99_s))),
        ("tool time mean / max / total", " / ".join(_fmt_s(v) for v in (stats.tool_time_mean_s, stats.tool_time_max_s, stats.tool_time_total_s))),
        (f"calls >= {stats.long_call_threshold_s:g} s", f"{stats.long_calls} ({_fmt_pct(stats.long_call_share)} of calls)"),
        (f"tool time in calls >= {stats.long_call_threshold_s:g} s", _fmt_pct(stats.long_call_time_share)),
        ("model latency p50", _fmt_s(stats.model_latency_p50_s)),
        ("output tokens", f"{stats.output_tokens:,} ({stats.output_tokens_counted:,} counted, {stats.output_tokens_estimated:,} estimated)"),
        ("read-only steps", f"{stats.read_only_steps}"),
        ("may-change steps", f"{stats.may_change_steps}"),
        ("effects recorded / classified", f"{stats.effects_recorded} / {stats.effects_classified}"),
        ("incomplete steps", f"{stats.incomplete_steps}"),
    ]  # fmt: skip
    if skipped is not None:
        rows.insert(0, ("invalid files skipped", f"{skipped}"))
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    print_table(table)
    if len(stats.tools) > 1:
        tools = Table(title="Steps by tool", title_justify="left")
        tools.add_column("tool")
        tools.add_column("steps", justify="right")
        for name, n in sorted(stats.tools.items(), key=lambda kv: (-kv[1], kv[0])):
            tools.add_row(name, str(n))
        print_table(tools)
    console.print(f"Quantiles: {stats.quantile_method}.")
    if plot:
        console.print(f"Plot: {plot}")


def _plot(traces: list, stats: Any, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from aospec.replay.stats import tool_durations

    d = np.sort(tool_durations(traces))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if d.size:
        floor = max(float(d[d > 0].min()) if (d > 0).any() else 1e-3, 1e-3)
        x = np.maximum(d, floor)
        ax1.step(x, np.arange(1, d.size + 1) / d.size, where="post")
        marks = (("p50", stats.tool_time_p50_s), ("p90", stats.tool_time_p90_s), ("p99", stats.tool_time_p99_s))
        for k, (q, v) in enumerate(marks):
            ax1.axvline(max(v, floor), linestyle="--", linewidth=0.8, color="grey")
            ax1.annotate(f"{q} {v:.3g} s", (max(v, floor), 0.05 + 0.12 * k), fontsize=8)
        share = np.cumsum(d[::-1])[::-1] / d.sum() if d.sum() > 0 else np.zeros_like(d)
        ax2.step(x, share, where="post")
        ax2.axvline(stats.long_call_threshold_s, linestyle="--", linewidth=0.8, color="grey")
        for ax in (ax1, ax2):
            ax.set_xscale("log")
            ax.set_xlabel("tool time per call (s)")
            ax.grid(True, which="both", alpha=0.3)
    ax1.set_ylabel("fraction of calls <= x")
    ax1.set_title(f"Tool-time CDF ({stats.timed_steps} calls, {stats.trials} trials)")
    ax2.set_ylabel("share of total tool time in calls >= x")
    ax2.set_title("Where tool time goes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _convert(args: argparse.Namespace) -> int:
    from aospec.replay import dump_jsonl, write_jsonl

    loaded = load_trace_inputs(_sources(args), args, format=args.input_format)
    traces = loaded.traces
    steps = sum(len(t) for t in traces)
    if args.output == "-":
        sys.stdout.write(dump_jsonl(traces))
        sys.stdout.flush()
        if args.skip_invalid:
            print(f"aospec: {len(loaded.skipped)} invalid files skipped", file=sys.stderr)
        return 0
    out = write_jsonl(traces, args.output)
    if args.format == "json":
        summary: dict[str, Any] = {"traces": len(traces), "steps": steps, "output": str(out)}
        if args.skip_invalid:
            summary["skipped_files"] = len(loaded.skipped)
            summary["skipped"] = [str(e) for e in loaded.skipped]
        print_json(summary)
    else:
        from rich.console import Console

        note = f"; {len(loaded.skipped)} invalid files skipped" if args.skip_invalid else ""
        Console().print(f"Wrote {len(traces)} traces ({steps} steps) to {out}{note}")
    return 0
