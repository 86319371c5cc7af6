"""``aospec train``: fine-tune a per-harness drafter model on traces (an ``aospec.commands``
entry point).

The base model is checked before anything is written; a run that fails before its first
checkpoint removes the output directory it created (a later failure keeps it, so
``--resume`` can continue). Files are written with the modes the umask gives (0644 under
umask 022), also the weights, which safetensors writes 0600.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from aospec.cli import add_alias, add_format_option, print_json, print_table
from aospec.errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``train`` verb."""
    p = sub.add_parser(
        "train",
        help="fine-tune the observation (or action) drafter model on traces",
        description=(
            "Build (history, action) -> observation examples from traces, split by task, fine-tune a "
            "Qwen3-architecture model (LoRA or full) with checkpoints, export it (PEFT adapter for vLLM "
            "--enable-lora, or full weights) and report top-1/top-5 exact match on the held-out tasks."
        ),
    )
    # required, checked in _train: the deprecated --traces satisfies it too
    p.add_argument("--train-traces", dest="traces", nargs="+", metavar="PATH", help="trace files or directories (required)")
    add_alias(p, "--traces", "--train-traces")
    p.add_argument("--base-model", default="tiny", metavar="SHAPE|NAME|PATH",
                   help="tiny/small/qwen3-0.6b (random init, tokenizer trained on the traces), smollm2 (pretrained, "
                   "the models extra), a .gguf file or a local model dir")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="mode", action="store_const", const="lora", help="LoRA fine-tune (peft)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="full fine-tune")
    p.set_defaults(mode="auto")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--kind", choices=("observation", "action"), default="observation", help="what the model drafts")
    p.add_argument("--depth", type=int, default=3, help="actions per target for --kind action (default 3)")
    p.add_argument("--steps", type=int, default=200, help="optimisation steps (default 200)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MIN",
                   help="end training after MIN minutes (then export and evaluate); default 30 for a pretrained "
                   "base on a CPU, none otherwise; 0: no limit")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the cores this process may use; OMP_WAIT_POLICY=PASSIVE unless set)")
    p.add_argument("--autocast", choices=("auto", "on", "off"), default="auto",
                   help="bfloat16 autocast (auto: on a GPU, and on a CPU with native bf16 for a pretrained base)")
    p.add_argument("--eval-frozen", action=argparse.BooleanOptionalAction, default=None,
                   help="also evaluate the frozen base model (default: for a pretrained base)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop after N steps of this run (resume later with --resume)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default by base and mode)")
    p.add_argument("--prompt-tokens", type=int, default=512,
                   help="prompt token budget (default 512, CPU-friendly; use 2048+ for real models on a GPU)")
    p.add_argument("--target-tokens", type=int, default=128, help="target/generation token limit (default 128)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer size for shape bases (default 4096)")
    p.add_argument("--eval-fraction", type=float, default=0.2, help="share of tasks held out (default 0.2)")
    p.add_argument("--eval-tasks", nargs="+", default=None, metavar="TASK", help="hold out exactly these tasks")
    p.add_argument("--eval-limit", type=int, default=48, help="held-out examples evaluated (default 48)")
    p.add_argument("--eval-samples", type=int, default=8, help="candidates drawn per example (default 8)")
    p.add_argument("--eval-mode", choices=("sample", "greedy", "beam"), default="sample")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    add_format_option(p)
    p.set_defaults(func=_run)


