"""In-process vLLM backend (``vllm.LLM``), with LoRA adapters from ``aospec train``.

``model`` is a local model directory or an ``aospec train`` output directory (its base
and adapter are used: LoRA results run as the base model plus a ``LoRARequest``, full
results as the model). vLLM is imported only here; without it the backend raises one
MissingDependencyError naming ``pip install 'aospec[vllm]'``.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aospec._lazy import require
from aospec.errors import ConfigError, DrafterError
from drafters.backends import Completion, DecodeMode, Offload, run_blocking

__all__ = ["VLLMBackend"]


def _resolve(model: str, adapter: str | None) -> tuple[str, str | None, str | None]:
    """(model dir for vllm.LLM, tokenizer dir, adapter dir) of a model spec."""
    path = Path(model)
    meta_file = path / "aospec-model.json"
    if not meta_file.is_file():
        return model, None, adapter
    meta = json.loads(meta_file.read_text())
    if meta.get("mode") == "lora":
        base = path / "base" if (path / "base").is_dir() else Path(meta["base"])
        return str(base), str(path / "tokenizer"), adapter or str(path / "adapter")
    return str(path / "model"), str(path / "tokenizer"), adapter


class VLLMBackend:
    """Sampling through an in-process ``vllm.LLM``; options not listed go to ``vllm.LLM``."""

    def __init__(
        self,
        model: str,
        *,
        adapter: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 4096,
        max_lora_rank: int = 64,
        offload: Offload = "auto",
        **llm_options: Any,
    ) -> None:
        vllm = require("vllm", "vllm", purpose="the vLLM drafter backend")
        base, tokenizer, adapter = _resolve(model, adapter)
        if not Path(base).is_dir():
            raise ConfigError(f"vllm backend: {base!r} is not a local model directory")
        self._vllm = vllm
        self.seed = seed
        self.offload = offload
        kwargs = dict(
            model=base, seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enable_lora=adapter is not None, **llm_options,
        )
        if tokenizer is not None:
            kwargs["tokenizer"] = tokenizer
        if adapter is not None:
            kwargs["max_lora_rank"] = max_lora_rank
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.lora = None
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest("aospec-drafter", 1, str(adapter))
        self._lock = threading.Lock()

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def complete(
        self,
        prompt: str,
        *,
        n: int,
        max_new_tokens: int,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        seed: int = 0,
    ) -> list[Completion]:
        def work(stop: threading.Event | None) -> list[Completion]:
            return self.complete_sync(prompt, n=n, max_new_tokens=max_new_tokens, mode=mode,
                                      temperature=temperature, seed=seed)

        return await run_blocking(work, self.offload)

    def complete_sync(
        self,
        prompt: str,
        *,
        n: int,
        max_new_tokens: int,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        seed: int = 0,
    ) -> list[Completion]:
        """Blocking completions; the sequence log-probability sums the sampled tokens'."""
        vllm = self._vllm
        with self._lock:
            if mode == "beam":
                return self._beam(prompt, n, max_new_tokens)
            params = vllm.SamplingParams(
                n=1 if mode == "greedy" else n,
                temperature=0.0 if mode == "greedy" else temperature,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=(self.seed * 1_000_003 + seed) & 0x7FFFFFFF,
            )
            try:
                result = self.llm.generate([prompt], params, lora_request=self.lora, use_tqdm=False)
            except Exception as exc:
                raise DrafterError(f"vllm backend: generation failed: {type(exc).__name__}: {exc}") from exc
        out = []
        for c in result[0].outputs:
            lps = self._token_logprobs(c)
            finished = c.finish_reason == "stop"
            total = c.cumulative_logprob if c.cumulative_logprob is not None else math.fsum(lps)
            out.append(Completion(c.text, float(total), len(c.token_ids), finished, tuple(c.token_ids), tuple(lps)))
        return out

    @staticmethod
    def _token_logprobs(c: Any) -> list[float]:
        if not c.logprobs:
            return []
        return [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs, strict=False) if tok in step]

    def _beam(self, prompt: str, n: int, max_new_tokens: int) -> list[Completion]:
        try:
            from vllm.sampling_params import BeamSearchParams
        except ImportError:
            raise ConfigError("vllm backend: this vLLM has no beam search; use mode sample or greedy") from None
        params = BeamSearchParams(beam_width=n, max_tokens=max_new_tokens)
        kwargs = {"lora_request": self.lora} if self.lora is not None else {}
        result = self.llm.beam_search([{"prompt": prompt}], params, **kwargs)
        prompt_len = len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        out = []
        for seq in result[0].sequences[:n]:
            tokens = list(seq.tokens[prompt_len:])
            eos = self.tokenizer.eos_token_id
            finished = bool(tokens) and tokens[-1] == eos
            text = self.tokenizer.decode(tokens[:-1] if finished else tokens, skip_special_tokens=False)
            out.append(Completion(text, float(seq.cum_logprob), len(tokens), finished, tuple(tokens)))
        return out
