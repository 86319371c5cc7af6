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

from aospec.cli import add_format_option, print_json, print_table

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
    p.add_argument("--traces", nargs="+", required=True, metavar="PATH", help="trace files or directories")
    p.add_argument("--base-model", default="tiny", metavar="SHAPE|PATH",
                   help="tiny/small/qwen3-0.6b (random init, tokenizer trained on the traces) or a local model dir")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="mode", action="store_const", const="lora", help="LoRA fine-tune (peft)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full", help="full fine-tune")
    p.set_defaults(mode="auto")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--kind", choices=("observation", "action"), default="observation", help="what the model drafts")
    p.add_argument("--depth", type=int, default=3, help="actions per target for --kind action (default 3)")
    p.add_argument("--steps", type=int, default=200, help="optimisation steps (default 200)")
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


def _run(args: argparse.Namespace) -> int:
    from aospec.drafters.model import check_model_spec, fix_modes
    from aospec.training.trainer import TrainConfig, train

    from aospec.config import from_mapping

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
        },
        where="aospec train",
    )
    check_model_spec(config.base_model)
    out = Path(config.out)
    created = not out.exists()
    try:
        result = train(config)
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
        (f"top-1 exact match ({result.evaluated} examples)", pct(result.top1)),
        ("top-5 exact match", pct(result.top5)),
        ("most-frequent baseline top-1 / top-5", f"{pct(result.baseline_top1)} / {pct(result.baseline_top5)}"),
        ("seconds", f"{result.seconds:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    print_table(table)
    return 0


def _resumable(out: Path) -> bool:
    """Whether ``out`` holds a complete checkpoint (what ``--resume`` continues from)."""
    return any(p.name[5:].isdigit() for p in (out / "checkpoints").glob("step-*"))
