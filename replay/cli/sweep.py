"""``aospec replay`` and ``aospec sweep``: replay traces under policies in virtual time."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from aospec.replay.cli import add_input_format, add_input_limits, add_trace_inputs, load_trace_inputs, trace_sources

from aospec.cli import add_alias, add_format_option, print_records, print_table

__all__ = ["host_model", "register_replay", "register_sweep", "slow_policy_note"]


class _DefaultPolicies:
    """``--policies``' default, ``aospec.replay.policies.DEFAULT_POLICIES`` joined by commas: a
    string only when help shows it or a handler reads it, so that registering the verb does
    not import the engine (help stays fast)."""

    def __str__(self) -> str:
        from aospec.replay.policies import DEFAULT_POLICIES

        return ",".join(DEFAULT_POLICIES)

#: Replay cost of the slow drafting components, in CPU seconds per trace step and TPOT, on
#: the 2-core machine of docs/replay.md ("Slow policies"); a policy with neither costs
#: about SLOW_BASE_S.
SLOW_BASE_S = 0.007
SLOW_COMPONENTS_S = {"embedding kernel": 0.4, "LM drafter": 0.0}


def register_replay(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``replay`` verb (an ``aospec.commands`` entry point)."""
    _register(sub, "replay", "replay traces under policies at one TPOT and print per-trace results")


