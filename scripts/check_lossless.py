#!/usr/bin/env python3
"""Long randomized losslessness runs: the live engine on real overlay sandboxes, each
case run serially on the in-memory reference configuration, serially on its own sandbox
configuration and speculatively with right and wrong drafts; trajectories, versions and
filesystem contents must be equal (see runtime/lossless.py). Needs root and overlayfs.

Usage::

    scripts/check_lossless.py --runs 300                       # seeds 0.., all four configs
    scripts/check_lossless.py --runs 10000 --seed 1000 --jobs 2 --json > lossless.json
    scripts/check_lossless.py --runs 40 --configs compact,durable
    scripts/check_lossless.py --repro lossless-repro-17-compact.json   # rerun a reproduction
    scripts/check_lossless.py --runs 400 --specbox --jobs 2          # through the SpecBox layer
    scripts/check_lossless.py --runs 2000 --readsets --jobs 2        # read-set validation cases
    scripts/check_lossless.py --runs 400 --readsets --read-sets off  # the same cases, JASV alone

Run ``i`` is seed ``S + i // len(configs)`` on ``configs[i % len(configs)]``, so one seed
covers every configuration and shares one reference run. A progress line goes to stderr;
the summary (runs, divergences, aborted runs and leaks per configuration, runs/s) to stdout,
or one JSON document with ``--json``. A run where a command that takes milliseconds timed
out (an overloaded machine) is counted as inconclusive, not as a failure. Each failure is
minimised (the serial action sequence
replayed, then actions and speculation knobs dropped while it still fails the same way;
``--no-minimise`` skips it) and written to ``--out/lossless-repro-SEED-CONFIG.json``.

``--specbox``: the speculative run of each case goes through the SpecBox layer a live run
uses (``aospec run --cache reads --pool-depth 2 --router parse``, built by
``aospec.live.specbox_layer.open_specbox``): the engine gets
``CachedSandbox(PooledSandbox(sandbox, depth=2), deterministic=deterministic_reads())``, a
``ParseRouter`` reads the actor's streamed replies, and a routed action drafter proposes
right and wrong commands of the routed program. Cases are ``make_case(seed, config,
layered=True)`` (repeated deterministic reads between writes, an actor that takes time to
decode). The comparison is the same; the summary adds per configuration the committed cache
hits (and all hits, forks' included), routes fired, routed forks launched and reused, pool
forks served and the cache's violations and the engine's speculative failures.

``--readsets``: cases built for read-set validation (``make_case(seed, config,
readsets=True)``: commands whose output depends on metadata, listings and missing files,
unrelated writes between them, lookahead 2-4; docs/engine.md "Read sets"), and every rebase
re-checked (``AOSPEC_READ_SETS_CHECK``: the committed layer must equal a fresh diff of the
fork's changes against the committed state). The summary adds the forks rebased per
configuration. ``--read-sets off`` runs the engine without read-set validation (JASV alone),
for comparison.

Exit status: 0 when every run passed, 1 when any diverged, aborted or leaked a mount, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from aospec.runtime import _fs
from aospec.runtime.lossless import (
    SANDBOX_CONFIGS,
    LayerFactory,
    LosslessCase,
    SpeculationLayer,
    check_case,
    make_case,
    minimise,
)

from aospec.protocols import Sandbox

KINDS = ("divergence", "aborted", "leak")  # failures; "inconclusive" runs are counted apart


#: The figures summed per configuration (RunRecord.counts of the speculative runs), in order.
COUNTS = (
    "forks_rebased",  # forks reused by read-set validation (from an older origin)
    "cache_hits",  # committed steps the cache served (the engine's count)
    "cache_hits_all",  # every hit, discarded forks' included
    "cache_stores",
    "cache_violations",
    "routes_fired",
    "routed_forks_launched",
    "routed_forks_reused",
    "pool_served",
    "pool_stale_discarded",
    "speculative_failures",
)


def specbox_layer() -> LayerFactory:
    """The SpecBox layer of ``aospec run --cache reads --pool-depth 2 --router parse``,
    as ``aospec.live.specbox_layer.open_specbox`` stacks it, for ``check_case(..., layer=...)``."""
    from aospec.live.specbox_layer import SpecBoxOptions, open_specbox

    options = SpecBoxOptions(cache="reads", pool_depth=2, router="parse")

    @asynccontextmanager
    async def layer(sandbox: Sandbox) -> AsyncIterator[SpeculationLayer]:
        async with open_specbox(sandbox, options) as run:
            cached, pooled = run.cached, run.pooled

            def counts() -> dict[str, int]:
                c = cached.cache_counts()
                return {
                    "cache_hits_all": c["hits"],
                    "cache_stores": c["stores"],
                    "cache_violations": c["violations"],
                    "pool_served": pooled.stats.handed_out,
                    "pool_stale_discarded": pooled.stats.stale_discarded,
                }

            yield SpeculationLayer(run.sandbox, run.router, counts=counts)

    return layer


def _private_state_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="aospec-lossless-", dir="/var/tmp"))
    os.environ["AOSPEC_STATE_ROOT"] = str(root)
    return root


def _check_seed(
    seed: int,
    configs: Sequence[str],
    minimise_failures: bool,
    specbox: bool = False,
    readsets: bool = False,
    read_sets: bool = True,
) -> list[dict[str, Any]]:
    """Every configuration of one seed (in a worker process); one result dict per run."""
    root = _private_state_root()
    layer = specbox_layer() if specbox else None

    async def main() -> list[dict[str, Any]]:
        results = []
        reference = None
        minimised: dict[tuple[str, str], dict[str, Any]] = {}
        for config in configs:
            started = time.perf_counter()
            case = make_case(seed, config, layered=specbox, readsets=readsets)
            if not read_sets:
                case = dataclasses.replace(case, engine={**case.engine, "read_sets": False})
            outcome, reference = await check_case(case, reference=reference, state_root=root, layer=layer)
            result: dict[str, Any] = {"seed": seed, "config": config, **outcome.to_json()}
            result["elapsed_s"] = round(time.perf_counter() - started, 3)
            if outcome.kind in KINDS and minimise_failures:
                # one seed failing the same way on several configurations is one finding
                if outcome.signature not in minimised:
                    small = await minimise(outcome, state_root=root, layer=layer)
                    minimised[outcome.signature] = small.to_json()
                result["minimised"] = minimised[outcome.signature]
            results.append(result)
        return results

    try:
        return anyio.run(main)
    finally:
        _fs.unmount_all_under(str(root))
        _fs.remove_tree(str(root))


def _write_repro(out: Path, result: dict[str, Any], specbox: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"lossless-repro-{result['seed']}-{result['config']}.json"
    small = result.get("minimised") or result
    doc = {
        "kind": small["kind"],
        "where": small["where"],
        "details": small["details"],
        "case": small["case"],
        "original": {k: result[k] for k in ("kind", "where", "details", "case", "serial_actions")},
        "specbox": specbox,
        "rerun": f"scripts/check_lossless.py --repro {path}",
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _layer_table(layer: dict[str, dict[str, int]]) -> str:
    names = ("rebased", "cache hits", "all hits", "routes", "routed", "reused", "pool served", "spec fails")
    keys = ("forks_rebased", "cache_hits", "cache_hits_all", "routes_fired", "routed_forks_launched")
    keys += ("routed_forks_reused", "pool_served", "speculative_failures")
    lines = [f"{'config':<10}" + "".join(f"{n:>13}" for n in names)]
    for config, c in layer.items():
        lines.append(f"{config:<10}" + "".join(f"{c[k]:>13}" for k in keys))
    return "\n".join(lines)


def _summary_table(counts: dict[str, dict[str, int]]) -> str:
    lines = [f"{'config':<10}{'runs':>7}{'ok':>7}{'diverged':>10}{'aborted':>9}{'leaks':>7}{'inconclusive':>14}"]
    for config, c in counts.items():
        lines.append(
            f"{config:<10}{c['runs']:>7}{c['ok']:>7}{c['divergence']:>10}{c['aborted']:>9}{c['leak']:>7}"
            f"{c['inconclusive']:>14}"
        )
    return "\n".join(lines)


def _run(args: argparse.Namespace, configs: list[str]) -> int:
    seeds_needed = -(-args.runs // len(configs))
    plan = []  # (seed, configs of that seed), exactly args.runs runs in all
    left = args.runs
    for i in range(seeds_needed):
        take = configs[: min(len(configs), left)]
        plan.append((args.seed + i, take))
        left -= len(take)
    counts = {c: {"runs": 0, "ok": 0, "divergence": 0, "aborted": 0, "leak": 0, "inconclusive": 0} for c in configs}
    layer = {c: dict.fromkeys(COUNTS, 0) for c in configs}  # summed over the speculative runs
    failures: list[dict[str, Any]] = []
    done = 0
    check_s = 0.0  # time spent checking, without minimising failures
    started = time.perf_counter()
    tty = sys.stderr.isatty()

    def progress(final: bool = False) -> None:
        elapsed = time.perf_counter() - started
        rate = done / elapsed if elapsed else 0.0
        bad = {k: sum(c[k] for c in counts.values()) for k in (*KINDS, "inconclusive")}
        line = (
            f"{done}/{args.runs} runs  {rate:.2f} runs/s  divergences {bad['divergence']}  "
            f"aborted {bad['aborted']}  leaks {bad['leak']}  inconclusive {bad['inconclusive']}"
        )
        if tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif final or done % 20 == 0:
            print(line, file=sys.stderr, flush=True)

    def take(results: list[dict[str, Any]]) -> None:
        nonlocal done, check_s
        for r in results:
            done += 1
            check_s += r["elapsed_s"]
            c = counts[r["config"]]
            c["runs"] += 1
            c[r["kind"]] += 1
            for k, v in r.get("counts", {}).items():
                if k in layer[r["config"]]:
                    layer[r["config"]][k] += v
            if r["kind"] == "inconclusive":
                print(f"\ninconclusive: seed {r['seed']} [{r['config']}]: {r['details'][0]}", file=sys.stderr)
            elif r["kind"] != "ok":
                r["repro"] = str(_write_repro(Path(args.out), r, args.specbox))
                failures.append(r)
                print(
                    f"\n{r['kind']}: seed {r['seed']} [{r['config']}] ({r['where']}) -> {r['repro']}", file=sys.stderr
                )
                for d in r["details"][:6]:
                    print(f"  {d}", file=sys.stderr)
        progress()

    minimise_failures = not args.no_minimise
    modes = (args.specbox, args.readsets, args.read_sets == "on")
    if args.jobs <= 1:
        for seed, cfgs in plan:
            take(_check_seed(seed, cfgs, minimise_failures, *modes))
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            pending: set[Future[list[dict[str, Any]]]] = set()
            todo = iter(plan)
            for seed, cfgs in todo:
                pending.add(pool.submit(_check_seed, seed, cfgs, minimise_failures, *modes))
                if len(pending) >= 2 * args.jobs:
                    break
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    take(fut.result())
                    nxt = next(todo, None)
                    if nxt is not None:
                        pending.add(pool.submit(_check_seed, nxt[0], nxt[1], minimise_failures, *modes))
    progress(final=True)
    elapsed = time.perf_counter() - started
    if args.json:
        doc = {
            "runs": done,
            "seed": args.seed,
            "configs": counts,
            "specbox": args.specbox,
            "readsets": args.readsets,
            "read_sets": args.read_sets,
            "layer": layer,
            "elapsed_s": round(elapsed, 1),
            "runs_per_s": round(done / elapsed, 3) if elapsed else None,
            "check_s": round(check_s, 1),
            "runs_per_check_s": round(done / check_s, 3) if check_s else None,
            "failures": [
                {k: r.get(k) for k in ("seed", "config", "kind", "where", "details", "repro")} for r in failures
            ],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(_summary_table(counts))
        print(_layer_table(layer))
        if elapsed and check_s:
            print(
                f"{done} runs in {elapsed:.0f} s ({done / elapsed:.2f} runs/s; "
                f"{done / check_s:.2f} runs/s of checking, without minimising)"
            )
        for r in failures:
            print(f"{r['kind']}: seed {r['seed']} [{r['config']}] ({r['where']}): {r['repro']}")
    return 1 if failures else 0


def _repro(args: argparse.Namespace) -> int:
    path = Path(args.repro)
    try:
        text = path.read_text()
    except OSError as exc:
        print(f"check_lossless: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        doc = json.loads(text)
        case = LosslessCase.from_json(doc["case"])
        layer = specbox_layer() if args.specbox or doc.get("specbox") else None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"check_lossless: {path}: not a reproduction file ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    root = _private_state_root()

    async def main() -> list[Any]:
        return [(await check_case(case, state_root=root, layer=layer))[0] for _ in range(args.runs)]

    try:
        outcomes = anyio.run(main)
    finally:
        _fs.unmount_all_under(str(root))
        _fs.remove_tree(str(root))
    failed = [o for o in outcomes if o.kind in KINDS]
    if args.json:
        print(json.dumps({"runs": len(outcomes), "failed": len(failed), "outcomes": [o.to_json() for o in outcomes]}))
    else:
        for o in outcomes:
            print(o.summary())
        print(f"{len(failed)} of {len(outcomes)} runs failed")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="runs in all (default 100; with --repro: reruns, default 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--configs", default=",".join(SANDBOX_CONFIGS), help="comma-separated sandbox configurations")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--out", default=".", help="directory for reproduction files (default .)")
    parser.add_argument("--no-minimise", action="store_true", help="write failures as found, unminimised")
    parser.add_argument("--repro", metavar="FILE", help="rerun the case of a reproduction file")
    parser.add_argument(
        "--specbox",
        action="store_true",
        help="speculative runs through the SpecBox layer (result cache over a fork pool, parse router)",
    )
    parser.add_argument(
        "--readsets",
        action="store_true",
        help="read-set validation cases: metadata, listings, missing files, unrelated writes, lookahead 2-4",
    )
    parser.add_argument(
        "--read-sets", choices=("on", "off"), default="on", help="read-set validation in the engine (default on)"
    )
    args = parser.parse_args(argv)
    if args.runs is None:
        args.runs = 1 if args.repro else 100
    if args.runs < 1 or args.jobs < 1 or args.seed < 0:
        parser.error("--runs and --jobs must be >= 1, --seed >= 0")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in SANDBOX_CONFIGS]
    if unknown or not configs or len(set(configs)) != len(configs):
        parser.error(f"--configs: give distinct names among {', '.join(SANDBOX_CONFIGS)} (got {args.configs!r})")
    if os.geteuid() != 0:
        parser.error("needs root (overlayfs mounts)")
    os.environ["AOSPEC_READ_SETS_CHECK"] = "1"  # every rebase re-checked (see --readsets)
    if args.repro:
        return _repro(args)
    return _run(args, configs)


if __name__ == "__main__":
    sys.exit(main())
