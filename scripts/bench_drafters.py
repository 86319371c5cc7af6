"""Benchmarks of the LM drafters (prints tables; writes JSON and PNG plots to --out).

1. latency: ms per decode step, per token and per candidate, by backend path and batch
   size (transformers paths; the OpenAI-compatible backend through a local server);
2. accuracy vs width: observation top-k exact match by number of candidates, and action
   drafters' trace-matched accuracy by width (1..32) and lookahead distance (1..10);
3. replay: hidden tool time and saving by rank rule (EVD, likelihood, tool time) and EVD
   kernel (pattern, embedding), AOSpec with the LM observation drafter;
4. actions: the action drafters' accuracy alone (no observation LM), by width and
   distance, leave-one-task-out with ``--split loto`` (drafter options ``--history-options``).

    .venv/bin/python scripts/bench_drafters.py --traces replay/data/tb1-sample --out out/bench-drafters
    .venv/bin/python scripts/bench_drafters.py --model out/train --sections latency,accuracy
    .venv/bin/python scripts/bench_drafters.py --sections actions --split loto --limit 0 \
        --traces ../shared/traces/tb1-mini-swe-agent-claude-sonnet-4

On a CPU, pin the threads (``OMP_NUM_THREADS=1``) or the latency figures mostly measure
contention with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*[f"{x:.3f}" if isinstance(x, float) else str(x) for x in r])
    Console(width=200).print(t)


def plot(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", ms=3, label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- 1. latency


def bench_latency(args: argparse.Namespace, traces: list[Any], out: Path) -> dict[str, Any]:
    from aospec.drafters.backends.server import CompletionServer
    from aospec.drafters.backends.transformers import TransformersBackend
    from aospec.drafters.prompts import PromptBudget, observation_messages

    texts = [x for t in traces for s in t.steps for x in (s.action.command or "", s.observation)]
    backend = TransformersBackend(args.model, texts=texts, device=args.device, decode="dynamic", offload="inline")
    trace = max(traces, key=len)
    i = min(len(trace) - 1, 8)
    prompt = backend.render(observation_messages(trace.history(i), trace.steps[i].action,
                                                 PromptBudget(args.prompt_tokens, 128, 192), backend.count_tokens))
    gpu = backend.device.startswith("cuda")
    paths = [p for p in args.paths if p != "cuda_graph" or gpu]
    if "compile" in paths and not gpu and not (shutil.which("cc") or shutil.which("gcc")):
        print("latency: compile skipped (torch.compile on a CPU needs a C/C++ compiler: apt-get install g++)",
              file=sys.stderr)
        paths.remove("compile")
    rows, results = [], []

    def timed(fn: Any) -> tuple[float, Any]:
        fn()
        best, res = float("inf"), None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = fn()
            best = min(best, time.perf_counter() - t0)
        return best, res

    for path in paths:
        backend.decode = path
        backend.fallback_reason = None
        for batch in args.batches:
            t1, _ = timed(lambda b=batch: backend.complete_sync(prompt, n=b, max_new_tokens=1, mode="sample"))
            tn, comps = timed(lambda b=batch: backend.complete_sync(prompt, n=b, max_new_tokens=args.new_tokens))
            if backend.decode != path:  # compile/capture failed: the backend went on with static
                print(f"latency: {path} fell back to {backend.decode}: {backend.fallback_reason}", file=sys.stderr)
                break
            steps = max(c.tokens for c in comps)
            step_ms = max(0.0, tn - t1) * 1e3 / max(1, steps - 1)
            rec = {"backend": f"transformers/{path}", "batch": batch, "ms_per_step": step_ms,
                   "ms_per_token": step_ms / batch, "ms_per_candidate": tn * 1e3 / batch, "prefill_ms": t1 * 1e3}
            results.append(rec)
            rows.append([rec["backend"], batch, step_ms, step_ms / batch, tn * 1e3 / batch, t1 * 1e3])
    backend.decode = "dynamic"
    import anyio
    from aospec.drafters.backends.openai import OpenAIBackend

    with CompletionServer(backend, name="bench").running() as url:
        remote = OpenAIBackend("bench", base_url=url)
        for batch in args.batches:
            t1, _ = timed(lambda b=batch: anyio.run(lambda: remote.complete(prompt, n=b, max_new_tokens=1)))
            tn, comps = timed(lambda b=batch: anyio.run(lambda: remote.complete(prompt, n=b, max_new_tokens=args.new_tokens)))
            steps = max(c.tokens for c in comps)
            step_ms = max(0.0, tn - t1) * 1e3 / max(1, steps - 1)
            rec = {"backend": "openai (local server)", "batch": batch, "ms_per_step": step_ms,
                   "ms_per_token": step_ms / batch, "ms_per_candidate": tn * 1e3 / batch, "prefill_ms": t1 * 1e3}
            results.append(rec)
            rows.append([rec["backend"], batch, step_ms, step_ms / batch, tn * 1e3 / batch, t1 * 1e3])
    table(f"drafting latency ({args.model}, {backend.device}, prompt {backend.count_tokens(prompt)} tokens, "
          f"{args.new_tokens} new)", ["backend", "batch", "ms/step", "ms/token", "ms/candidate", "prefill ms"], rows)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in results:
        xs, ys = series.setdefault(r["backend"], ([], []))
        xs.append(r["batch"])
        ys.append(r["ms_per_token"])
    plot(out / "latency_per_token.png", "drafting latency per token", "batch (candidates)", "ms per token", series)
    return {"latency": results}


# ---------------------------------------------------------------- 2. accuracy


def bench_accuracy(args: argparse.Namespace, train: list[Any], evals: list[Any], out: Path) -> dict[str, Any]:
    from aospec.drafters import resolve
    from aospec.drafters.backends import merge_completions
    from aospec.drafters.lm import LMActionDrafter, LMObservationDrafter

    def options(model: str) -> dict[str, Any]:
        if model in ("tiny", "small"):  # trained here; a trained directory brings its own budgets
            return dict(device=args.device, prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                        fit_steps=args.fit_steps)
        return dict(device=args.device)

    obs = LMObservationDrafter(model=args.model, samples=max(args.widths_obs), **options(args.model))
    obs.fit(train)
    steps = [(t, i) for t in evals for i, s in enumerate(t.steps) if s.completed][: args.limit or None]
    hits = {w: 0 for w in args.widths_obs}
    for trace, i in steps:
        prompt = obs.prompt(trace.history(i), trace.steps[i].action)
        comps = obs.backend.complete_sync(prompt, n=max(args.widths_obs), max_new_tokens=obs.max_new_tokens, seed=0)
        texts = [c.text for c in merge_completions(comps) if c.finished]
        for w in args.widths_obs:
            hits[w] += trace.steps[i].observation in texts[:w]
    obs_rows = [[w, hits[w] / max(1, len(steps))] for w in args.widths_obs]
    table(f"observation exact match vs candidates ({len(steps)} held-out steps)", ["width", "top-k match"], obs_rows)

    drafters: dict[str, Any] = {"history": resolve("action drafter", "history")(**args.history_options)}
    action_model = args.action_model or (args.model if args.model in ("tiny", "small") else None)
    if action_model is not None:
        drafters["lm"] = LMActionDrafter(model=action_model, samples=32, **options(action_model))
    action_results = action_accuracy(drafters, [(train, evals)], args.limit, out)
    return {"observation_topk": dict(obs_rows), "actions": action_results}


ACTION_WIDTHS = [1, 2, 4, 8, 16, 32]
ACTION_DISTANCES = list(range(1, 11))


def action_accuracy(drafters: dict[str, Any], folds: list[tuple[list[Any], list[Any]]], limit: int,
                    out: Path, title: str = "") -> dict[str, Any]:
    """Trace-matched accuracy of action drafters: next action within the top ``width``
    (1..32), and the action ``distance`` steps ahead (1..10) within the top 8 proposed at
    that offset. Each drafter is fit on a fold's training traces and scored on its
    evaluation traces (``limit`` steps in all; 0 = every step)."""
    import anyio

    widths, distances = ACTION_WIDTHS, ACTION_DISTANCES
    action_results: dict[str, Any] = {}
    for name, drafter in drafters.items():
        by_width = {w: 0 for w in widths}
        by_dist = {d: [0, 0] for d in distances}
        count = 0
        for train, evals in folds:
            if limit and count >= limit:
                break
            if hasattr(drafter, "fit"):
                drafter.fit(train)
            for trace, i in [(t, i) for t in evals for i in range(len(t.steps))]:
                if limit and count >= limit:
                    break
                drafts = anyio.run(drafter.propose, trace.history(i), max(widths), max(distances))
                count += 1
                for d in distances:
                    if i + d - 1 >= len(trace.steps):
                        continue
                    target = trace.steps[i + d - 1].action
                    ranked = [x.action for x in drafts if x.offset == d - 1]
                    by_dist[d][1] += 1
                    by_dist[d][0] += target in ranked[:8]
                    if d == 1:
                        for w in widths:
                            by_width[w] += target in ranked[:w]
        action_results[name] = {
            "by_width": {w: by_width[w] / max(1, count) for w in widths},
            "by_distance_top8": {d: (h / n if n else None) for d, (h, n) in by_dist.items()},
            "steps": count,
        }
    steps = max((r["steps"] for r in action_results.values()), default=0)
    table(f"action drafters{title}: next-action accuracy by width ({steps} steps)", ["width", *drafters],
          [[w, *[action_results[n]["by_width"][w] for n in drafters]] for w in widths])
    table(f"action drafters{title}: accuracy by lookahead distance (top 8 at that offset)", ["distance", *drafters],
          [[d, *["-" if (v := action_results[n]["by_distance_top8"][d]) is None else v for n in drafters]]
           for d in distances])
    plot(out / "action_accuracy_by_width.png", "next-action accuracy by width", "width", "accuracy",
         {n: (widths, [action_results[n]["by_width"][w] for w in widths]) for n in drafters})
    plot(out / "action_accuracy_by_distance.png", "accuracy by lookahead distance (top 8)", "distance", "accuracy",
         {n: (distances, [action_results[n]["by_distance_top8"][d] or 0.0 for d in distances]) for n in drafters})
    return action_results


def bench_actions(args: argparse.Namespace, traces: list[Any], out: Path) -> dict[str, Any]:
    """Action drafters only (no observation LM): history drafter (options from
    ``--history-options``) and, with ``--action-model``, the LM action drafter; folds by
    ``--split`` (``loto``: leave one task out; ``holdout``: the 20% task split). Traces from
    ``--extra-train`` join every fold's training set (e.g. another harness's traces)."""
    from aospec.drafters import resolve
    from aospec.drafters.lm import LMActionDrafter
    from aospec.replay import load_traces
    from aospec.training.dataset import split_by_task

    extra = load_traces(args.extra_train) if args.extra_train else []
    if args.split == "loto":
        tasks = sorted({t.task for t in traces})
        folds = [([t for t in traces if t.task != task] + extra, [t for t in traces if t.task == task])
                 for task in tasks]
    else:
        train, evals, _ = split_by_task(
            traces, eval_tasks=args.eval_tasks.split(",") if args.eval_tasks else None, eval_fraction=0.2, seed=0
        )
        folds = [(train + extra, evals)]
    drafters: dict[str, Any] = {"history": resolve("action drafter", "history")(**args.history_options)}
    if args.action_model:
        drafters["lm"] = LMActionDrafter(model=args.action_model, samples=32, device=args.device)
    t0 = time.perf_counter()
    results = action_accuracy(drafters, folds, args.limit, out, f" ({args.split})")
    print(f"action accuracy: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return {"actions": results, "split": args.split, "history_options": args.history_options,
            "extra_train": args.extra_train}


# ---------------------------------------------------------------- 3. replay


def bench_replay(args: argparse.Namespace, train: list[Any], evals: list[Any], out: Path) -> dict[str, Any]:
    from aospec.replay.policies import parse_policies
    from aospec.replay.sweep import run_sweep

    # A small branch budget makes the ranking matter: with few candidates per action, every
    # rule launches the same ones.
    b = f":branch_budget={args.branch_budget}"
    lm = f"lm+patterns+cache:draft_tpot_ms={args.draft_tpot_ms}"
    specs = ["serial", "aospec", f"aospec:obs_drafter={lm}"]
    for base in (f"aospec:obs_drafter={lm}{b}", f"aospec{b}"):
        specs += [base, f"{base}:rank=likelihood", f"{base}:rank=tooltime", f"{base}:kernel=embedding"]
    lm: dict[str, Any] = {"model": args.model, "device": args.device, "samples": 8}
    if args.model in ("tiny", "small"):
        lm.update(prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, fit_steps=args.fit_steps)
    options = {"lm": lm, "embedding": {"encoder": args.kernel_encoder}}
    t0 = time.perf_counter()
    results = run_sweep(evals, parse_policies(specs), train_traces=train, tpots_ms=args.tpots, drafter_options=options)
    seconds = time.perf_counter() - t0
    rows, out_rows = [], []
    for spec in specs:
        for tpot in args.tpots:
            rs = [r for r in results if r.policy == spec and r.tpot_ms == tpot]
            saving = sum(r.saving for r in rs) / len(rs)
            hidden = sum(r.hidden_tool_ns for r in rs) / 1e9
            started = sum(r.drafts_started for r in rs)
            hit = sum(r.drafts_hit for r in rs) / started if started else 0.0
            rows.append([spec, tpot, saving, hidden, hit])
            out_rows.append({"policy": spec, "tpot_ms": tpot, "mean_saving": saving, "hidden_tool_s": hidden,
                             "draft_hit_rate": hit})
    table(f"replay ({len(evals)} eval traces, {seconds:.0f}s)", ["policy", "TPOT ms", "saving", "hidden tool s",
                                                                 "draft hit rate"], rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.35 * len(specs) + 1.5))
    width = 0.8 / len(args.tpots)
    for k, tpot in enumerate(args.tpots):
        vals = [next(r["hidden_tool_s"] for r in out_rows if r["policy"] == sp and r["tpot_ms"] == tpot) for sp in specs]
        ax.barh([i + k * width for i in range(len(specs))], vals, height=width, label=f"TPOT {tpot:g} ms")
    ax.set_yticks([i + width * (len(args.tpots) - 1) / 2 for i in range(len(specs))], specs, fontsize=7)
    ax.set_xlabel("tool time hidden (s, all eval traces)")
    ax.set_title("hidden tool time by policy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "replay_hidden_time.png", dpi=120)
    plt.close(fig)
    return {"replay": out_rows, "replay_seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default=None, help="trace dir (default: the bundled tb1 sample)")
    p.add_argument("--model", default="tiny", help="shape (trained here with --fit-steps) or a trained model dir")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sections", default="latency,accuracy,replay")
    p.add_argument("--out", default="out/bench-drafters")
    p.add_argument("--paths", type=lambda s: s.split(","), default=["generate", "dynamic", "static", "compile", "cuda_graph"],
                   help="transformers decode paths timed (cuda_graph only on a GPU; compile needs a C compiler on a CPU)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--widths-obs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=384)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--fit-steps", type=int, default=150)
    p.add_argument("--limit", type=int, default=60, help="held-out steps evaluated per accuracy table (0: all)")
    p.add_argument("--split", choices=("holdout", "loto"), default="holdout",
                   help="folds of the actions section: 20%% held-out tasks, or leave-one-task-out")
    p.add_argument("--history-options", type=json.loads, default={},
                   help='keyword options of the history action drafter as JSON, e.g. \'{"half_life": 0}\'')
    p.add_argument("--extra-train", default=None, help="trace dir added to every training fold (actions section)")
    p.add_argument("--eval-tasks", default=None, help="comma-separated held-out tasks (default: 20%% by seed 0)")
    p.add_argument("--tpots", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 1.0])
    p.add_argument("--kernel-encoder", default="minilm")
    p.add_argument("--branch-budget", type=int, default=1, help="branch budget of the ranking comparisons")
    p.add_argument("--draft-tpot-ms", type=float, default=5.0,
                   help="virtual drafting time per LM token in replay (the replay default is 5 ms)")
    p.add_argument("--action-model", default=None,
                   help="LM action drafter model (an `aospec train --kind action` dir; default: --model if a shape)")
    args = p.parse_args()

    from aospec.replay import bundled_traces_path, load_traces
    from aospec.training.dataset import split_by_task

    traces = load_traces([args.traces or bundled_traces_path()])
    train, evals, held = split_by_task(
        traces, eval_tasks=args.eval_tasks.split(",") if args.eval_tasks else None, eval_fraction=0.2, seed=0
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": args.model, "device": args.device, "eval_tasks": held}
    sections = set(args.sections.split(","))
    if "latency" in sections:
        report.update(bench_latency(args, traces, out))
    if "accuracy" in sections:
        report.update(bench_accuracy(args, train, evals, out))
    if "actions" in sections:
        report.update(bench_actions(args, traces, out))
    if "replay" in sections:
        report.update(bench_replay(args, train, evals, out))
    (out / "bench_drafters.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {out / 'bench_drafters.json'} and plots", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
