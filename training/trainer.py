"""Fine-tuning of drafter models (LoRA with peft, or full) with checkpoints, resume and eval.

Output directory of :func:`train`::

    OUT/aospec-model.json    what was trained: kind, mode, base, shape, options, metrics
    OUT/tokenizer/           the tokenizer (trained on the training split for shape bases)
    OUT/base/                the base weights, when the base was built here (shape bases)
    OUT/adapter/             LoRA: PEFT adapter_config.json + adapter_model.safetensors
    OUT/model/               full fine-tune: the whole model
    OUT/checkpoints/step-N/  resumable state (weights or adapter, optimizer, scheduler)
    OUT/metrics.json         training loss curve and the held-out evaluation
    OUT/loss.png             the loss curve

Serve a LoRA result with vLLM: ``vllm serve OUT/base --enable-lora --lora-modules
obs=OUT/adapter`` (for a local base directory, serve that directory instead of OUT/base).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from aospec.drafters.examples import Example, ExampleKind, build_examples
from aospec.drafters.finetune import bf16_autocast_helps, encode_example, end_token, fit_examples
from aospec.drafters.lm import fit_calibration
from aospec.drafters.model import (
    MODEL_META,
    is_shape,
    load_model,
    make_portable,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from aospec.drafters.prior import FrequencyPrior
from aospec.drafters.prompts import ACTION_SEPARATOR, PromptBudget
from aospec.training.dataset import split_by_task

from aospec._lazy import require
from aospec.errors import ConfigError
from aospec.types import Trace

__all__ = [
    "BUCKETS",
    "TrainConfig",
    "TrainResult",
    "bucket_of",
    "encode_example",
    "evaluate",
    "fit_examples",
    "rank_candidates",
    "top_k",
    "train",
]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainConfig:
    """Options of ``aospec train`` (and of :func:`train`)."""

    traces: tuple[str, ...] = ()
    out: str = "out/train"
    base_model: str = "tiny"
    mode: Literal["auto", "lora", "full"] = "auto"
    kind: ExampleKind = "observation"
    depth: int = 3
    steps: int = 200
    stop_after: int | None = None
    time_limit_s: float | None = None
    batch_size: int = 8
    lr: float | None = None
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    prompt_tokens: int = 512
    target_tokens: int = 128
    vocab_size: int = 4096
    oversample: int = 3
    min_tool_time_s: float = 1.0
    eval_fraction: float = 0.2
    eval_tasks: tuple[str, ...] | None = None
    eval_limit: int = 48
    eval_samples: int = 8
    eval_mode: Literal["sample", "greedy", "beam"] = "sample"
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    resume: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    autocast: Literal["auto", "on", "off"] = "auto"
    eval_frozen: bool | None = None
    calibrate: bool = True

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "full" if is_shape(self.base_model) else "lora"

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-3 if is_shape(self.base_model) else (2e-4 if self.resolved_mode() == "lora" else 2e-5)

    def resolved_autocast(self, device: str) -> bool:
        """bfloat16 autocast: ``on``/``off``, or ``auto``: on a GPU, and on a CPU with
        native bfloat16 for a pretrained base (shape bases keep float32 on a CPU)."""
        if self.autocast != "auto":
            return self.autocast == "on"
        return device.startswith("cuda") or (not is_shape(self.base_model) and bf16_autocast_helps(device))

    def budget(self) -> PromptBudget:
        return PromptBudget(
            total=self.prompt_tokens, task=max(16, self.prompt_tokens // 4), text=max(32, self.prompt_tokens * 3 // 8)
        )


@dataclass(frozen=True)
class TrainResult:
    """Summary of a training run (the JSON line of ``aospec train --format json``)."""

    examples: int
    train_examples: int
    eval_examples: int
    steps: int
    eval_tasks: tuple[str, ...]
    top1: float | None
    top5: float | None
    seconds: float
    out: str
    baseline_top1: float | None = None
    baseline_top5: float | None = None
    model_top1: float | None = None
    model_top5: float | None = None
    frozen_top1: float | None = None
    frozen_top5: float | None = None
    final_loss: float | None = None
    evaluated: int = 0
    resumed_from: int | None = None
    buckets: tuple[dict[str, Any], ...] = ()
    losses: tuple[tuple[int, float], ...] = field(default=(), repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("losses")
        d["eval_tasks"] = list(self.eval_tasks)
        d["buckets"] = [dict(b) for b in self.buckets]
        return d


def _first(target: str, kind: ExampleKind) -> str:
    return target.split(ACTION_SEPARATOR)[0] if kind == "action" else target


def frequency_prior(train: Sequence[Example], *, kind: ExampleKind = "observation") -> FrequencyPrior:
    """The frequency prior of the training targets (for actions: of the first action), the
    one the LM drafters interpolate with (:mod:`aospec.drafters.prior`)."""
    return FrequencyPrior.of(_first(e.target, kind) for e in train)


def _first_actions(comps: Sequence[Any], prior: FrequencyPrior) -> list[str]:
    """Distinct first actions of sampled chains ranked like ``LMActionDrafter`` at offset 0:
    by the fraction of samples holding them (ties: the better sequence probability),
    interpolated with ``prior``."""
    from aospec.drafters.prior import interpolate

    seen: dict[str, list[float]] = {}
    for c in comps:
        if c.finished or ACTION_SEPARATOR in c.text:
            first = c.text.split(ACTION_SEPARATOR)[0]
            if first.strip():
                rec = seen.setdefault(first, [0, c.logprob])
                rec[0] += 1
                rec[1] = max(rec[1], c.logprob)
    model = sorted(seen.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))
    usable = sum(int(rec[0]) for rec in seen.values())
    candidates = [(text, rec[0] / len(comps)) for text, rec in model]
    return [text for text, _ in interpolate(candidates, prior.top, finished_samples=usable)]


def evaluate(
    backend: Any,
    examples: Sequence[Example],
    *,
    samples: int = 8,
    mode: str = "sample",
    max_new_tokens: int = 256,
    kind: ExampleKind = "observation",
    description: str = "evaluating",
    prior: FrequencyPrior | None = None,
) -> tuple[float | None, float | None, int]:
    """Top-1 and top-5 exact match of ``backend``'s drafts on ``examples``: the distinct
    candidates the LM drafter would propose, i.e. its finished samples interpolated with
    the training set's frequency ``prior`` (none: the model's alone), most probable first.
    Returns (top1, top5, examples evaluated)."""
    (ranked,) = rank_candidates(backend, examples, samples=samples, mode=mode, max_new_tokens=max_new_tokens,
                                kind=kind, description=description, priors=(prior or FrequencyPrior(),))
    return (*top_k(ranked, examples, kind), len(examples)) if examples else (None, None, 0)


def rank_candidates(
    backend: Any,
    examples: Sequence[Example],
    *,
    samples: int,
    mode: str,
    max_new_tokens: int,
    kind: ExampleKind,
    description: str,
    priors: Sequence[FrequencyPrior],
    log: Callable[[str], None] | None = None,
) -> list[list[list[tuple[str, float]]]]:
    """For each of ``priors`` and each example: the candidates (text, probability) the LM
    drafter would propose from one set of samples (:func:`evaluate`), most probable first.
    ``log`` gets a line every eighth example."""
    from aospec.drafters.lm import rank_observations

    from aospec.progress import track

    out: list[list[list[tuple[str, float]]]] = [[] for _ in priors]
    started = time.perf_counter()
    for k, ex in enumerate(track(examples, description)):
        if log is not None and k and k % 8 == 0:
            per = (time.perf_counter() - started) / k
            log(f"{description}: {k}/{len(examples)} examples ({per:.1f} s each)")
        prompt = backend.render(ex.chat())
        comps = backend.complete_sync(prompt, n=samples, max_new_tokens=max_new_tokens, mode=mode)
        for ranked, prior in zip(out, priors, strict=True):
            if kind == "action":
                ranked.append([(text, 1.0) for text in _first_actions(comps, prior)])
            else:
                ranked.append([(text, p) for text, p, _ in rank_observations(comps, prior)])
    return out


def top_k(
    ranked: Sequence[Sequence[tuple[str, float]]], examples: Sequence[Example], kind: ExampleKind = "observation"
) -> tuple[float | None, float | None]:
    """Top-1 and top-5 exact match of ranked candidates against the examples' targets."""
    if not examples:
        return None, None
    targets = [_first(e.target, kind) for e in examples]
    hits1 = sum(bool(r) and r[0][0] == t for r, t in zip(ranked, targets, strict=True))
    hits5 = sum(t in [c for c, _ in r[:5]] for r, t in zip(ranked, targets, strict=True))
    return hits1 / len(examples), hits5 / len(examples)


