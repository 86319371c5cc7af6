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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from aospec.drafters.examples import Example, ExampleKind, build_examples
from aospec.drafters.finetune import encode_example, end_token, fit_examples
from aospec.drafters.model import MODEL_META, is_shape, load_model, make_portable, resolve_device, resolve_dtype
from aospec.drafters.prior import FrequencyPrior
from aospec.drafters.prompts import ACTION_SEPARATOR, PromptBudget
from aospec.training.dataset import split_by_task

from aospec._lazy import require
from aospec.errors import ConfigError
from aospec.types import Trace

__all__ = ["TrainConfig", "TrainResult", "encode_example", "evaluate", "fit_examples", "train"]

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

    def resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "full" if is_shape(self.base_model) else "lora"

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-3 if is_shape(self.base_model) else (2e-4 if self.resolved_mode() == "lora" else 2e-5)

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
    final_loss: float | None = None
    evaluated: int = 0
    resumed_from: int | None = None
    losses: tuple[tuple[int, float], ...] = field(default=(), repr=False)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("losses")
        d["eval_tasks"] = list(self.eval_tasks)
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
    return _evaluate(backend, examples, samples=samples, mode=mode, max_new_tokens=max_new_tokens, kind=kind,
                     description=description, priors=(prior or FrequencyPrior(),))[0]


def _evaluate(
    backend: Any,
    examples: Sequence[Example],
    *,
    samples: int,
    mode: str,
    max_new_tokens: int,
    kind: ExampleKind,
    description: str,
    priors: Sequence[FrequencyPrior],
) -> list[tuple[float | None, float | None, int]]:
    """:func:`evaluate` under each of ``priors`` from the same samples."""
    from aospec.drafters.lm import rank_observations

    from aospec.progress import track

    if not examples:
        return [(None, None, 0) for _ in priors]
    hits = [[0, 0] for _ in priors]
    for ex in track(examples, description):
        prompt = backend.render(ex.chat())
        comps = backend.complete_sync(prompt, n=samples, max_new_tokens=max_new_tokens, mode=mode)
        target = _first(ex.target, kind)
        for hit, prior in zip(hits, priors, strict=True):
            if kind == "action":
                texts = _first_actions(comps, prior)
            else:
                texts = [text for text, _, _ in rank_observations(comps, prior)]
            hit[0] += bool(texts) and texts[0] == target
            hit[1] += target in texts[:5]
    return [(h1 / len(examples), h5 / len(examples), len(examples)) for h1, h5 in hits]


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


def train(config: TrainConfig, *, traces: Sequence[Trace] | None = None) -> TrainResult:
    """Run ``aospec train``: split by task, build examples, fine-tune with checkpoints,
    export (PEFT adapter or full model), evaluate top-1/top-5 on the held-out tasks."""
    torch = require("torch", "train", purpose="aospec train")
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
        base_spec = str(out / "base") if shape else config.base_model
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
        base_ref = str(Path(config.base_model).resolve())
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

    losses: list[tuple[int, float]] = []
    if start < config.steps:
        losses = fit_examples(
            model, tokenizer, train_ex, steps=config.steps, batch_size=config.batch_size, lr=config.resolved_lr(),
            warmup=config.warmup, weight_decay=config.weight_decay, grad_clip=config.grad_clip,
            target_tokens=config.target_tokens, seed=config.seed, start_step=start, stop_after=config.stop_after,
            optimizer_state=state, on_checkpoint=save_checkpoint, checkpoint_every=config.checkpoint_every,
            time_limit_s=config.time_limit_s,
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

    top1 = top5 = base1 = base5 = model1 = model5 = None
    evaluated = 0
    if done >= config.steps or out_of_time:
        final = out / ("adapter" if mode == "lora" else "model")
        shutil.rmtree(final, ignore_errors=True)
        model.save_pretrained(str(final))
        if mode == "lora":
            _fix_adapter_config(final, base_ref)
        else:
            tokenizer.save_pretrained(str(final))
            make_portable(final)
        from aospec.drafters.backends.transformers import TransformersBackend

        backend = TransformersBackend(str(out), device=device, dtype=str(dtype).removeprefix("torch."),
                                      max_context=config.prompt_tokens + config.target_tokens + 512)
        picked = _pick_eval(eval_ex, config.eval_limit, config.seed)
        (top1, top5, evaluated), (model1, model5, _) = _evaluate(
            backend, picked, samples=config.eval_samples, mode=config.eval_mode, max_new_tokens=config.target_tokens,
            kind=config.kind, description="evaluating", priors=(frequency_prior(train_ex, kind=config.kind), FrequencyPrior()),
        )
        base1, base5 = frequency_baseline(train_ex, picked, kind=config.kind)
    seconds = time.perf_counter() - started
    result = TrainResult(
        examples=len(train_ex) + len(eval_ex), train_examples=len(train_ex), eval_examples=len(eval_ex),
        steps=done, eval_tasks=tuple(eval_tasks), top1=top1, top5=top5, seconds=round(seconds, 3), out=str(out),
        baseline_top1=base1, baseline_top5=base5, model_top1=model1, model_top5=model5, final_loss=all_losses[-1][1] if all_losses else None, evaluated=evaluated,
        resumed_from=start if ckpt is not None else None, losses=tuple(all_losses),
    )
    metrics_path.write_text(json.dumps({**result.summary(), "losses": [list(x) for x in all_losses]}, indent=1) + "\n")
    meta["metrics"] = result.summary()
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    _plot_losses(all_losses, out / "loss.png")
    return result


def _fix_adapter_config(adapter: Path, base: str) -> None:
    """Point the adapter at its base directory, as vLLM's --enable-lora expects."""
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
