"""Reports of a sweep: results JSONL, a markdown summary, PNG plots and a terminal table.

``aospec sweep`` streams: :class:`ResultsFile` appends each trace's records to
``results.jsonl`` (flushed) as the trace finishes, so the driver holds no records and an
interrupted sweep leaves every finished trace on disk; when the sweep completes it
rewrites the file in trace order (the order :func:`aospec.replay.sweep.run_sweep` returns), from
the file itself. The summary is then computed by reading the file back
(:func:`read_results`, one record at a time) and :func:`write_summary` writes
summary.md, summary.jsonl and the plots from it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from aospec.replay.metrics import PolicySummary
from aospec.replay.sweep import TraceResult

__all__ = [
    "PLOTS",
    "ResultsFile",
    "drafter_failure_note",
    "drafter_sections",
    "markdown_summary",
    "legend_outside",
    "print_drafter_tables",
    "print_table",
    "read_results",
    "saving_figure",
    "state_model_caption",
    "write_report",
    "write_summary",
]

#: Files written by :func:`write_report` besides results.jsonl and summary.md.
PLOTS = (
    "saving_vs_tpot.png",
    "latency_percentiles.png",
    "hidden_tool_time.png",
    "hit_rates.png",
    "waste.png",
    "drafter_accuracy.png",
)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f}%"


def _focus_tpot(summaries: Sequence[PolicySummary], want: float = 10.0) -> float:
    tpots = sorted({s.tpot_ms for s in summaries})
    return min(tpots, key=lambda t: (abs(t - want), t))


_HEADER = (
    "policy",
    "TPOT ms",
    "traces",
    "mean saving",
    "ceiling",
    "p50 s",
    "p99 s",
    "hidden tool s",
    "obs hit",
    "action hit",
    "wasted tool s",
)


def _header(summaries: Sequence[PolicySummary]) -> tuple[str, ...]:
    """The table's columns; "canonical hit" only when some policy accepts canonically,
    "drafter fails" only when some drafting call failed."""
    header = _HEADER
    if any(s.obs_canonical_hit_rate for s in summaries):
        header = (*header[:9], "canonical hit", *header[9:])
    if any(s.drafter_failures for s in summaries):
        header = (*header, "drafter fails")
    return header


def state_model_caption(summaries: Sequence[PolicySummary]) -> str:
    """``state model: NAME: what it means`` for the summaries' state model ("" when empty)."""
    from aospec.replay.sandbox import STATE_MODEL_MEANING

    if not summaries:
        return ""
    model = summaries[0].state_model
    return f"state model: {model}: {STATE_MODEL_MEANING.get(model, 'unknown')}"


def drafter_failure_note(summaries: Sequence[PolicySummary]) -> str | None:
    """One line on failed drafting calls (None when there were none)."""
    failed = [s for s in summaries if s.drafter_failures]
    if not failed:
        return None
    total = sum(s.drafter_failures for s in failed)
    policies = list(dict.fromkeys(s.policy for s in failed))
    return (
        f"{total} drafting calls failed and lost their candidates (policies: {', '.join(policies)}); "
        f"first error: {failed[0].drafter_error}"
    )


def _row(s: PolicySummary, columns: Sequence[str] = _HEADER) -> list[str]:
    row = [
        s.policy,
        f"{s.tpot_ms:g}",
        str(s.traces),
        _pct(s.mean_saving),
        _pct(s.mean_ceiling_saving),
        f"{s.p50_s:.1f}",
        f"{s.p99_s:.1f}",
        f"{s.hidden_tool_s:.1f}",
        _pct(s.obs_hit_rate),
        _pct(s.action_hit_rate),
        f"{s.wasted_tool_s:.1f}",
    ]
    if "canonical hit" in columns:
        row.insert(9, _pct(s.obs_canonical_hit_rate))
    if "drafter fails" in columns:
        row.append(str(s.drafter_failures))
    return row