def register_sweep(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``sweep`` verb (an ``aospec.commands`` entry point)."""
    _register(sub, "sweep", "replay traces under policies across TPOTs; write results, summary and plots")


def _register(sub: argparse._SubParsersAction, name: str, helptext: str) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(name, help=helptext, description=helptext)
    add_trace_inputs(
        p,
        paths_help="evaluation traces (files or directories)",
        bundled_help="evaluate on the tb1 sample bundled with aospec",
    )
    p.add_argument("--eval", action="append", default=[], metavar="DIR", help="evaluation traces (repeatable)")
    p.add_argument(
        "--train-traces",
        dest="train",
        action="append",
        default=[],
        metavar="DIR",
        help="training traces for the drafters (repeatable); without it: leave-one-task-out",
    )
    add_alias(p, "--train", "--train-traces")
    p.add_argument(
        "--policies",
        default=_DefaultPolicies(),
        help="comma-separated NAME[:key=value...] (keys: EngineConfig/PolicyConfig fields); default: %(default)s",
    )
    if name == "sweep":
        p.add_argument(
            "--tpot-ms",
            dest="tpots",
            default="20,15,10,5,1",
            metavar="MS[,MS...]",
            help="comma-separated ms per output token (default 20,15,10,5,1)",
        )
        add_alias(p, "--tpots", "--tpot-ms")
        p.add_argument("--out", default="results", metavar="DIR", help="output directory (default ./results)")
    else:
        p.add_argument("--tpot-ms", type=float, default=10.0, help="ms per output token (default 10)")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="workers: local processes (default: number of CPUs), or Ray actors with --executor ray "
        "(default: one per CPU of the cluster)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="where traces are replayed: local processes (the default) or a Ray cluster (pip install 'aospec[ray]')",
    )
    p.add_argument(
        "--address",
        default=None,
        metavar="auto|ray://HOST:PORT",
        help="the Ray cluster of --executor ray (default: start a local Ray)",
    )
    p.add_argument(
        "--drafter-options",
        default=None,
        metavar="JSON",
        help='options per drafter/kernel name, e.g. \'{"lm": {"backend": "vllm"}}\' (or @file.json)',
    )
    p.add_argument(
        "--prefill-ms-per-ktok",
        type=float,
        default=0.0,
        help="prefill model: ms per 1000 new context tokens (default 0: off)",
    )
    p.add_argument(
        "--state-model",
        choices=("auto", "recorded", "effects", "blind", "readsets"),
        default="auto",
        help="filesystem versions of replayed steps: recorded (the versions the trace recorded; every step must "
        "have them), effects (the static effect classifier: conservative bracket), blind (no step changes the "
        "filesystem: upper bracket), readsets (recorded versions plus recorded read/write sets: a fork survives "
        "commits that touched nothing it read), auto (recorded when every trace has versions, else effects; the "
        "default)",
    )
    p.add_argument(
        "--cores",
        type=float,
        default=None,
        metavar="C",
        help="replay on a simulated host of C cores: every command (the committed step and each unpaused "
        "speculative fork) shares them, from its recorded CPU time (docs/replay.md, 'Contention'); "
        "default: no contention, each command takes its recorded time",
    )
    p.add_argument(
        "--background-load",
        type=int,
        default=None,
        metavar="L",
        help="with --cores: L always-runnable CPU-bound processes beside the replay (default 0)",
    )
    p.add_argument(
        "--unrecorded-cpu",
        type=float,
        default=None,
        metavar="SHARE",
        help="with --cores: the CPU time of a step that recorded none, as a share of its tool time "
        "(0..1; default 1: CPU-bound)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_input_format(p)
    add_input_limits(p)
    add_format_option(p, records=True)
    p.set_defaults(func=_sweep if name == "sweep" else _replay)


def _drafter_options(text: str | None) -> dict[str, Any]:
    from aospec.replay._input import parse_json, read_text

    from aospec.errors import ConfigError, TraceFormatError

    if not text:
        return {}
    where = "--drafter-options"
    if text.startswith("@"):
        where = text[1:]
        try:
            text = read_text(where, max_bytes=2**24)
        except TraceFormatError as exc:
            raise ConfigError(f"--drafter-options: {exc}") from None
    try:
        value = parse_json(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(f'{where}: expected an object of objects, e.g. {{"lm": {{"backend": "vllm"}}}}')
    return value


def _floats(text: str, what: str) -> list[float]:
    """Comma-separated positive, finite, distinct numbers (ConfigError otherwise)."""
    from aospec.errors import ConfigError

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ConfigError(f"{what}: expected positive finite numbers, got {text!r}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ConfigError(f"{what}: {', '.join(f'{v:g}' for v in repeated)} listed twice (each value once)")
    return values


def host_model(args: argparse.Namespace) -> Any:
    """The :class:`aospec.replay.contention.HostModel` of ``--cores``/``--background-load``/
    ``--unrecorded-cpu``, or None without ``--cores`` (ConfigError for the others alone)."""
    from aospec.errors import ConfigError

    if args.cores is None:
        options = (("--background-load", args.background_load), ("--unrecorded-cpu", args.unrecorded_cpu))
        given = [flag for flag, value in options if value is not None]
        if given:
            raise ConfigError(f"{given[0]} needs --cores C (the simulated host's cores)")
        return None
    from aospec.replay.contention import HostModel

    return HostModel(
        args.cores,
        args.background_load if args.background_load is not None else 0,
        args.unrecorded_cpu if args.unrecorded_cpu is not None else 1.0,
    )


def _load(args: argparse.Namespace) -> tuple[list[Any], list[Any] | None, str, int, dict[str, str]]:
    from aospec.errors import ConfigError

    sources = trace_sources(args, args.eval, missing="no traces: give PATH..., --eval DIR or --bundled")
    loaded = load_trace_inputs(sources, args, format=args.input_format, as_refs=True)
    eval_traces = list(loaded.traces)
    paths = dict(loaded.paths)
    skipped = len(loaded.skipped)
    train = None
    if args.train:
        loaded = load_trace_inputs(args.train, args, format=args.input_format)
        train, skipped = list(loaded.traces), skipped + len(loaded.skipped)
    if train is not None:
        overlap = {t.id for t in train} & {t.id for t in eval_traces}
        if overlap:
            raise ConfigError(
                f"{len(overlap)} trace(s) are in both --train-traces and the evaluation set, e.g. {sorted(overlap)[0]!r}"
            )
    split = "given training set" if train is not None else "leave-one-task-out"
    return eval_traces, train, split, skipped, paths


def _slow_components(policy: Any) -> list[str]:
    """The slow drafting components a policy uses (keys of SLOW_COMPONENTS_S)."""
    c = policy.config
    found = []
    if c.kernel == "embedding" or c.kernel.endswith(":EmbeddingKernel"):
        found.append("embedding kernel")
    if any(n == "lm" or n.startswith("aospec.drafters.lm:") for n in (*c.obs_names, *c.action_names)):
        found.append("LM drafter")
    return found


def slow_policy_note(policies: list[Any], steps: int, tpots: int, jobs: int) -> str | None:
    """A note naming the policies that use a slow drafting component, with a rough estimate
    of their share of the sweep's wall time from the per-step costs above; None when no
    policy does."""
    slow = [(p, comps) for p in policies if (comps := _slow_components(p))]
    if not slow:
        return None
    per_step = max(SLOW_COMPONENTS_S[c] for _, comps in slow for c in comps)
    cpu_s = sum(steps * tpots * sum(SLOW_COMPONENTS_S[c] for c in comps) for _, comps in slow)
    names = ", ".join(f"{p.name} ({' and '.join(comps)})" for p, comps in slow)
    minutes = cpu_s / max(1, jobs) / 60
    return (
        f"{names}: replays about {per_step / SLOW_BASE_S:.0f}x slower than policies without it; expect roughly "
        f"{minutes:.0f} min for {steps} steps x {tpots} TPOT{'s' if tpots != 1 else ''} on {jobs} "
        f"worker{'s' if jobs != 1 else ''} (docs/replay.md, 'Slow policies')"
    )


def _executor(args: argparse.Namespace, n_traces: int) -> tuple[Any, str, int]:
    """The sweep executor ``--executor``/``--address``/``--jobs`` ask for, its description
    for the summary, and the worker count the slow-policy note assumes."""
    from aospec.errors import ConfigError

    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    if args.executor == "ray":
        from aospec.replay.executors_ray import RayExecutor, require_ray

        require_ray()  # MissingDependencyError naming pip install 'aospec[ray]', before any work
        where = args.address or "a local Ray"
        workers = "one per cluster CPU" if args.jobs is None else f"{args.jobs} workers"
        return RayExecutor(address=args.address, workers=args.jobs), f"ray ({where}, {workers})", args.jobs or 1
    if args.address is not None:
        raise ConfigError("--address needs --executor ray")
    from aospec.replay.executors import local_executor

    jobs = min(args.jobs if args.jobs is not None else (os.cpu_count() or 1), n_traces, os.cpu_count() or 1)
    return local_executor(max(1, jobs)), f"local ({jobs} worker{'s' if jobs != 1 else ''})", jobs


def _run(
    args: argparse.Namespace,
    tpots: list[float],
    sink: Callable[[int, list[Any]], None],
    on_start: Callable[[], None] | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """Replay the traces ``args`` name; ``on_start()`` runs once the sweep's arguments are
    checked, and ``sink(index, results)`` receives each trace's results as it finishes.
    Returns the policies and the run's metadata."""
    from aospec.replay.policies import check_drafters, parse_policies
    from aospec.replay.sandbox import STATE_MODEL_MEANING, resolve_state_model
    from aospec.replay.sweep import iter_sweep, loading

    from aospec.errors import ConfigError
    from aospec.progress import progress

    if not (math.isfinite(args.prefill_ms_per_ktok) and args.prefill_ms_per_ktok >= 0):
        raise ConfigError(f"--prefill-ms-per-ktok must be a finite number >= 0, got {args.prefill_ms_per_ktok:g}")
    if args.address is not None and args.executor != "ray":
        raise ConfigError("--address needs --executor ray")
    host = host_model(args)
    policies = parse_policies(str(args.policies))
    options = _drafter_options(args.drafter_options)
    eval_traces, train, split, skipped, paths = _load(args)
    state_model, why = resolve_state_model(loading(eval_traces), args.state_model, paths)
    executor, executor_text, jobs = _executor(args, len(eval_traces))
    note = slow_policy_note(policies, sum(len(t) for t in eval_traces), len(tpots), min(jobs, len(eval_traces)))
    if note:
        check_drafters(policies, options)  # a configuration error first, not a note about a sweep that cannot run
        print(f"aospec: note: {note}", file=sys.stderr)
    print(f"aospec: state model: {state_model} ({why}): {STATE_MODEL_MEANING[state_model]}", file=sys.stderr)
    started = time.perf_counter()
    try:
        with progress(disable=True if args.no_progress else None) as bar:
            task = bar.add_task(f"replaying traces ({args.executor})", total=len(eval_traces))
            stream = iter_sweep(
                eval_traces,
                policies,
                train_traces=train,
                tpots_ms=tpots,
                drafter_options=options,
                prefill_ms_per_ktok=args.prefill_ms_per_ktok,
                executor=executor,
                state_model=state_model,
                host=host,
            )  # checks everything before the first trace runs
            if on_start is not None:
                on_start()
            for index, results in stream:
                sink(index, results)
                bar.advance(task)
    finally:
        close = getattr(executor, "close", None)
        if close is not None:
            close()  # a local Ray this run started stops
    meta = {
        "traces": len(eval_traces),
        "tasks": len({t.task for t in eval_traces}),
        "steps": sum(len(t) for t in eval_traces),
        "drafters trained on": split,
        "policies": ", ".join(p.name for p in policies),
        "TPOTs (ms)": ", ".join(f"{t:g}" for t in tpots),
        "prefill model (ms per 1k tokens)": f"{args.prefill_ms_per_ktok:g}",
        "state model": f"{state_model} ({why}): {STATE_MODEL_MEANING[state_model]}",
        "executor": executor_text,
        "wall time (s)": f"{time.perf_counter() - started:.1f}",
    }
    if host is not None:
        meta["host model"] = f"{host.describe()} (docs/replay.md, 'Contention'); saving is against serial on this host"
    if args.skip_invalid:
        meta["invalid files skipped"] = skipped
    return policies, meta


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aospec.replay.metrics import summarize
    from aospec.replay.report import (
        ResultsFile,
        drafter_failure_note,
        print_drafter_tables,
        read_results,
        write_summary,
    )
    from aospec.replay.report import print_table as print_summary_table

    tpots = _floats(args.tpots, "--tpot-ms")
    out = Path(args.out)
    with ResultsFile(out / "results.jsonl") as results:
        # each trace's records reach the file (flushed) as it finishes; on an error the
        # finished traces stay there, in the order they finished
        _, meta = _run(args, tpots, results.add, results.open)
        path = results.finish()
    summaries = summarize(read_results(path))
    written = [path, *write_summary(out, summaries, meta)]
    note = drafter_failure_note(summaries)
    if note:
        print(f"aospec: warning: {note}", file=sys.stderr)
    if args.format in ("json", "jsonl"):
        print_records((s.to_json() for s in summaries), args.format)
    else:
        print_summary_table(summaries)
        print_drafter_tables(summaries)
        note = f"; {meta['invalid files skipped']} invalid trace files skipped" if args.skip_invalid else ""
        print(f"wrote {len(written)} files to {args.out}/ (summary.md, results.jsonl, plots){note}", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from aospec.replay.metrics import summarize
    from aospec.replay.report import drafter_failure_note
    from aospec.replay.report import print_table as print_summary_table
    from rich.table import Table

    if not (math.isfinite(args.tpot_ms) and args.tpot_ms > 0):
        from aospec.errors import ConfigError

        raise ConfigError(f"--tpot-ms must be a positive finite number, got {args.tpot_ms}")
    by_trace: dict[int, list[Any]] = {}
    policies, meta = _run(args, [args.tpot_ms], by_trace.__setitem__)
    results = [r for i in sorted(by_trace) for r in by_trace[i]]
    note = drafter_failure_note(summarize(results))
    if note:
        print(f"aospec: warning: {note}", file=sys.stderr)
    if args.format in ("json", "jsonl"):
        print_records((r.to_json() for r in results), args.format)
        return 0
    table = Table(
        title=f"aospec replay at {args.tpot_ms:g} ms/token, state model {meta['state model'].split()[0]}"
        + (f", host {meta['host model'].split(';')[0]}" if "host model" in meta else "")
        + ": latency in s (saving vs serial)"
    )
    table.add_column("trace")
    table.add_column("steps", justify="right")
    table.add_column("serial s", justify="right")
    for p in policies:
        table.add_column(p.name, justify="right")
    rows: dict[str, list[Any]] = {}
    for r in results:
        rows.setdefault(r.trace_id, [r.steps, r.serial_ns * 1e-9, {}])[2][r.policy] = r
    for trace_id, (steps, serial, by) in rows.items():
        cells = [f"{by[p.name].latency_ns * 1e-9:.1f} ({100 * by[p.name].saving:.1f}%)" for p in policies]
        table.add_row(trace_id, str(steps), f"{serial:.1f}", *cells)
    print_table(table)
    print_summary_table(summarize(results))
    if args.skip_invalid:
        print(f"aospec: {meta['invalid files skipped']} invalid trace files skipped", file=sys.stderr)
    return 0
