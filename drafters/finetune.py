"""In-place fine-tuning of a loaded drafter model on :mod:`aospec.drafters.examples`.

:func:`fit_examples` is the optimisation loop (AdamW, warmup then cosine decay, loss on
target tokens only, deterministic batches so a resumed run sees the same ones). The LM
drafters call it for ``fit_steps``; ``aospec train`` (training/) wraps it with splits,
checkpoints, LoRA, export and evaluation.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

from aospec.drafters.examples import Example, expand_weights

from aospec._lazy import require
from aospec.errors import ConfigError

__all__ = ["bf16_autocast_helps", "encode_example", "end_token", "fit_examples"]


def encode_example(example: Example, tokenizer: Any, end_token: str, target_tokens: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 on the prompt) of ``example``: the rendered prompt, then
    the target and the end token, the target cut to ``target_tokens``."""
    prompt = tokenizer.apply_chat_template(example.chat(), tokenize=False, add_generation_prompt=True)
    p = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    t = list(tokenizer(example.target, add_special_tokens=False)["input_ids"])
    end = tokenizer.convert_tokens_to_ids(end_token)
    t = t[:target_tokens] if len(t) >= target_tokens else [*t, end]
    return p + t, [-100] * len(p) + t


def end_token(tokenizer: Any) -> str:
    """The token appended to every target (the tokenizer's end of sequence)."""
    return tokenizer.eos_token or "<|im_end|>"


def bf16_autocast_helps(device: str) -> bool:
    """Whether bfloat16 autocast speeds training up on ``device``: on a GPU, and on a CPU
    with native bfloat16 instructions (AVX512-BF16 or AMX; 2-3x faster than float32 for
    SmolLM2-135M on one EPYC core), not on other CPUs, where bfloat16 is emulated."""
    torch = require("torch", "train")
    if device.startswith("cuda"):
        return True
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def _batches(pool: Sequence[int], batch_size: int, seed: int, step: int) -> list[int]:
    """The example indices of optimisation ``step`` (deterministic: resume needs only the step)."""
    per_epoch = max(1, len(pool) // batch_size)
    epoch, k = divmod(step, per_epoch)
    order = list(pool)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k * batch_size : (k + 1) * batch_size]


def _target_loss(model: Any, ids: Any, mask: Any, labels: Any) -> Any:
    """Mean next-token cross-entropy over target positions only. The LM head runs only
    where a label exists (the prompt is most of each row; its logits would dominate)."""
    import torch

    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, head = getattr(core, "model", None), getattr(core, "lm_head", None)
    if body is None or head is None:
        return model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    hidden = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    target = labels[:, 1:]
    sel = target != -100
    logits = head(hidden[:, :-1][sel])
    return torch.nn.functional.cross_entropy(logits.float(), target[sel])


def fit_examples(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    steps: int,
    batch_size: int = 8,
    lr: float = 2e-3,
    warmup: int = 20,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    target_tokens: int = 256,
    seed: int = 0,
    start_step: int = 0,
    stop_after: int | None = None,
    optimizer_state: Any = None,
    on_step: Any = None,
    on_checkpoint: Any = None,
    checkpoint_every: int = 0,
    description: str = "training",
    time_limit_s: float | None = None,
    autocast: bool | None = None,
) -> list[tuple[int, float]]:
    """Train ``model`` in place on ``examples`` for optimisation steps ``start_step`` ..
    ``steps`` (or ``stop_after`` of them); returns (step, loss) pairs.

    ``on_step(step, loss, tokens)`` is called after every step (``tokens``: the step's
    unpadded tokens). ``on_checkpoint(step, optimizer, scheduler)`` is called every
    ``checkpoint_every`` steps and after the last step. ``time_limit_s`` ends training
    early (after a whole step). ``autocast``: run forward passes in bfloat16 autocast
    (weights and optimizer stay float32); None: on a CUDA device only.
    """
    torch = require("torch", "train")
    from aospec.progress import progress

    if not examples:
        raise ConfigError("no training examples (are the traces empty, or all in the eval split?)")
    device = next(model.parameters()).device
    if autocast is None:
        autocast = device.type == "cuda"
    end = end_token(tokenizer)
    encoded = [encode_example(e, tokenizer, end, target_tokens) for e in examples]
    pool = expand_weights(examples)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / max(1, warmup)
        frac = (s - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state["optimizer"])
        sched.load_state_dict(optimizer_state["scheduler"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    last = steps if stop_after is None else min(steps, start_step + stop_after)
    losses: list[tuple[int, float]] = []
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    model.train()
    try:
        with progress() as bar:
            task = bar.add_task(description, total=steps, completed=start_step)
            for step in range(start_step, last):
                idx = _batches(pool, batch_size, seed, step)
                rows = [encoded[i] for i in idx]
                width = max(len(r[0]) for r in rows)
                ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows], device=device)
                labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows], device=device)
                mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows], device=device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = _target_loss(model, ids, mask, labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, grad_clip)
                opt.step()
                sched.step()
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise ConfigError(f"training diverged at step {step + 1} (loss {value}); lower the learning rate")
                losses.append((step + 1, value))
                bar.update(task, advance=1, description=f"{description} loss {value:.3f}")
                if on_step is not None:
                    on_step(step + 1, value, int(mask.sum()))
                out_of_time = deadline is not None and time.perf_counter() > deadline
                if on_checkpoint is not None and (
                    (checkpoint_every and (step + 1) % checkpoint_every == 0) or step + 1 == last or out_of_time
                ):
                    on_checkpoint(step + 1, opt, sched)
                if out_of_time:
                    break
    finally:
        model.eval()
    return losses
