"""Device check of the LM drafters (run by scripts/device_train_check.sh; <= 10 min on one H200).

Stages, each guarded (an error is recorded and the next stage runs) and bounded by a
global time budget:

1. latency of a Qwen3-0.6B-shaped model (random init, bf16): milliseconds per decode
   step for each decode path (HF eager generate, our dynamic loop, static cache, CUDA
   graph; torch.compile if time remains), batch 1 and batch N, plus agreement of the
   fast paths' greedy tokens with the eager loop;
2. training of a small Qwen3-architecture model on the traces (split by task), with
   top-1/top-5 exact match on held-out tasks;
3. latency of the trained small model on real prompts;
4. vLLM, when installed.

Prints one JSON summary and writes it to $OUT/device_check.json when $OUT is set.
``--smoke`` runs everything at tiny sizes on the CPU (for CI here).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

START = time.perf_counter()
SUMMARY: dict[str, Any] = {"stages": {}, "errors": []}


def elapsed() -> float:
    return time.perf_counter() - START


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def stage(name: str, budget_s: float, deadline: float, fn: Any, *args: Any) -> Any:
    left = deadline - elapsed()
    if left < budget_s:
        log(f"skip {name}: {left:.0f}s left, needs ~{budget_s:.0f}s")
        SUMMARY["stages"][name] = {"skipped": f"time guard: {left:.0f}s left"}
        return None
    log(f"start {name}")
    t0 = time.perf_counter()
    try:
        result = fn(*args)
        SUMMARY["stages"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2)}
        return result
    except Exception as exc:
        tb = traceback.format_exc(limit=6)
        log(f"{name} failed: {type(exc).__name__}: {exc}\n{tb}")
        SUMMARY["stages"][name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 2),
                                   "error": f"{type(exc).__name__}: {exc}"}
        SUMMARY["errors"].append({"stage": name, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        return None


def environment() -> dict[str, Any]:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for mod in ("peft", "vllm", "accelerate"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as exc:
            env[mod] = f"unavailable ({type(exc).__name__})"
    return env


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(backend: Any, prompt: str, n: int, new: int, mode: str, repeats: int) -> tuple[float, int]:
    """Median wall time of complete_sync and the decode steps it ran."""
    times = []
    steps = 0
    for _ in range(repeats):
        sync(backend.device)
        t0 = time.perf_counter()
        comps = backend.complete_sync(prompt, n=n, max_new_tokens=new, mode=mode, seed=1)
        sync(backend.device)
        times.append(time.perf_counter() - t0)
        steps = max(c.tokens for c in comps)
    times.sort()
    return times[len(times) // 2], steps


def measure_paths(
    backend: Any, prompt: str, paths: list[str], batches: list[int], new: int, repeats: int, deadline: float,
    reserve_s: float,
) -> dict[str, Any]:
    """ms per decode step for each (path, batch): (t(new) - t(1)) / (steps - 1)."""
    out: dict[str, Any] = {}
    reference: dict[int, tuple[int, ...]] = {}
    for path in paths:
        for batch in batches:
            key = f"{path}/b{batch}"
            if deadline - elapsed() < reserve_s:
                out[key] = {"skipped": "time guard"}
                continue
            try:
                backend.decode = path
                backend.fallback_reason = None
                mode = "greedy" if batch == 1 else "sample"
                backend.complete_sync(prompt, n=batch, max_new_tokens=8, mode=mode)  # warm-up / capture
                t_first, _ = time_call(backend, prompt, batch, 1, mode, repeats)
                t_all, steps = time_call(backend, prompt, batch, new, mode, repeats)
                per_step = (t_all - t_first) / max(1, steps - 1)
                rec: dict[str, Any] = {
                    "ms_per_step": round(per_step * 1e3, 3),
                    "prefill_plus_first_ms": round(t_first * 1e3, 2),
                    "steps": steps,
                    "path_used": backend.decode,
                }
                if backend.fallback_reason:
                    rec["fallback_reason"] = backend.fallback_reason[:300]
                if batch == 1:
                    tokens = backend.complete_sync(prompt, n=1, max_new_tokens=32, mode="greedy")[0].token_ids
                    if path == "dynamic":
                        reference[1] = tokens
                    elif 1 in reference:
                        ref = reference[1]
                        same = next((i for i, (a, b) in enumerate(zip(ref, tokens, strict=False)) if a != b),
                                    min(len(ref), len(tokens)))
                        rec["greedy_prefix_agreement"] = f"{same}/{len(ref)}"
                out[key] = rec
                log(f"  {key}: {rec}")
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                log(f"  {key} failed: {type(exc).__name__}: {exc}")
            finally:
                backend.decode = "dynamic"
    return out


def latency_stage(
    shape: str, args: argparse.Namespace, texts: list[str], deadline: float, prompt_tokens: int,
    paths: list[str] | None = None,
) -> dict:
    import torch
    from aospec.drafters.backends.transformers import TransformersBackend
    from aospec.drafters.model import build_model, resolve_dtype
    from aospec.drafters.tokenizer import train_tokenizer

    device = args.device
    tokenizer = train_tokenizer(texts, vocab_size=4096 if not args.smoke else 512)
    dtype = resolve_dtype("auto", device)
    model = build_model(shape, tokenizer, seed=0, device=device, dtype=dtype)
    from aospec.drafters.model import LoadedModel

    backend = TransformersBackend(loaded=LoadedModel(model, tokenizer, shape, {}), max_context=4096, decode="dynamic")
    params = sum(p.numel() for p in model.parameters())
    words = " ".join(texts)[: prompt_tokens * 8]
    ids = backend.encode(words)[:prompt_tokens]
    prompt = backend.render([{"role": "system", "content": "env"}, {"role": "user", "content": backend.decode_text(ids)}])
    if paths is None:
        paths = ["generate", "dynamic", "static"] + (["cuda_graph"] if device.startswith("cuda") else [])
    result = {
        "shape": shape,
        "parameters": params,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_tokens": backend.count_tokens(prompt),
        "new_tokens": args.new_tokens,
        "paths": measure_paths(backend, prompt, paths, [1, args.batch], args.new_tokens, args.repeats, deadline,
                               90 if paths == ["compile"] else 20),
    }
    del backend, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def train_stage(args: argparse.Namespace, traces: list[Any], work: Path, deadline: float) -> dict:
    from aospec.training.trainer import TrainConfig, train

    left = deadline - elapsed()
    time_limit = max(10.0, min(args.train_seconds, left - args.eval_reserve_s))
    config = TrainConfig(
        out=str(work / "train"),
        base_model="tiny" if args.smoke else "small",
        mode="full",
        steps=args.train_steps,
        time_limit_s=time_limit,
        batch_size=4 if args.smoke else 16,
        prompt_tokens=256 if args.smoke else 1024,
        target_tokens=48 if args.smoke else 256,
        vocab_size=512 if args.smoke else 4096,
        eval_limit=4 if args.smoke else args.eval_limit,
        eval_samples=4 if args.smoke else 8,
        checkpoint_every=10_000,
        device=args.device,
        lr=2e-3 if args.smoke else 1e-3,
    )
    result = train(config, traces=traces)
    summary = result.summary()
    summary["steps_per_second"] = round(result.steps / max(1e-9, result.seconds), 3)
    summary["train_time_limit_s"] = round(time_limit, 1)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.json", "loss.png"):
            src = Path(config.out) / name
            if src.exists():
                (out / f"train_{name}").write_bytes(src.read_bytes())
    return summary


def trained_latency_stage(args: argparse.Namespace, work: Path, traces: list[Any], deadline: float) -> dict:
    from aospec.drafters.backends.transformers import TransformersBackend
    from aospec.drafters.prompts import PromptBudget, observation_messages

    backend = TransformersBackend(str(work / "train"), device=args.device, decode="dynamic", max_context=4096)
    trace = max(traces, key=len)
    i = min(len(trace.steps) - 1, 10)
    msgs = observation_messages(trace.history(i), trace.steps[i].action, PromptBudget(1024, 256, 384), backend.count_tokens)
    prompt = backend.render(msgs)
    paths = ["generate", "dynamic", "static"] + (["cuda_graph"] if args.device.startswith("cuda") else [])
    return {
        "prompt_tokens": backend.count_tokens(prompt),
        "paths": measure_paths(backend, prompt, paths, [1, args.batch], args.new_tokens, args.repeats, deadline, 10),
    }


def vllm_stage(args: argparse.Namespace, work: Path) -> dict:
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:200]}
    from aospec.drafters.backends.vllm import VLLMBackend

    backend = VLLMBackend(str(work / "train"), gpu_memory_utilization=0.2, max_model_len=2048)
    prompt = backend.render([{"role": "system", "content": "env"}, {"role": "user", "content": "ls -la"}])
    out = {"available": True}
    for n in (1, args.batch):
        backend.complete_sync(prompt, n=n, max_new_tokens=8)
        t0 = time.perf_counter()
        comps = backend.complete_sync(prompt, n=n, max_new_tokens=args.new_tokens)
        dt = time.perf_counter() - t0
        out[f"b{n}"] = {"seconds": round(dt, 4), "steps": max(c.tokens for c in comps),
                        "ms_per_step_upper_bound": round(dt * 1e3 / max(1, max(c.tokens for c in comps)), 3)}
    # Same weights, same greedy decode: the two backends should agree token for token (up
    # to numerics late in the sequence: vLLM may run another dtype/kernels).
    from aospec.drafters.backends.transformers import TransformersBackend

    ref = TransformersBackend(str(work / "train"), device=args.device, decode="dynamic", max_context=2048)
    mine = backend.complete_sync(prompt, n=1, max_new_tokens=32, mode="greedy")[0].token_ids
    theirs = ref.complete_sync(prompt, n=1, max_new_tokens=32, mode="greedy")[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))
    out["greedy_prefix_agreement_with_transformers"] = f"{same}/{len(theirs)}"
    try:
        beams = backend.complete_sync(prompt, n=4, max_new_tokens=16, mode="beam")
        out["beam"] = {"ok": True, "candidates": len(beams)}
    except Exception as exc:  # reported, not fatal: beam search differs across vLLM releases
        out["beam"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def dump(out_text: str) -> None:
    print(out_text, flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "device_check.json").write_text(out_text + "\n")


def on_signal(signum: int, frame: Any) -> None:
    """Killed by the outer timeout: still leave the partial summary behind."""
    SUMMARY["interrupted"] = f"signal {signum} at {elapsed():.1f}s"
    SUMMARY["seconds"] = round(elapsed(), 1)
    dump(json.dumps(SUMMARY, indent=1, default=str))
    os._exit(3)


def main() -> int:
    import signal

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traces", default=None, help="trace dir (default: ../shared traces if present, else the bundled sample)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (a quick check that nothing crashes)")
    p.add_argument("--budget-s", type=float, default=540.0, help="global time budget (default 540)")
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=5, help="batch N of the sampled candidates (default 5)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-seconds", type=float, default=180.0)
    p.add_argument("--train-steps", type=int, default=1500)
    p.add_argument("--eval-limit", type=int, default=96)
    p.add_argument("--eval-reserve-s", type=float, default=90.0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile-reserve-s", type=float, default=120.0)
    args = p.parse_args()
    if args.smoke:
        args.budget_s = min(args.budget_s, 240.0)
        args.new_tokens = min(args.new_tokens, 16)
        args.repeats = 1
        args.batch = min(args.batch, 3)
        args.train_steps = min(args.train_steps, 3)
        args.compile = False
    deadline = args.budget_s

    env = stage("environment", 0, deadline, environment) or {}
    SUMMARY["environment"] = env
    if args.device is None:
        args.device = "cuda" if env.get("cuda") and not args.smoke else "cpu"
    SUMMARY["device"] = args.device
    SUMMARY["smoke"] = args.smoke

    def load() -> list[Any]:
        from aospec.replay import bundled_traces_path, load_traces

        candidates = [args.traces] if args.traces else [
            str(ROOT.parent / "shared" / "traces" / "tb1-mini-swe-agent-claude-sonnet-4"),
            str(bundled_traces_path()),
        ]
        for c in candidates:
            if c and Path(c).is_dir():
                SUMMARY["traces_path"] = c
                return load_traces([c])
        raise FileNotFoundError(f"no trace directory among {candidates}")

    traces = stage("load_traces", 0, deadline, load) or []
    SUMMARY["traces"] = {"count": len(traces), "steps": sum(len(t) for t in traces),
                         "tasks": len({t.task for t in traces})}
    texts = [x for t in traces for s in t.steps for x in (s.action.command or s.action.key, s.observation)] or ["ls"]

    big = "tiny" if args.smoke else "qwen3-0.6b"
    SUMMARY["latency_0.6b_shape" if not args.smoke else "latency_big_shape"] = stage(
        "latency_big", 30 if args.smoke else 60, deadline, latency_stage, big, args, texts, deadline * 0.35, 512
    )
    with tempfile.TemporaryDirectory(prefix="aospec-device-check-") as tmp:
        work = Path(tmp)
        SUMMARY["training"] = stage("train_small", 30 if args.smoke else 150, deadline, train_stage, args, traces, work,
                                    deadline - 60)
        if SUMMARY["training"] is not None:
            SUMMARY["latency_trained_small"] = stage(
                "latency_trained_small", 10 if args.smoke else 40, deadline, trained_latency_stage, args, work, traces,
                deadline - 15,
            )
            SUMMARY["vllm"] = stage("vllm", 5 if args.smoke else 60, deadline, vllm_stage, args, work)
    if args.compile:
        # torch.compile last: its compilation time is the least predictable part.
        SUMMARY["latency_compile"] = stage(
            "latency_compile", args.compile_reserve_s, deadline, latency_stage, big, args, texts, deadline - 5, 512,
            ["compile"],
        )
    SUMMARY["seconds"] = round(elapsed(), 1)
    dump(json.dumps(SUMMARY, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
