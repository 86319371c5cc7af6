"""``aospec routers``: fit the intent routers and the Markov prefetcher on training traces and
score them on held-out traces.

    aospec routers eval --train-traces DIR --eval DIR [--format table|json|jsonl] [--gamma N]
    aospec routers eval PATH... [--bundled] [--eval-fraction 0.5] [--seed 0]   # split by task
    aospec routers eval ... --gamma-sweep                                    # keyword router, gamma 1..4

One record per router (``keyword``, ``tfidf``, ``parse``) and assembly (``union``,
``intersection``, ``weighted`` of keyword and TF-IDF; ``union+parse``: keyword, TF-IDF and
parse, the learned guesses gated by the Markov next-tool prior at ``--min-prior``;
``union+parse(no-prior)``: the same without the gate), with ``micro_f1``,
``precision``, ``recall``, ``top3_hit``, ``coverage``, ``fire_position_mean``/``_p50`` and
``us_per_token`` (aospec.specbox.routers.RouterScore), then one ``markov`` record (next-tool top-1
and top-3 accuracy, prefetch rate and precision at lambda/tau/B).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from aospec.cli import add_alias, add_format_option, print_records, print_table
from aospec.errors import ConfigError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "routers",
        help="fit and score the SpecBox intent routers and Markov prefetch on traces",
        description="Intent routers on the actor's token stream and Markov prefetch over tool transitions (docs/specbox.md).",
    )
    sub = parser.add_subparsers(dest="routers_command", required=True, metavar="SUBCOMMAND")
    ev = sub.add_parser(
        "eval",
        help="fit on training traces, score on held-out traces",
        description=(
            "Fit the keyword and TF-IDF routers and the Markov prefetcher on --train-traces and score them on --eval "
            "(or split PATH.../--bundled by task: --eval-fraction of the tasks held out). Each step's reply is "
            "streamed as tokens (GPT-2's pre-tokeniser split; tool calls as a name delta then argument tokens); "
            "a router is judged on what it fired before the stream's last token."
        ),
    )
    ev.add_argument("paths", nargs="*", metavar="PATH", help="traces to split by task (instead of --train-traces/--eval)")
    ev.add_argument(
        "--bundled", action="store_true", help="also read the tb1 sample bundled with aospec (split by task)"
    )
    ev.add_argument("--train-traces", dest="train", nargs="+", metavar="PATH", help="training traces (files or directories)")
    add_alias(ev, "--train", "--train-traces")
    ev.add_argument("--eval", nargs="+", metavar="PATH", dest="eval_paths", help="evaluation traces")
    ev.add_argument(
        "--eval-fraction", type=float, default=0.5, help="share of tasks held out when splitting (default 0.5)"
    )
    ev.add_argument("--seed", type=int, default=0, help="seed of the task split (default 0)")
    ev.add_argument(
        "--gamma", type=int, default=2, help="keyword threshold: distinct keywords before firing (default 2)"
    )
    ev.add_argument(
        "--gamma-sweep",
        action="store_true",
        help="instead: the keyword router at gamma 1..4 (coverage, precision, fire position)",
    )
    ev.add_argument(
        "--min-prior",
        type=float,
        default=0.3,
        help="union+parse: least Markov P(tool | previous tool) for a learned guess to fire (default 0.3)",
    )
    ev.add_argument("--lam", type=float, default=5.0, help="Markov prefetch: least tool cost in ms (default 5)")
    ev.add_argument("--tau", type=float, default=0.6, help="Markov prefetch: least probability (default 0.6)")
    ev.add_argument("--budget", type=int, default=1, help="Markov prefetch: tools per step (default 1)")
    ev.add_argument("--order", type=int, default=1, help="Markov order (backoff to shorter contexts; default 1)")
    ev.add_argument(
        "--max-file-mb", type=float, default=256, metavar="MIB", help="largest trace file to read (default 256)"
    )
    add_format_option(ev, records=True)
    ev.set_defaults(func=_eval)


def _load(paths: list[str], args: argparse.Namespace) -> list[Any]:
    from aospec.replay.io import import_traces

    mib = args.max_file_mb
    if not (math.isfinite(mib) and mib > 0):
        raise ConfigError(f"--max-file-mb must be a positive number, got {mib:g}")
    return list(import_traces(paths, "auto", max_file_bytes=max(1, int(mib * 2**20))).traces)


def _split(args: argparse.Namespace) -> tuple[list[Any], list[Any], dict[str, Any]]:
    if args.train or args.eval_paths:
        if not (args.train and args.eval_paths):
            raise ConfigError("give both --train-traces and --eval (or PATH.../--bundled to split by task)")
        if args.paths or args.bundled:
            raise ConfigError("give either --train-traces/--eval or PATH.../--bundled, not both")
        train, evals = _load(args.train, args), _load(args.eval_paths, args)
        shared = sorted({t.task for t in train} & {t.task for t in evals})
        if shared:
            print(
                f"aospec: warning: {len(shared)} task(s) are in both --train-traces and --eval (e.g. {shared[0]!r}); "
                "the scores are not on unseen tasks",
                file=sys.stderr,
            )
        return train, evals, {"split": "given", "shared_tasks": len(shared)}
    from aospec.replay import bundled_traces_path
    from aospec.training.dataset import split_by_task

    sources: list[Any] = list(args.paths)
    if args.bundled:
        sources.append(bundled_traces_path())
    if not sources:
        raise ConfigError("no traces: give --train DIR --eval DIR, or PATH... / --bundled to split by task")
    traces = _load(sources, args)
    train, evals, held = split_by_task(traces, eval_fraction=args.eval_fraction, seed=args.seed)
    return train, evals, {"split": "by-task", "eval_tasks": len(held), "shared_tasks": 0}


def _eval(args: argparse.Namespace) -> int:
    if args.gamma < 1:
        raise ConfigError(f"--gamma must be >= 1, got {args.gamma}")
    if not 0.0 <= args.min_prior <= 1.0:
        raise ConfigError(f"--min-prior must be in [0, 1], got {args.min_prior}")
    train, evals, info = _split(args)
    from aospec.specbox.markov import MarkovPrefetcher, evaluate_markov
    from aospec.specbox.routers import Assembly, KeywordRouter, ParseRouter, TfidfRouter, evaluate_router, stream_steps

    tr_steps = stream_steps(train)
    ev_steps = stream_steps(evals)
    if not any(s.is_call for s in tr_steps):
        raise ConfigError("the training traces hold no tool calls")
    if not ev_steps:
        raise ConfigError("the evaluation traces hold no steps")
    base = {"train_traces": len(train), "eval_traces": len(evals), **info}
    if args.gamma_sweep:
        kw = KeywordRouter.fit(tr_steps)
        records = []
        for g in (1, 2, 3, 4):
            score = evaluate_router(kw.with_gamma(g), ev_steps, name=f"keyword(gamma={g})").to_json()
            records.append(
                {
                    "gamma": g,
                    **{
                        k: score[k]
                        for k in (
                            "router",
                            "coverage",
                            "precision",
                            "recall",
                            "micro_f1",
                            "fire_position_mean",
                            "fire_position_p50",
                            "us_per_token",
                        )
                    },
                    **base,
                }
            )
        _print(records, args, title="Keyword router by gamma")
        return 0
    markov = MarkovPrefetcher(lam=args.lam, tau=args.tau, budget=args.budget, order=args.order)
    markov.fit(train)
    kw = KeywordRouter.fit(tr_steps, gamma=args.gamma)
    tf = TfidfRouter.fit(tr_steps)
    parse = ParseRouter()
    routers = [
        kw,
        tf,
        parse,
        Assembly([kw, tf], "union"),
        Assembly([kw, tf], "intersection"),
        Assembly([kw, tf], "weighted"),
        Assembly([kw, tf, parse], "union", prior=markov, min_prior=args.min_prior, name="union+parse"),
        Assembly([kw, tf, parse], "union", name="union+parse(no-prior)"),
    ]
    records: list[dict[str, Any]] = [{**evaluate_router(r, ev_steps).to_json(), **base} for r in routers]
    m = evaluate_markov(markov, evals).to_json()
    records.append(
        {
            "router": "markov",
            "next_tool_top1": m["top1"],
            "next_tool_top3": m["top3"],
            "prefetch_rate": m["prefetch_rate"],
            "prefetch_precision": m["prefetch_precision"],
            "steps": m["steps"],
            **base,
        }
    )
    _print(records, args, title="Routers (fitted on --train, scored on --eval)")
    return 0


def _print(records: list[dict[str, Any]], args: argparse.Namespace, *, title: str) -> None:
    if args.format in ("json", "jsonl"):
        print_records(records, args.format)
        return
    from rich.table import Table

    skip = {"train_traces", "eval_traces", "split", "eval_tasks", "shared_tasks"}
    cols: list[str] = []
    for r in records:
        cols.extend(k for k in r if k not in skip and k not in cols)
    table = Table(
        title=f"{title}: {records[0]['train_traces']} train / {records[0]['eval_traces']} eval traces",
        title_justify="left",
    )
    for c in cols:
        table.add_column(c, justify="left" if c == "router" else "right")
    for r in records:
        table.add_row(*("-" if r.get(c) is None else str(r[c]) for c in cols))
    print_table(table)
