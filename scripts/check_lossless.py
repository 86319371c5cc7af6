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

``--actor-server MODEL``: the actor is a real model server, ``transformers serve`` on
MODEL (``smollm2``, the models extra; docs/actors.md), greedy, through the OpenAI actor a live
run uses. Each run is a short bash-agent task (seeded words and file names) run by
``aospec.live.agent.Agent`` on overlay sandboxes twice: serially, then speculatively with
drafters that know the serial run and propose its observations and next actions with the
seed's odds next to wrong ones (so drafts hit and miss, forks are reused and discarded).
Trajectories, final versions and filesystem snapshots must be equal; the summary adds the
drafts hit and forks reused. A run whose observations differed only in the times they show
(``ls -la /`` shows the sandbox's creation time, and /proc's link count the host's process
count) and whose replies then differed is counted as inconclusive, not as a divergence (:func:`_compare_server_runs`). ``--server-steps`` and
``--server-max-tokens`` size a run::

    scripts/check_lossless.py --actor-server smollm2 --runs 200 --json > real-server.json

``--readsets``: cases built for read-set validation (``make_case(seed, config,
readsets=True)``: commands whose output depends on metadata, listings and missing files,
unrelated writes between them, lookahead 2-4; docs/engine.md "Read sets"), and every rebase
re-checked (``AOSPEC_READ_SETS_CHECK``: the committed layer must equal a fresh diff of the
fork's changes against the committed state). The summary adds the forks rebased per
configuration. ``--read-sets off`` runs the engine without read-set validation (JASV alone),
for comparison.

Exit status: 0 when every run passed, 1 when any diverged, aborted or leaked a mount, 2 on
bad arguments, 130 when interrupted: SIGINT, SIGTERM and SIGHUP (aospec.signals) stop the
runs in progress, which unmount and remove their private state roots (under
``$AOSPEC_LOSSLESS_TMPDIR``, default /var/tmp) as a finished run does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
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
from aospec.runtime.readsets import wait_for_tracer

from aospec.protocols import Sandbox
from aospec.signals import deferred_signals, interrupt_on_signals, interrupt_once, signals_received

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
    "drafting_skipped",  # drafting rounds skipped (cases with drafting_cpu_s fixed)
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


@contextlib.contextmanager
def _private_state_root() -> Iterator[Path]:
    """A private AOSPEC_STATE_ROOT, unmounted and removed on the way out. The stopping
    signals are only noted while it is made and while it is removed (deferred_signals), so
    an interrupt cannot fall between its creation and the ``try`` that removes it, and a
    second one cannot cut its removal short; one that comes meanwhile is raised after."""
    parent = os.environ.get("AOSPEC_LOSSLESS_TMPDIR") or "/var/tmp"
    root: Path | None = None
    try:
        with deferred_signals():
            root = Path(tempfile.mkdtemp(prefix="aospec-lossless-", dir=parent))
            os.environ["AOSPEC_STATE_ROOT"] = str(root)
        yield root
    finally:
        # no call before the ``try`` (Python acts on a signal at a call or a loop's jump): a
        # signal that comes before deferred_signals holds them interrupts inside it, and the
        # removal is tried again
        late: KeyboardInterrupt | None = None
        tries = 0
        while root is not None:
            try:
                with deferred_signals():
                    tries += 1
                    if _remove_state_root(root, last=tries >= 5):
                        root = None
            except KeyboardInterrupt as exc:
                late = exc
        if late is not None:
            raise late


def _remove_state_root(root: Path, *, last: bool) -> bool:
    """Unmount and remove one private state root: whether that is done. A failure (a mount
    or a file still appearing) waits a little for the next try; on the last it is one line
    on stderr naming the root for removal by hand."""
    try:
        _fs.unmount_all_under(str(root))
        _fs.remove_tree(str(root))
    except OSError as exc:
        if last:
            print(f"check_lossless: could not remove the state root {root}: {exc}", file=sys.stderr, flush=True)
            return True
        time.sleep(0.2)
        return False
    return True


class _WorkerState:
    """A pool worker's stop, shared by its main thread and :func:`_die_with_parent`'s
    watcher under one lock: a seed starts only while no stop has come, and the watcher
    interrupts only a seed that has started, so neither can fall between the other's check
    and act (a state root made just as the watcher exits the process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checking = False  # a seed is in progress
        self.stopped = False  # the run is stopping: no seed starts any more

    def start(self) -> None:
        with self.lock:
            if self.stopped:  # a seed queued before the stop: dropped, as the parent's pending ones
                raise KeyboardInterrupt
            self.checking = True

    def finish(self, interrupted: bool) -> None:
        with self.lock:
            self.checking = False
            self.stopped = self.stopped or interrupted


_WORKER = _WorkerState()


def _die_with_parent(parent: int) -> None:
    """A pool worker: exits once its parent is gone, so it never outlives an interrupted
    parent (idle on the pool's queue, whose pipe it holds open itself, it would wait forever;
    a SIGTERM meant for the parent may have been spent interrupting its seed). A seed in
    progress is interrupted first (SIGTERM: its private state root is cleaned up), unless a
    stop has reached it already (a second one is not sent); calls still queued are not
    started."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        with _WORKER.lock:
            _WORKER.stopped = True
            checking = _WORKER.checking
        if checking:
            if not signals_received():
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(600):  # its clean-up, at most a minute
                with _WORKER.lock:
                    if not _WORKER.checking:
                        break
                time.sleep(0.1)
        os._exit(130)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _check_seed(
    seed: int,
    configs: Sequence[str],
    minimise_failures: bool,
    specbox: bool = False,
    readsets: bool = False,
    read_sets: bool = True,
) -> list[dict[str, Any]]:
    """Every configuration of one seed (in a worker process); one result dict per run."""
    layer = specbox_layer() if specbox else None
    if read_sets:
        # the eBPF tracer starts in the background otherwise, and the forks of a worker's
        # first seeds would run untraced while it does
        wait_for_tracer()

    async def main() -> list[dict[str, Any]]:
        # a stop may reach this worker twice (the process group's, then the parent's): the
        # first cancels, the second does not cut the unwinding short
        with interrupt_once():
            return await check()

    async def check() -> list[dict[str, Any]]:
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

    # a worker process: a SIGTERM to it cleans up too; once one seed is interrupted the
    # worker starts no other (the parent is stopping)
    with interrupt_on_signals():
        _WORKER.start()
        interrupted = False
        try:
            with _private_state_root() as root:
                return anyio.run(main)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            _WORKER.finish(interrupted)


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
    names += ("rounds skipped",)
    keys = ("forks_rebased", "cache_hits", "cache_hits_all", "routes_fired", "routed_forks_launched")
    keys += ("routed_forks_reused", "pool_served", "speculative_failures", "drafting_skipped")
    lines = [f"{'config':<10}" + "".join(f"{n:>15}" for n in names)]
    for config, c in layer.items():
        lines.append(f"{config:<10}" + "".join(f"{c[k]:>15}" for k in keys))
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
        with ProcessPoolExecutor(max_workers=args.jobs, initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            pending: set[Future[list[dict[str, Any]]]] = set()
            todo = iter(plan)
            try:
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
            except KeyboardInterrupt:
                # seeds not started are dropped; the running ones are interrupted too (a
                # worker cleans up its own root) and waited for as the pool closes
                pool.shutdown(wait=False, cancel_futures=True)
                for child in multiprocessing.active_children():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGTERM)  # type: ignore[arg-type]
                raise
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
    with _private_state_root() as root:

        async def main() -> list[Any]:
            return [(await check_case(case, state_root=root, layer=layer))[0] for _ in range(args.runs)]

        outcomes = anyio.run(main)
    failed = [o for o in outcomes if o.kind in KINDS]
    if args.json:
        print(json.dumps({"runs": len(outcomes), "failed": len(failed), "outcomes": [o.to_json() for o in outcomes]}))
    else:
        for o in outcomes:
            print(o.summary())
        print(f"{len(failed)} of {len(outcomes)} runs failed")
    return 1 if failed else 0


# -- --actor-server: a real model server as the actor -------------------------------------------

_SERVER_SYSTEM = (
    "You are a shell agent. Answer every task with one bash command in a fenced block, like this:\n"
    "THOUGHT: write a note and show it\n```bash\necho hello > note.txt && cat note.txt\n```"
)
_SERVER_WORDS = ("apple", "river", "stone", "cloud", "maple", "ember", "delta", "quartz", "lumen", "orbit")


def _server_task(seed: int) -> str:
    import random

    rng = random.Random(seed)
    name, word = f"{rng.choice(_SERVER_WORDS)}{seed}.txt", rng.choice(_SERVER_WORDS)
    return rng.choice((
        f"Create the file {name} holding the word {word}, then print it.",
        f"Write {word} into {name} and count its lines.",
        f"Make a directory {word}{seed}, put {name} in it, and list it.",
        f"Print the number {seed} and the word {word}.",
    ))


def _truth_drafters(seed: int, truth: Any) -> Any:
    """Drafters that know the serial run ``truth`` (a History): its observation with
    probability 0.6 next to wrong ones, its next actions with probability 0.5 next to a
    wrong one; pure functions of (seed, history, action)."""
    import random

    from aospec.live.agent import Drafters

    from aospec.protocols import ActionDraft, ObservationDraft
    from aospec.testing import ScriptedActionDrafter, ScriptedObservationDrafter
    from aospec.types import Action

    turns = truth.turns

    def on_path(history: Any) -> int | None:
        k = len(history)
        return k if k <= len(turns) and tuple(history.turns) == tuple(turns[:k]) else None

    def rng(*parts: object) -> random.Random:
        return random.Random("\x1f".join(map(str, (seed, *parts))))

    def observe(history: Any, action: Any) -> list[Any]:
        k = on_path(history)
        r = rng("obs", len(history), action.key)
        drafts = [ObservationDraft("<returncode>0</returncode>\n<output>\n</output>", r.random())]
        if k is not None and k < len(turns) and turns[k].action == action:
            real = turns[k].observation
            drafts.append(ObservationDraft(real + "\n", r.random()))  # almost right: must never be reused
            if r.random() < 0.6:
                drafts.append(ObservationDraft(real, r.random()))
        r.shuffle(drafts)
        return drafts

    def propose(history: Any) -> list[Any]:
        k = on_path(history)
        r = rng("act", len(history))
        drafts = [ActionDraft(Action.bash(f"echo wrong-{r.randrange(100)} > wrong.txt"), 0, r.random())]
        if k is not None:
            for offset in range(2):
                if k + offset < len(turns) and r.random() < 0.5:
                    drafts.append(ActionDraft(turns[k + offset].action, offset, r.random()))
        return drafts

    return Drafters((ScriptedObservationDrafter(observe),), (ScriptedActionDrafter(propose),))


async def _server_run(
    base_url: str, model: str, task: str, steps: int, max_tokens: int, seed: int, truth: Any = None
) -> Any:
    """One agent run on a fresh overlay sandbox: serial (``truth`` None) or speculative
    with :func:`_truth_drafters`; returns (result, snapshot of the final filesystem)."""
    from aospec.live.actors import OpenAIChatActor
    from aospec.live.agent import Agent
    from aospec.live.chat import ChatFormat
    from aospec.runtime import SandboxConfig, open_sandbox
    from aospec.runtime.lossless import snapshot_sandbox

    actor = OpenAIChatActor(base_url, model, chat_format=ChatFormat(system_template=_SERVER_SYSTEM),
                            sampling={"temperature": 0, "max_tokens": max_tokens}, timeout_s=300)
    try:
        async with open_sandbox(SandboxConfig(backend="overlay", timeout_s=10, formatter="mini-swe-agent")) as sb:
            drafters = None if truth is None else _truth_drafters(seed, truth)
            agent = Agent(actor, sb, speculate=truth is not None, drafters=drafters, step_limit=steps)
            result = await agent.run(task)
            return result, await snapshot_sandbox(sb)
    finally:
        await actor.aclose()


_PROC_LINKS = re.compile(r"(?m)^(d[rwx-]{9}\s+)\d+(\s.*\sproc)$")


def _compare_server_runs(serial: Any, spec: Any, serial_fs: Any, spec_fs: Any) -> tuple[str, list[str]]:
    """(kind, problems) of a serial and a speculative agent run of one task.

    A real model runs whatever it likes, and some commands show the host's clock or state
    (``ls -la /`` lists the sandbox root's creation time and, as /proc's link count, the
    host's process count): two runs a minute apart see different bytes there, speculation
    or not. So observations are compared exactly, and where they differ only in those (the
    ``times`` canonicaliser, /proc's link count) the run goes on being compared; if a later reply then
    differs, the model may have read the clock: ``inconclusive``, not a divergence. Every
    other difference is a ``divergence``: a reply that differs after identical histories,
    an observation that differs beyond times, a final version or filesystem (neither
    includes mtimes) that differs."""
    from aospec.drafters.canonicalize import Canonicalizer
    from aospec.runtime.lossless import diff_snapshots

    times = Canonicalizer(("times",)).canonical

    def canonical(text: str) -> str:  # the times, and the link count of /proc (the host's process count)
        return _PROC_LINKS.sub(r"\1<N>\2", times(text))
    a, b = serial.history.turns, spec.history.turns
    clock_at: int | None = None
    for k in range(max(len(a), len(b))):
        if k >= len(a) or k >= len(b) or a[k].action != b[k].action:
            what = f"step {k}: {'the runs have different lengths' if k >= min(len(a), len(b)) else 'replies differ'}"
            if clock_at is not None:
                return "inconclusive", [f"{what} after observations that differed only in times at step {clock_at}"]
            return "divergence", [f"{what} after identical histories ({len(a)} serial, {len(b)} speculative steps)"]
        if a[k].observation != b[k].observation:
            if canonical(a[k].observation) != canonical(b[k].observation):
                return "divergence", [f"step {k}: observations differ beyond times"]
            clock_at = k if clock_at is None else clock_at
    problems = []
    if serial.final_version != spec.final_version:
        problems.append(f"final versions differ: {serial.final_version} vs {spec.final_version}")
    if serial_fs != spec_fs:
        problems.append("filesystems differ: " + "; ".join(diff_snapshots(serial_fs, spec_fs)))
    return ("divergence" if problems else "ok"), problems


def _check_server_seed(base_url: str, model: str, seed: int, steps: int, max_tokens: int) -> dict[str, Any]:
    """The serial and the speculative run of seed ``seed``, compared (one result dict)."""
    root = _private_state_root()
    task = _server_task(seed)
    started = time.perf_counter()

    async def main() -> dict[str, Any]:
        serial, serial_fs = await _server_run(base_url, model, task, steps, max_tokens, seed)
        spec, spec_fs = await _server_run(base_url, model, task, steps, max_tokens, seed, truth=serial.history)
        kind, problems = _compare_server_runs(serial, spec, serial_fs, spec_fs)
        st = spec.statistics
        return {
            "seed": seed, "config": "server", "task": task, "kind": kind,
            "where": "speculative vs serial" if problems else "", "details": problems,
            "steps": len(serial.history.turns),
            "counts": {"drafts_hit": st.drafts_hit, "forks_reused": st.forks_reused,
                       "forks_launched": st.forks_launched},
            "serial_actions": [t.action.key for t in serial.history.turns],
        }

    try:
        result = anyio.run(main)
    except Exception as exc:  # what the engine, the server or a sandbox raises is the finding
        result = {"seed": seed, "config": "server", "task": task, "kind": "aborted", "where": "run",
                  "details": [f"{type(exc).__name__}: {exc}"], "steps": 0, "counts": {}}
    finally:
        leaked = [str(p) for p in root.rglob("*") if os.path.ismount(p)]
        _fs.unmount_all_under(str(root))
        _fs.remove_tree(str(root))
    if leaked and result["kind"] == "ok":
        result.update(kind="leak", where="state root", details=[f"mounts left behind: {', '.join(leaked[:4])}"])
    result["elapsed_s"] = round(time.perf_counter() - started, 3)
    return result


def _run_server(args: argparse.Namespace) -> int:
    """``--actor-server``: ``args.runs`` seeds against one ``transformers serve``."""
    from aospec.drafters.backends.server import transformers_serve

    from aospec.errors import AospecError

    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    totals = {"drafts_hit": 0, "forks_reused": 0, "forks_launched": 0, "steps": 0}
    try:
        with transformers_serve(args.actor_server, threads=args.server_threads) as served:
            for i in range(args.runs):
                r = _check_server_seed(served.base_url, served.model, args.seed + i, args.server_steps,
                                       args.server_max_tokens)
                results.append(r)
                totals["steps"] += r["steps"]
                for k, v in r["counts"].items():
                    totals[k] += v
                bad = [x for x in results if x["kind"] in KINDS]
                if r["kind"] != "ok":
                    print(f"\n{r['kind']}: seed {r['seed']} ({r['task']}): {'; '.join(r['details'])}", file=sys.stderr)
                if sys.stderr.isatty() or len(results) % 10 == 0 or len(results) == args.runs:
                    clock = sum(x["kind"] == "inconclusive" for x in results)
                    print(f"{len(results)}/{args.runs} runs  failures {len(bad)}  inconclusive {clock}  "
                          f"drafts hit {totals['drafts_hit']}  "
                          f"forks reused {totals['forks_reused']}  {time.perf_counter() - started:.0f} s",
                          file=sys.stderr, flush=True)
    except AospecError as exc:
        print(f"check_lossless: {exc}", file=sys.stderr)
        return 2
    failures = [r for r in results if r["kind"] in KINDS]
    elapsed = time.perf_counter() - started
    doc = {
        "actor_server": args.actor_server, "runs": len(results), "seed": args.seed,
        "ok": sum(r["kind"] == "ok" for r in results),
        "inconclusive": sum(r["kind"] == "inconclusive" for r in results),
        "divergences": sum(r["kind"] == "divergence" for r in failures),
        "aborted": sum(r["kind"] == "aborted" for r in failures), "leaks": sum(r["kind"] == "leak" for r in failures),
        **totals, "elapsed_s": round(elapsed, 1),
        "failures": [{k: r.get(k) for k in ("seed", "task", "kind", "where", "details")} for r in failures],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"{doc['runs']} runs against transformers serve {args.actor_server}: {doc['divergences']} divergences, "
              f"{doc['aborted']} aborted, {doc['leaks']} leaks, {doc['inconclusive']} inconclusive (the clock); "
              f"{totals['steps']} steps, drafts hit "
              f"{totals['drafts_hit']}, forks reused {totals['forks_reused']} of {totals['forks_launched']}; "
              f"{elapsed:.0f} s")
    return 1 if failures else 0


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
        "--actor-server",
        metavar="MODEL",
        default=None,
        help="the actor is transformers serve on MODEL (e.g. smollm2), greedy: real-server runs (see above)",
    )
    parser.add_argument("--server-steps", type=int, default=2, help="with --actor-server: agent steps per run")
    parser.add_argument("--server-max-tokens", type=int, default=16, help="with --actor-server: tokens per reply")
    parser.add_argument("--server-threads", type=int, default=1, help="with --actor-server: the server's threads")
    parser.add_argument(
        "--readsets",
        action="store_true",
        help="read-set validation cases: metadata, listings, missing files, unrelated writes, lookahead 2-4",
    )
    parser.add_argument(
        "--read-sets", choices=("on", "off"), default="on", help="read-set validation in the engine (default on)"
    )
    args = parser.parse_args(argv)
    if args.actor_server is not None:
        if args.repro or args.jobs != 1 or args.specbox:
            parser.error("--actor-server runs alone: no --repro, --jobs or --specbox")
        if args.server_steps < 1 or args.server_max_tokens < 1 or args.server_threads < 1:
            parser.error("--server-steps, --server-max-tokens and --server-threads must be >= 1")
        args.runs = 100 if args.runs is None else args.runs
        if args.runs < 1 or args.seed < 0:
            parser.error("--runs must be >= 1, --seed >= 0")
        if os.geteuid() != 0:
            parser.error("needs root (overlayfs mounts)")
        return _run_server(args)
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
    try:
        with interrupt_on_signals():  # SIGTERM and SIGHUP stop the runs as Ctrl-C does
            return _repro(args) if args.repro else _run(args, configs)
    except KeyboardInterrupt:
        print("\ncheck_lossless: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