def _threads(requested: int | None) -> int:
    """The CPU threads of a run. OpenMP's default wait policy spins idle threads, and with
    other processes on the cores two spinning threads ran a step ~20x slower than one:
    PASSIVE (set before torch starts OpenMP, unless the user set a policy) avoids that."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return requested if requested is not None else max(1, len(os.sched_getaffinity(0)))


def _run(args: argparse.Namespace) -> int:
    import sys

    if not args.traces:
        raise ConfigError("--train-traces PATH... is required: the traces to train on")

    from aospec.drafters.model import check_model_spec, fix_modes, is_shape, resolve_device
    from aospec.training.trainer import TrainConfig, train

    from aospec.config import from_mapping

    threads = _threads(args.threads)
    limit = args.time_limit
    if limit is None and not is_shape(args.base_model) and resolve_device(args.device) == "cpu":
        limit = 30.0  # a pretrained model on a CPU: half an hour by default, then export and evaluate

    config = from_mapping(
        TrainConfig,
        {
            "traces": tuple(args.traces),
            "out": args.out,
            "base_model": args.base_model,
            "mode": args.mode,
            "kind": args.kind,
            "depth": args.depth,
            "steps": args.steps,
            "stop_after": args.stop_after,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "prompt_tokens": args.prompt_tokens,
            "target_tokens": args.target_tokens,
            "vocab_size": args.vocab_size,
            "eval_fraction": args.eval_fraction,
            "eval_tasks": tuple(args.eval_tasks) if args.eval_tasks else None,
            "eval_limit": args.eval_limit,
            "eval_samples": args.eval_samples,
            "eval_mode": args.eval_mode,
            "checkpoint_every": args.checkpoint_every,
            "resume": args.resume,
            "lora_r": args.lora_r,
            "seed": args.seed,
            "device": args.device,
            "threads": threads,
            "time_limit_s": limit * 60 if limit else None,
            "autocast": args.autocast,
            "eval_frozen": args.eval_frozen,
        },
        where="aospec train",
    )
    check_model_spec(config.base_model)
    out = Path(config.out)
    created = not out.exists()
    try:
        log = None if sys.stderr.isatty() else (lambda line: print(f"aospec train: {line}", file=sys.stderr, flush=True))
        result = train(config, log=log)
    except BaseException:
        if created and not _resumable(out):
            shutil.rmtree(out, ignore_errors=True)  # nothing to resume: leave no half-made directory
        elif out.is_dir():
            fix_modes(out)
        raise
    fix_modes(out)
    summary = result.summary()
    if args.format == "json":
        print_json({k: summary[k] for k in ("examples", "steps", "eval_tasks", "top1", "top5", "seconds")} | summary)
        return 0
    from rich.table import Table

    table = Table(title=f"aospec train -> {result.out}")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows = [
        ("examples (train / eval)", f"{result.train_examples} / {result.eval_examples}"),
        ("held-out tasks", ", ".join(result.eval_tasks)),
        ("steps", str(result.steps) + (f" (resumed from {result.resumed_from})" if result.resumed_from else "")),
        ("final loss", "-" if result.final_loss is None else f"{result.final_loss:.4f}"),
        (f"the model alone top-1 / top-5 ({result.evaluated} held-out examples)",
         f"{pct(result.model_top1)} / {pct(result.model_top5)}"),
        ("drafts (model + frequency prior) top-1 / top-5", f"{pct(result.top1)} / {pct(result.top5)}"),
        ("most-frequent baseline top-1 / top-5", f"{pct(result.baseline_top1)} / {pct(result.baseline_top5)}"),
    ]
    if result.frozen_top1 is not None:
        rows.append(("frozen base model top-1 / top-5", f"{pct(result.frozen_top1)} / {pct(result.frozen_top5)}"))
    for b in result.buckets:
        parts = [f"model {pct(b['model_top1'])}", f"baseline {pct(b['baseline_top1'])}"]
        if "frozen_top1" in b:
            parts.append(f"frozen {pct(b['frozen_top1'])}")
        rows.append((f"top-1, calls {b['bucket']} ({b['examples']} examples)", ", ".join(parts)))
    rows.append(("seconds", f"{result.seconds:.1f}"))
    for k, v in rows:
        table.add_row(k, v)
    print_table(table)
    return 0



def _resumable(out: Path) -> bool:
    """Whether ``out`` holds a complete checkpoint (what ``--resume`` continues from)."""
    return any(p.name[5:].isdigit() for p in (out / "checkpoints").glob("step-*"))


def register_models(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``models`` verb: the pretrained models known by name, their converted directories
    and ``transformers serve`` on them."""
    p = sub.add_parser(
        "models",
        help="list, convert and serve the pretrained models known by name (smollm2)",
        description="Pretrained models by name (the models extra). `path NAME` converts one once into the model "
        "cache ($AOSPEC_CACHE_DIR/models, default ~/.cache/aospec/models) and prints its directory; "
        "`serve NAME` runs transformers serve on it (offline, loopback) until interrupted.",
    )
    verbs = p.add_subparsers(dest="models_verb", required=True)
    verbs.add_parser("list", help="the models known by name, whether installed, and where they are cached")
    path = verbs.add_parser("path", help="convert a model once (a name or a .gguf file) and print its directory")
    path.add_argument("model", metavar="NAME|FILE.gguf")
    serve = verbs.add_parser("serve", help="run transformers serve on a model until interrupted")
    serve.add_argument("model", metavar="NAME|FILE.gguf|DIR")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--threads", type=int, default=1, help="CPU threads of the server (default 1)")
    serve.add_argument("--device", default="cpu")
    add_format_option(p)
    p.set_defaults(func=_models)


def _models(args: argparse.Namespace) -> int:
    from aospec.drafters.model import NAMED_MODELS, models_dir, named_model_file, resolve_model

    from aospec.errors import MissingDependencyError

    if args.models_verb == "list":
        rows = []
        for name, named in NAMED_MODELS.items():
            try:
                source: str | None = str(named_model_file(name))
            except MissingDependencyError:
                source = None
            rows.append({"name": name, "description": named.description, "installed": source is not None,
                         "source": source, "cache": str(models_dir() / name), "install": named.install_hint()})
        if args.format == "json":
            print_json({"models": rows, "cache": str(models_dir())})
            return 0
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"models (cache {models_dir()})")
        for col in ("name", "description", "installed", "install"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(r["name"], r["description"], "yes" if r["installed"] else "no", escape(r["install"]))
        print_table(table)
        return 0
    if args.models_verb == "path":
        print(resolve_model(args.model))
        return 0
    import contextlib
    import threading

    from aospec.drafters.backends.server import transformers_serve

    with transformers_serve(args.model, port=args.port, threads=args.threads, device=args.device) as served:
        print(f"serving {served.model} at {served.base_url} (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0