def markdown_summary(summaries: Sequence[PolicySummary], meta: dict[str, Any]) -> str:
    """The summary as markdown: settings, the per-(policy, TPOT) table, latency quantiles."""
    lines = ["# aospec replay sweep", ""]
    for k, v in meta.items():
        lines.append(f"- {k}: {v}")
    model = summaries[0].state_model if summaries else ""
    lines += ["", f"## Savings, latency, hidden time, hit rates, waste (state model: {model})", ""]
    header = _header(summaries)
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for s in summaries:
        lines.append("| " + " | ".join(_row(s, header)) + " |")
    focus = _focus_tpot(summaries)
    lines += ["", f"## Per-trial latency at {focus:g} ms/token (seconds)", ""]
    lines.append("| policy | p50 | p90 | p95 | p99 | serial p50 | serial p99 |")
    lines.append("|---|---|---|---|---|---|---|")
    for s in summaries:
        if s.tpot_ms == focus:
            lines.append(
                f"| {s.policy} | {s.p50_s:.1f} | {s.p90_s:.1f} | {s.p95_s:.1f} | {s.p99_s:.1f} "
                f"| {s.serial_p50_s:.1f} | {s.serial_p99_s:.1f} |"
            )
    for title, header, rows, note in drafter_sections(summaries):
        lines += ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", note]
    unknown = max((s.unknown_tool_steps for s in summaries), default=0)
    lines += [
        "",
        "mean saving: mean over traces of 1 - latency/serial; ceiling: the same for the policy's "
        "matching ceiling (same engine configuration, oracle drafters). hidden tool s: tool time that "
        "ran while the actor decoded, summed over traces. Hit rates are per executed step; obs hit counts "
        "byte-identical drafts, canonical hit (policies with accept=canonical) drafts equal only once "
        "canonicalised.",
        f"Steps with unknown tool time (counted as 0 s): {unknown}.",
        f"{state_model_caption(summaries)[:1].upper()}{state_model_caption(summaries)[1:]}; policies and their "
        "ceilings are replayed under it (docs/replay.md, 'State models').",
        "",
    ]
    note = drafter_failure_note(summaries)
    if note:
        lines[-1:-1] = [f"drafter fails: {note}."]
    return "\n".join(lines)


def _rate(x: float, n: int | None = None) -> str:
    if math.isnan(x):
        return "-"
    return f"{100 * x:.1f}%" + (f" ({n})" if n is not None else "")


def drafter_sections(summaries: Sequence[PolicySummary]) -> list[tuple[str, list[str], list[list[str]], str]]:
    """The paper's drafter figures as tables: (title, header, rows, note) for time hidden
    per trial by policy and TPOT, observation exact hits by call length, and action
    accuracy by width and by distance (the last three from the focus TPOT's summaries:
    they do not depend on the TPOT). Tables without a row are left out."""
    from aospec.replay.accuracy import CALL_BUCKET_LABELS, DISTANCES, WIDTHS

    out = []
    tpots = sorted({s.tpot_ms for s in summaries}, reverse=True)
    by = {(s.policy, s.tpot_ms): s for s in summaries}
    policies = list(dict.fromkeys(s.policy for s in summaries))
    speculating = [p for p in policies if any(by[(p, t)].hidden_s_per_trace > 0 for t in tpots if (p, t) in by)]
    if speculating:
        rows = [[p, *[f"{by[(p, t)].hidden_s_per_trace:.1f}" if (p, t) in by else "" for t in tpots]] for p in speculating]
        out.append((
            "Time hidden per trial (s)",
            ["policy", *[f"{t:g} ms" for t in tpots]],
            rows,
            "(hidden tool + hidden decode time) / trials: what speculation overlapped. Compare the ranking rules with "
            "`--policies aospec,aospec:rank=likelihood,aospec:rank=tooltime` (EVD ranks by p(c) * T(c)).",
        ))
    focus = _focus_tpot(summaries)
    at = [by[(p, focus)] for p in policies if (p, focus) in by]
    obs = [s for s in at if s.obs_exact_by_length]
    if obs:
        rows = []
        for s in obs:
            calls = list(s.obs_calls_by_length)
            hits = sum(r * n for r, n in zip(s.obs_exact_by_length, calls, strict=True) if not math.isnan(r))
            total = sum(calls)
            rows.append([s.policy, *[_rate(r, n) for r, n in zip(s.obs_exact_by_length, calls, strict=True)],
                         _rate(hits / total if total else float("nan"), total)])
        out.append((
            "Observation exact hits by call length (drafters on the recorded history)",
            ["policy", *CALL_BUCKET_LABELS, "all"],
            rows,
            "The recorded observation among the drafts the policy would continue (its branch budget, its ranking), "
            "per recorded tool time; (n) steps in the bucket.",
        ))
    act = [s for s in at if s.action_accuracy_by_width]
    if act:
        out.append((
            "Action accuracy by width (next action within the top w targets)",
            ["policy", *[str(w) for w in WIDTHS]],
            [[s.policy, *[_rate(x) for x in s.action_accuracy_by_width]] for s in act],
            "At every boundary of the recorded history, the policy's action drafters' offset-0 targets, most "
            "probable first.",
        ))
        out.append((
            "Action accuracy by distance (the action d steps ahead within the top 8 at that offset)",
            ["policy", *[str(d) for d in DISTANCES]],
            [[s.policy, *[_rate(x) for x in s.action_accuracy_by_distance]] for s in act],
            "Distance 1 is the next action. A target behind a step that writes passes JASV only if the state model "
            "lets it (docs/replay.md, State models).",
        ))
    return out