#: Call-length buckets of the evaluation (the step's recorded tool time, seconds).
BUCKETS: tuple[tuple[str, float, float], ...] = (("< 1 s", 0.0, 1.0), ("1-10 s", 1.0, 10.0), (">= 10 s", 10.0, float("inf")))


def bucket_of(example: Example) -> str:
    t = example.tool_time_s
    if t is None:
        return "unknown"
    return next(name for name, lo, hi in BUCKETS if lo <= t < hi)


def frequency_baseline(
    train: Sequence[Example], evals: Sequence[Example], *, kind: ExampleKind = "observation"
) -> tuple[float | None, float | None]:
    """Top-1 and top-5 exact match of always proposing the training set's most frequent
    targets (for actions: first actions): the score a model must beat to have learned more
    than the common case (an empty output, say)."""
    if not evals:
        return None, None
    common = frequency_prior(train, kind=kind).texts(5)
    hits = [_first(e.target, kind) for e in evals]
    return (sum(bool(common) and t == common[0] for t in hits) / len(hits),
            sum(t in common for t in hits) / len(hits))


def _baseline_ranked(train: Sequence[Example], evals: Sequence[Example], kind: ExampleKind) -> list[list[tuple[str, float]]]:
    """The most-frequent baseline's candidates for each example: the training set's five
    most frequent targets, in that order."""
    prior = frequency_prior(train, kind=kind)
    return [list(prior.top[:5]) for _ in evals]


