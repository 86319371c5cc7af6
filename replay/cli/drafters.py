"""``aospec drafters calibration``: how honest the drafters' probabilities are.

    aospec drafters calibration [PATH...] [--bundled] [--drafters patterns,cache,trajectory,history,moves]
        [--folds 4] [--bins 10] [--out DIR] [--format table|json]

Each drafter is fit on all but one fold of the traces (folds group tasks) and scores the
held-out fold's steps (true histories): every draft is an outcome (its probability, and
whether it was exactly right; :mod:`aospec.drafters.calibration`). The verb prints, per
drafter and probability bucket, the drafts' mean predicted probability and their observed
hit rate, both raw and after a :class:`~aospec.drafters.calibration.Calibration` fit on
the *other* folds' outcomes, and writes into ``--out``: ``calibration.json`` (the
calibration fit on every outcome, for a cost controller: ``Calibration.load``),
``reliability.jsonl`` (the table) and ``calibration.png`` (reliability diagrams).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aospec.replay.cli import add_input_limits, add_trace_inputs, load_trace_inputs, trace_sources

from aospec.cli import add_format_option, print_json, print_table

__all__ = ["register"]

_DEFAULT_DRAFTERS = "patterns,cache,trajectory,history,moves"


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``drafters`` verb (an ``aospec.commands`` entry point)."""
    parser = subparsers.add_parser(
        "drafters",
        help="evaluate drafters on traces (calibration of their probabilities)",
        description="Evaluate observation and action drafters on traces (docs/drafters.md).",
    )
    sub = parser.add_subparsers(dest="drafters_command", required=True, metavar="SUBCOMMAND")
    cal = sub.add_parser(
        "calibration",
        help="predicted against observed hit rate per probability bucket, and a fitted calibration",
        description=__doc__.split("\n\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_inputs(cal, paths_help="traces (files or directories)", bundled_help="the tb1 sample bundled with aospec")
    cal.add_argument(
        "--drafters",
        default=_DEFAULT_DRAFTERS,
        help=f"comma-separated registry names, observation or action drafters (default {_DEFAULT_DRAFTERS})",
    )
    cal.add_argument("--folds", type=int, default=4, help="cross-fitting folds, grouped by task (default 4)")
    cal.add_argument("--bins", type=int, default=10, help="probability buckets of the table (default 10)")
    cal.add_argument("--min-count", type=int, default=20, help="fewest outcomes of a calibration cell (default 20)")
    cal.add_argument("--out", default="calibration-out", metavar="DIR", help="output directory (default ./calibration-out)")
    cal.add_argument(
        "--drafter-options", default=None, metavar="JSON", help='options per drafter name, e.g. \'{"moves": {"prior": 4}}\''
    )
    add_input_limits(cal)
    add_format_option(cal)
    cal.set_defaults(func=_calibration)


def _kinds(names: list[str]) -> list[tuple[str, str]]:
    from aospec.drafters import ACTION_DRAFTERS, OBSERVATION_DRAFTERS

    from aospec.errors import ConfigError

    out = []
    for name in names:
        if name in OBSERVATION_DRAFTERS and name not in ACTION_DRAFTERS:
            out.append((name, "observation"))
        elif name in ACTION_DRAFTERS and name not in OBSERVATION_DRAFTERS:
            out.append((name, "action"))
        elif name in OBSERVATION_DRAFTERS:
            out += [(name, "observation"), (name, "action")]
        else:
            known = ", ".join(sorted({*OBSERVATION_DRAFTERS, *ACTION_DRAFTERS}))
            raise ConfigError(f"--drafters: unknown drafter {name!r}; known: {known}")
    return out


def _calibration(args: argparse.Namespace) -> int:
    from aospec.drafters.calibration import Calibration, cross_fit_outcomes, expected_calibration_error, reliability
    from aospec.replay.cli.sweep import _drafter_options
    from aospec.replay.policies import DrafterSet

    from aospec.errors import ConfigError

    if args.folds < 2 or args.bins < 1 or args.min_count < 1:
        raise ConfigError("--folds must be >= 2, --bins >= 1 and --min-count >= 1")
    sources = trace_sources(args, missing="no traces: give PATH... or --bundled")
    traces = list(load_trace_inputs(sources, args).traces)
    if len({t.task for t in traces}) < 2:
        raise ConfigError("calibration needs traces of at least two tasks (drafters are scored on tasks they were not fit on)")
    names = [n.strip() for n in args.drafters.split(",") if n.strip()]
    probe = DrafterSet((), _drafter_options(args.drafter_options))
    outcomes: dict[str, list[list[Any]]] = {}
    for name, kind in _kinds(names):
        probe.construct(f"{kind} drafter", name, labelled=True)  # a bad option fails before any fitting

        def make(kind: str = kind, name: str = name) -> Any:
            return probe.construct(f"{kind} drafter", name, labelled=True)

        label = name if len([n for n, _ in _kinds([name])]) == 1 else f"{name}:{kind}"
        outcomes[label] = cross_fit_outcomes(make, label, kind, traces, folds=args.folds)
    everything = [o for folds in outcomes.values() for part in folds for o in part]
    if not everything:
        raise ConfigError("the drafters made no drafts on these traces")
    # the calibration's own check: each fold's outcomes are judged by a calibration fit on
    # the other folds' outcomes
    predicted: dict[int, float] = {}
    for folds in outcomes.values():
        for j, part in enumerate(folds):
            cal = Calibration.fit([o for jj, p in enumerate(folds) if jj != j for o in p], min_count=args.min_count)
            predicted.update((id(o), cal.p(o.drafter, o.tool, o.distance, o.raw)) for o in part)
    raw_rows = reliability(everything, lambda o: o.raw, bins=args.bins)
    cal_rows = reliability(everything, lambda o: predicted[id(o)], bins=args.bins)
    final = Calibration.fit(everything, min_count=args.min_count)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [final.save(out)]
    records = [{"kind": "raw", **_row(r)} for r in raw_rows] + [{"kind": "calibrated", **_row(r)} for r in cal_rows]
    rel = out / "reliability.jsonl"
    import json

    rel.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    written.append(rel)
    written.append(_plot(raw_rows, cal_rows, out / "calibration.png"))
    ece_raw = expected_calibration_error(raw_rows)
    ece_cal = expected_calibration_error(cal_rows)
    flat = {name: [o for part in folds for o in part] for name, folds in outcomes.items()}
    summary = {
        "traces": len(traces),
        "tasks": len({t.task for t in traces}),
        "folds": len(next(iter(outcomes.values()))),
        "outcomes": {name: len(group) for name, group in flat.items()},
        "hit_rate": {name: sum(o.hit for o in group) / len(group) if group else None for name, group in flat.items()},
        "ece_raw": ece_raw,
        "ece_calibrated": ece_cal,
        "buckets": records,
        "files": [str(p) for p in written],
    }
    if args.format == "json":
        print_json(summary)
        return 0
    from rich.table import Table

    table = Table(
        title="drafter calibration: predicted vs observed hit rate per bucket (cross-fit by task)",
        caption="raw: the drafts whose own probability fell in the bucket; calibrated: those whose calibrated "
        "probability (a calibration fit on the other folds) did",
    )
    for col in ("drafter", "bucket", "drafts", "predicted", "observed", "cal. drafts", "cal. predicted", "cal. observed"):
        table.add_column(col, justify="left" if col == "drafter" else "right")
    raw_by = {(r.drafter, r.low): r for r in raw_rows}
    cal_by = {(r.drafter, r.low): r for r in cal_rows}
    order = {name: k for k, name in enumerate(outcomes)}
    for key in sorted(raw_by.keys() | cal_by.keys(), key=lambda k: (order.get(k[0], 0), k[1])):
        r, c = raw_by.get(key), cal_by.get(key)
        high = (r or c).high  # type: ignore[union-attr]
        table.add_row(
            key[0],
            f"{key[1]:.1f}-{high:.1f}",
            *([str(r.count), f"{r.predicted:.3f}", f"{r.observed:.3f}"] if r else ["", "", ""]),
            *([str(c.count), f"{c.predicted:.3f}", f"{c.observed:.3f}"] if c else ["", "", ""]),
        )
    print_table(table)
    for name in outcomes:
        raw, cal = ece_raw.get(name), ece_cal.get(name)
        if raw is not None:
            print(f"{name}: {len(flat[name])} drafts, expected calibration error {raw:.3f} raw, {cal:.3f} calibrated")
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0


def _row(r: Any) -> dict[str, Any]:
    return {"drafter": r.drafter, "low": r.low, "high": r.high, "count": r.count, "predicted": r.predicted, "observed": r.observed}


def _plot(raw_rows: list[Any], cal_rows: list[Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(dict.fromkeys(r.drafter for r in raw_rows))
    cols = min(3, len(drafters))
    rows = (len(drafters) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.6 * rows), squeeze=False)
    for k, name in enumerate(drafters):
        ax = axes[k // cols][k % cols]
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for rows_, label in ((raw_rows, "raw"), (cal_rows, "calibrated")):
            mine = [r for r in rows_ if r.drafter == name]
            ax.plot([r.predicted for r in mine], [r.observed for r in mine], marker="o", ms=3, label=label)
        ax.set_title(name, fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted hit probability", fontsize=8)
        ax.set_ylabel("observed hit rate", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for k in range(len(drafters), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