def print_drafter_tables(summaries: Sequence[PolicySummary]) -> None:
    """:func:`drafter_sections` on stdout (rich tables that fit the terminal)."""
    from rich.table import Table

    from aospec.cli import print_table as print_fitted

    for title, header, rows, note in drafter_sections(summaries):
        table = Table(title=title, caption=note)
        for h in header:
            table.add_column(h, justify="left" if h == "policy" else "right")
        for r in rows:
            table.add_row(*r)
        print_fitted(table, key_columns=1)


def print_table(summaries: Sequence[PolicySummary]) -> None:
    """The summary table on stdout (rich; at most 100 columns wide for the usual policies, in
    column groups that fit a narrower terminal)."""
    from rich import box
    from rich.table import Table

    from aospec.cli import print_table as print_fitted

    model = summaries[0].state_model if summaries else ""
    traces = sorted({s.traces for s in summaries})
    n = f"{traces[0]} traces" if len(traces) == 1 else "traces per row in summary.md"
    table = Table(
        title=f"aospec replay (state model: {model}): saving vs serial per policy and TPOT in ms, {n}",
        caption=state_model_caption(summaries),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
    )
    header = _header(summaries)
    # The terminal's table: short headers (summary.md has the long ones), and the trace count
    # in the title when every row has the same, so that it fits 100 columns
    shown = [i for i, h in enumerate(header) if not (h == "traces" and len(traces) == 1)]
    for i in shown:
        h = header[i]
        if h == "policy":
            table.add_column(h, justify="left", overflow="fold", max_width=28)
        else:
            table.add_column(_SHORT.get(h, h), justify="right")
    last = None
    for s in summaries:
        if last is not None and s.tpot_ms != last:
            table.add_section()
        last = s.tpot_ms
        row = _row(s, header)
        table.add_row(*(row[i] for i in shown))
    print_fitted(table, key_columns=2)


#: The terminal table's headers (:func:`print_table`), by summary.md's.
_SHORT = {
    "TPOT ms": "TPOT",
    "mean saving": "saving",
    "hidden tool s": "hidden s",
    "action hit": "act hit",
    "wasted tool s": "wasted s",
    "canonical hit": "canon hit",
}