def _pick_eval(examples: Sequence[Example], limit: int, seed: int) -> list[Example]:
    """Up to ``limit`` examples spread evenly over the held-out tasks (deterministic)."""
    if len(examples) <= limit:
        return list(examples)
    by_task: dict[str, list[Example]] = {}
    for e in examples:
        by_task.setdefault(e.task, []).append(e)
    rng = random.Random(seed)
    for v in by_task.values():
        rng.shuffle(v)
    picked: list[Example] = []
    while len(picked) < limit:
        for task in sorted(by_task):
            if by_task[task] and len(picked) < limit:
                picked.append(by_task[task].pop())
    return picked


def _checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a ``.tmp`` one was interrupted while saving)."""
    found = [p for p in (out / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _latest_checkpoint(out: Path) -> Path | None:
    ckpts = _checkpoints(out)
    return ckpts[-1] if ckpts else None


def _load_traces(paths: Sequence[str]) -> list[Trace]:
    if not paths:
        raise ConfigError("no traces given (--traces DIR)")
    from aospec.replay import load_traces

    return list(load_traces(list(paths)))


def _plot_losses(losses: Sequence[tuple[int, float]], path: Path) -> None:
    if not losses:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in losses], [v for _, v in losses], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("drafter fine-tuning loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(
    config: TrainConfig, *, traces: Sequence[Trace] | None = None, log: Callable[[str], None] | None = None
) -> TrainResult:
    """Run ``aospec train``: split by task, build examples, fine-tune with checkpoints,
    export (PEFT adapter or full model), evaluate top-1/top-5 on the held-out tasks
    (the drafts, the model alone, the most-frequent baseline and, for a pretrained base,
    the frozen base model), overall and per call-length bucket. ``log`` gets a progress
    line now and then (where no progress bar shows)."""
    torch = require("torch", "train", purpose="aospec train")
    if config.threads is not None:
        if config.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {config.threads}")
        torch.set_num_threads(config.threads)
    started = time.perf_counter()
    out = Path(config.out)
    mode = config.resolved_mode()
    if mode not in ("lora", "full"):
        raise ConfigError(f"unknown training mode {config.mode!r} (lora, full or auto)")
    if config.steps < 1 or config.batch_size < 1:
        raise ConfigError("steps and batch_size must be >= 1")
    all_traces = list(traces) if traces is not None else _load_traces(config.traces)
    train_traces, eval_traces, eval_tasks = split_by_task(
        all_traces, eval_fraction=config.eval_fraction, eval_tasks=config.eval_tasks, seed=config.seed
    )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    meta_path = out / MODEL_META
    ckpt = _latest_checkpoint(out) if config.resume else None
    if config.resume and ckpt is None:
        raise ConfigError(f"--resume: no checkpoint under {out / 'checkpoints'}")
    if not config.resume and meta_path.exists():
        raise ConfigError(f"{out} already holds a trained model; use --resume to continue it or another --out")
    out.mkdir(parents=True, exist_ok=True)

    shape = is_shape(config.base_model)
    if ckpt is not None:
        prev = json.loads(meta_path.read_text())
        if prev.get("config", {}).get("base_model") != config.base_model or prev.get("mode") != mode:
            raise ConfigError(f"--resume: {out} was trained from {prev.get('config', {}).get('base_model')!r} "
                              f"({prev.get('mode')}); pass the same --base-model and mode")
        base_spec = str(out / "base") if shape else resolve_model(config.base_model)
        loaded = load_model(str(ckpt / "model") if mode == "full" else base_spec, device=device, dtype=torch.float32)
    else:
        texts = (t for tr in train_traces for s in tr.steps for t in (s.action.command or s.action.key, s.observation))
        loaded = load_model(
            config.base_model, device=device, dtype=torch.float32, texts=list(texts),
            vocab_size=config.vocab_size, seed=config.seed,
        )
    model, tokenizer = loaded.model, loaded.tokenizer
    base_dir = out / "base"
    if ckpt is None:
        tokenizer.save_pretrained(str(out / "tokenizer"))
        make_portable(out / "tokenizer")
        if shape and mode == "lora":
            model.save_pretrained(str(base_dir))
            tokenizer.save_pretrained(str(base_dir))
            make_portable(base_dir)
    if mode == "lora":
        peft = require("peft", "train", purpose="LoRA training")
        if ckpt is not None:
            model = peft.PeftModel.from_pretrained(model, str(ckpt / "adapter"), is_trainable=True)
        else:
            lcfg = peft.LoraConfig(
                r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM", bias="none",
            )
            model = peft.get_peft_model(model, lcfg)

    count_cache: dict[str, int] = {}

    def count(text: str) -> int:
        n = count_cache.get(text)
        if n is None:
            n = count_cache[text] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return n

    kw = dict(count=count, kind=config.kind, budget=config.budget(), depth=config.depth if config.kind == "action" else 1,
              min_tool_time_s=config.min_tool_time_s, oversample=config.oversample)
    train_ex = build_examples(train_traces, **kw)
    eval_ex = build_examples(eval_traces, **kw)

    if shape:
        base_ref = str(base_dir.resolve()) if mode == "lora" else config.base_model
    else:
        base_ref = str(Path(resolve_model(config.base_model)).resolve())
    meta = {
        "format": 1,
        "kind": config.kind,
        "mode": mode,
        "base": base_ref,
        "shape": config.base_model if shape else None,
        "weights": "adapter" if mode == "lora" else "model",
        "end_token": end_token(tokenizer),
        "prompt": asdict(config.budget()),
        "depth": config.depth if config.kind == "action" else 1,
        "prior": frequency_prior(train_ex, kind=config.kind).to_json(),
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")

    state = None
    start = 0
    if ckpt is not None:
        state = torch.load(ckpt / "state.pt", map_location=device, weights_only=False)
        start = int(state["step"])

    def save_checkpoint(step: int, opt: Any, sched: Any) -> None:
        target = out / "checkpoints" / f"step-{step:06d}"
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp / ("adapter" if mode == "lora" else "model")))
        if mode == "full":
            tokenizer.save_pretrained(str(tmp / "model"))
            make_portable(tmp / "model")
        torch.save({"step": step, "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "state.pt")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # a checkpoint exists only once it is complete
        for old in _checkpoints(out)[: -config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    autocast = config.resolved_autocast(device)
    clock = {"t": time.perf_counter(), "step": start, "tokens": 0}
    every = max(1, min(10, config.steps // 20))

    def on_step(step: int, loss: float, tokens: int) -> None:
        clock["tokens"] += tokens
        if log is None or (step % every and step != config.steps):
            return
        now = time.perf_counter()
        per_step = (now - clock["t"]) / max(1, step - clock["step"])
        rate = clock["tokens"] / max(1e-9, now - clock["t"])
        left = per_step * (config.steps - step)
        log(f"step {step}/{config.steps} loss {loss:.3f} ({per_step:.1f} s/step, {rate:.0f} tokens/s, "
            f"{left / 60:.1f} min left at this rate{', bf16 autocast' if autocast else ''})")

    if log is not None:
        log(f"{len(train_ex)} training / {len(eval_ex)} held-out examples (held-out tasks: {', '.join(eval_tasks)}); "
            f"{mode} fine-tune of {config.base_model} on {device}, {torch.get_num_threads()} threads"
            + (f", at most {config.time_limit_s / 60:.0f} min" if config.time_limit_s else ""))
    losses: list[tuple[int, float]] = []
    if start < config.steps:
        losses = fit_examples(
            model, tokenizer, train_ex, steps=config.steps, batch_size=config.batch_size, lr=config.resolved_lr(),
            warmup=config.warmup, weight_decay=config.weight_decay, grad_clip=config.grad_clip,
            target_tokens=config.target_tokens, seed=config.seed, start_step=start, stop_after=config.stop_after,
            optimizer_state=state, on_checkpoint=save_checkpoint, checkpoint_every=config.checkpoint_every,
            time_limit_s=config.time_limit_s, autocast=autocast, on_step=on_step,
        )
    done = losses[-1][0] if losses else start
    out_of_time = config.time_limit_s is not None and done < config.steps and (
        config.stop_after is None or done < start + config.stop_after
    )
    previous = []
    metrics_path = out / "metrics.json"
    if ckpt is not None and metrics_path.exists():
        previous = [tuple(x) for x in json.loads(metrics_path.read_text()).get("losses", []) if x[0] <= start]
    all_losses = [*previous, *losses]

    top1 = top5 = base1 = base5 = model1 = model5 = frozen1 = frozen5 = None
    evaluated = 0
    buckets: list[dict[str, Any]] = []
    if done >= config.steps or out_of_time:
        final = out / ("adapter" if mode == "lora" else "model")
        shutil.rmtree(final, ignore_errors=True)
        model.save_pretrained(str(final))
        if mode == "lora":
            _fix_adapter_config(final, base_ref)
        else:
            tokenizer.save_pretrained(str(final))
            make_portable(final)
        picked = _pick_eval(eval_ex, config.eval_limit, config.seed)
        prior = frequency_prior(train_ex, kind=config.kind)
        ranked = _evaluate_model(config, str(out), device, dtype, picked, (prior, FrequencyPrior()), log, "evaluating")
        systems = {"drafts": ranked[0], "model": ranked[1], "baseline": _baseline_ranked(train_ex, picked, config.kind)}
        frozen = config.eval_frozen if config.eval_frozen is not None else not shape
        if frozen and picked:
            (systems["frozen"],) = _evaluate_model(config, base_ref, device, dtype, picked, (FrequencyPrior(),), log,
                                                   "evaluating the frozen base")
        (top1, top5), (model1, model5), (base1, base5) = (top_k(systems[k], picked, config.kind)
                                                            for k in ("drafts", "model", "baseline"))
        if "frozen" in systems:
            frozen1, frozen5 = top_k(systems["frozen"], picked, config.kind)
        evaluated = len(picked)
        buckets = _bucket_table(systems, picked, config.kind)
        if config.calibrate and config.kind == "observation":
            pairs = [(p, text == e.target) for r, e in zip(ranked[0], picked, strict=True) for text, p in r[:8]]
            meta["calibration"] = fit_calibration(pairs).to_json()
    seconds = time.perf_counter() - started
    result = TrainResult(
        examples=len(train_ex) + len(eval_ex), train_examples=len(train_ex), eval_examples=len(eval_ex),
        steps=done, eval_tasks=tuple(eval_tasks), top1=top1, top5=top5, seconds=round(seconds, 3), out=str(out),
        baseline_top1=base1, baseline_top5=base5, model_top1=model1, model_top5=model5, frozen_top1=frozen1,
        frozen_top5=frozen5, final_loss=all_losses[-1][1] if all_losses else None, evaluated=evaluated,
        resumed_from=start if ckpt is not None else None, buckets=tuple(buckets), losses=tuple(all_losses),
    )
    metrics_path.write_text(json.dumps({**result.summary(), "losses": [list(x) for x in all_losses]}, indent=1) + "\n")
    meta["metrics"] = result.summary()
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    _plot_losses(all_losses, out / "loss.png")
    return result


def _evaluate_model(
    config: TrainConfig, spec: str, device: str, dtype: Any, examples: Sequence[Example],
    priors: Sequence[FrequencyPrior], log: Callable[[str], None] | None, description: str,
) -> list[list[list[tuple[str, float]]]]:
    """:func:`rank_candidates` of the model ``spec`` (the trained output, or the frozen base)."""
    from aospec.drafters.backends.transformers import TransformersBackend

    if log is not None:
        log(f"{description}: {len(examples)} held-out examples, {config.eval_samples} samples each")
    backend = TransformersBackend(spec, device=device, dtype=str(dtype).removeprefix("torch."),
                                  max_context=config.prompt_tokens + config.target_tokens + 512)
    return rank_candidates(backend, examples, samples=config.eval_samples, mode=config.eval_mode,
                           max_new_tokens=config.target_tokens, kind=config.kind, description=description,
                           priors=priors, log=log)


def _bucket_table(
    systems: dict[str, list[list[tuple[str, float]]]], examples: Sequence[Example], kind: ExampleKind
) -> list[dict[str, Any]]:
    """Top-1/top-5 of each system per call-length bucket (:data:`BUCKETS`)."""
    rows = []
    for name in [b[0] for b in BUCKETS] + ["unknown"]:
        idx = [i for i, e in enumerate(examples) if bucket_of(e) == name]
        if not idx:
            continue
        row: dict[str, Any] = {"bucket": name, "examples": len(idx)}
        for key, ranked in systems.items():
            t1, t5 = top_k([ranked[i] for i in idx], [examples[i] for i in idx], kind)
            row[f"{key}_top1"], row[f"{key}_top5"] = t1, t5
        rows.append(row)
    return rows


def _fix_adapter_config(adapter: Path, base: str) -> None:
    """Point the adapter at its base directory, as vLLM's --enable-lora expects."""
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