def _plots(summaries: Sequence[PolicySummary], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(s.policy for s in summaries))
    tpots = sorted({s.tpot_ms for s in summaries}, reverse=True)
    by = {(s.policy, s.tpot_ms): s for s in summaries}
    focus = _focus_tpot(summaries)
    written: list[Path] = []

    fig = saving_figure(summaries)
    written.append(out / PLOTS[0])
    fig.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    def bars(values: dict[str, list[float]], labels: Sequence[str], ylabel: str, title: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(policies) + 2), 4.5))
        width = 0.8 / max(1, len(labels))
        for k, label in enumerate(labels):
            ax.bar([i + k * width for i in range(len(policies))], values[label], width, label=label)
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(policies))])
        ax.set_xticklabels(policies, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        if len(labels) > 1:
            legend_outside(ax)
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)

    at = [by.get((p, focus)) for p in policies]
    qs = {"p50": "p50_s", "p90": "p90_s", "p95": "p95_s", "p99": "p99_s"}
    bars(
        {q: [getattr(s, f) if s else 0.0 for s in at] for q, f in qs.items()},
        list(qs),
        "per-trial latency (s)",
        f"Per-trial latency percentiles at {focus:g} ms/token",
        PLOTS[1],
    )
    tl = [f"{t:g} ms" for t in tpots]
    bars(
        {f"{t:g} ms": [by[(p, t)].hidden_tool_s if (p, t) in by else 0.0 for p in policies] for t in tpots},
        tl,
        "tool time hidden (s, all traces)",
        "Tool time hidden behind decoding",
        PLOTS[2],
    )
    rates = {
        "observation hit rate": [100 * s.obs_hit_rate if s else 0.0 for s in at],
        "action hit rate": [100 * s.action_hit_rate if s else 0.0 for s in at],
    }
    if any(s.obs_canonical_hit_rate for s in summaries):
        rates["canonical hit rate"] = [100 * s.obs_canonical_hit_rate if s else 0.0 for s in at]
    bars(
        rates,
        list(rates),
        "% of executed steps",
        f"Speculation hit rates at {focus:g} ms/token",
        PLOTS[3],
    )
    bars(
        {
            "wasted tool s": [s.wasted_tool_s if s else 0.0 for s in at],
            "wasted decode s": [s.wasted_decode_s if s else 0.0 for s in at],
        },
        ["wasted tool s", "wasted decode s"],
        "seconds (all traces)",
        f"Wasted speculative work at {focus:g} ms/token",
        PLOTS[4],
    )
    written.append(_accuracy_plot([s for s in at if s is not None], out / PLOTS[5]))
    return written


def legend_outside(ax: Any) -> Any:
    """The axes' legend to the right of its plotting area, where it covers no point or bar."""
    return ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def saving_figure(summaries: Sequence[PolicySummary]) -> Any:
    """Mean saving vs TPOT per policy: the x ticks are the TPOTs the sweep measured (the
    fastest model on the right), the legend outside the plotting area."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(s.policy for s in summaries))
    tpots = sorted({s.tpot_ms for s in summaries}, reverse=True)
    by = {(s.policy, s.tpot_ms): s for s in summaries}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for p in policies:
        xs = [t for t in tpots if (p, t) in by]
        ax.plot(xs, [100 * by[(p, t)].mean_saving for t in xs], marker="o", label=p)
    ax.set_xticks(tpots, [f"{t:g}" for t in tpots])
    ax.set_xlabel("TPOT (ms per output token)")
    ax.set_ylabel("mean end-to-end saving vs serial (%)")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    legend_outside(ax)
    ax.set_title("Saving vs model speed")
    fig.tight_layout()
    return fig


def _accuracy_plot(at: Sequence[PolicySummary], path: Path) -> Path:
    """Action accuracy vs width and distance, observation exact hits by call length."""
    import matplotlib.pyplot as plt
    from aospec.replay.accuracy import CALL_BUCKET_LABELS, DISTANCES, WIDTHS

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    # one colour per policy in all three panels, so that one legend (below them) names them all
    color = {s.policy: f"C{i % 10}" for i, s in enumerate(at)}
    act = [s for s in at if s.action_accuracy_by_width]
    for s in act:
        c = color[s.policy]
        axes[0].plot(WIDTHS, [100 * x for x in s.action_accuracy_by_width], marker="o", ms=3, color=c, label=s.policy)
        axes[1].plot(DISTANCES, [100 * x for x in s.action_accuracy_by_distance], marker="o", ms=3, color=c, label=s.policy)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("width (targets)")
    axes[0].set_ylabel("next-action accuracy (%)")
    axes[1].set_xlabel("distance (steps ahead, top 8)")
    axes[1].set_ylabel("action accuracy (%)")
    obs = [s for s in at if s.obs_exact_by_length]
    width = 0.8 / max(1, len(obs))
    for k, s in enumerate(obs):
        vals = [0.0 if math.isnan(x) else 100 * x for x in s.obs_exact_by_length]
        axes[2].bar(
            [i + k * width for i in range(len(CALL_BUCKET_LABELS))], vals, width, color=color[s.policy], label=s.policy
        )
    axes[2].set_xticks([i + width * (len(obs) - 1) / 2 for i in range(len(CALL_BUCKET_LABELS))], CALL_BUCKET_LABELS)
    axes[2].set_ylabel("observation exact hits (%)")
    axes[2].set_xlabel("recorded call length")
    for ax, title in zip(axes, ("Action accuracy vs width", "Action accuracy vs distance", "Observation exact hits"), strict=True):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    named: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            named.setdefault(label, handle)
    fig.tight_layout()
    if named:
        fig.legend(list(named.values()), list(named), fontsize=8, loc="upper center", ncol=min(5, len(named)),
                   bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(
    out_dir: str | Path, results: Sequence[TraceResult], summaries: Sequence[PolicySummary], meta: dict[str, Any]
) -> list[Path]:
    """Write results.jsonl, summary.md and the PNG plots into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with ResultsFile(out / "results.jsonl") as f:
        f.add(0, results)
        f.finish()
    return [out / "results.jsonl", *write_summary(out, summaries, meta)]


def write_summary(out_dir: str | Path, summaries: Sequence[PolicySummary], meta: dict[str, Any]) -> list[Path]:
    """Write summary.md, summary.jsonl and the PNG plots into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "summary.md", out / "summary.jsonl"]
    written[0].write_text(markdown_summary(summaries, meta), encoding="utf-8")
    with written[1].open("w", encoding="utf-8") as f:
        for s in summaries:
            f.write(json.dumps(s.to_json()) + "\n")
    written += _plots(summaries, out)
    return written


class ResultsFile:
    """``results.jsonl`` written as a sweep goes: :meth:`add` appends one trace's records
    (one JSON object a line) and flushes them; :meth:`finish` rewrites the file with the
    traces in index order. The driver keeps only each trace's offset and length in the
    file (two integers), never a record.

    Until :meth:`finish` the records are in the order their traces finished (what an
    interrupted sweep leaves); after it, in the order :func:`aospec.replay.sweep.run_sweep`
    returns them (trace, then TPOT, then policy), byte for byte the same whatever the
    executor.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: Any = None
        self._spans: dict[int, tuple[int, int]] = {}
        self.records = 0

    def open(self) -> None:
        """Create (or empty) the file now; :meth:`add` does it on its first call otherwise."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("wb")

    def add(self, index: int, results: Sequence[TraceResult]) -> None:
        """Append trace ``index``'s results (a trace is added once)."""
        self.open()
        if index in self._spans:
            raise ValueError(f"trace {index} added twice")
        data = "".join(json.dumps(r.to_json()) + "\n" for r in results).encode("utf-8")
        offset = self._file.tell()
        self._file.write(data)
        self._file.flush()
        self._spans[index] = (offset, len(data))
        self.records += len(results)

    def finish(self) -> Path:
        """Rewrite the file in trace order (through a temporary file beside it, then an
        atomic rename) and close it."""
        self.open()
        self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with self.path.open("rb") as src, tmp.open("wb") as dst:
            for index in sorted(self._spans):
                offset, length = self._spans[index]
                src.seek(offset)
                dst.write(src.read(length))
        os.replace(tmp, self.path)
        self._spans.clear()
        return self.path

    def close(self) -> None:
        """Close the file as it stands (finished traces, in the order they finished)."""
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


_FIELDS = TraceResult.__slots__  # type: ignore[attr-defined]


def read_results(path: str | Path) -> Iterator[TraceResult]:
    """The records of a ``results.jsonl``, one at a time, as TraceResults."""
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                yield TraceResult(
                    **{k: tuple(record[k]) if isinstance(record[k], list) else record[k] for k in _FIELDS if k in record}
                )
