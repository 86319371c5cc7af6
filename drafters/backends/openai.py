"""Backend for any OpenAI-compatible ``/v1/completions`` endpoint that returns logprobs
(vLLM's server, llama.cpp, SGLang, :mod:`aospec.drafters.backends.server`, ...).

The prompt is rendered locally: with the chat template of ``tokenizer`` (a local
tokenizer directory) when given, else in ChatML, the layout Qwen models and the
``aospec train`` tokenizers use. A sequence's log-probability is the sum of the returned
``token_logprobs``; servers leave the stop token out of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from aospec.drafters.backends import Completion, DecodeMode

from aospec._lazy import require
from aospec.errors import ConfigError, DrafterError

__all__ = ["OpenAIBackend", "render_chatml"]


def render_chatml(messages: Sequence[Mapping[str, str]]) -> str:
    """ChatML rendering with the generation prompt (same text as the ``aospec train`` template)."""
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


class OpenAIBackend:
    """Completions from an OpenAI-compatible server.

    ``base_url`` (e.g. ``http://localhost:8000/v1``), ``model`` (the served model or LoRA
    name), ``api_key`` (default ``EMPTY``), ``stop`` (stop strings, default the ChatML end
    token), ``tokenizer`` (local tokenizer directory for the chat template and counting;
    without it tokens are estimated as characters / 4).
    """

    def __init__(
        self,
        model: str,
        *,
        base_url: str = "http://127.0.0.1:8000/v1",
        api_key: str = "EMPTY",
        stop: Sequence[str] = ("<|im_end|>",),
        tokenizer: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 0,
        seed: int = 0,
    ) -> None:
        self._openai = require("openai", "openai", purpose="the OpenAI-compatible drafter backend")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"openai backend: base_url must be an http(s) URL, got {base_url!r}")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.stop = list(stop)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.seed = seed
        self._tokenizer: Any = None
        if tokenizer is not None:
            transformers = require("transformers", "train", purpose="a local tokenizer for the openai backend")
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        if self._tokenizer is not None and self._tokenizer.chat_template:
            return self._tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return render_chatml(messages)

    def count_tokens(self, text: str) -> int:
        if self._tokenizer is not None:
            return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return math.ceil(len(text) / 4)

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
        if mode == "beam":
            raise ConfigError("openai backend: beam search is not part of the completions API; use sample or greedy")
        if mode == "greedy":
            n, temperature = 1, 0.0
        openai = self._openai
        try:
            async with openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s, max_retries=self.max_retries
            ) as client:
                resp = await client.completions.create(
                    model=self.model,
                    prompt=prompt,
                    n=n,
                    max_tokens=max_new_tokens,
                    temperature=temperature,
                    logprobs=0,
                    stop=self.stop or None,
                    seed=(self.seed * 1_000_003 + seed) & 0x7FFFFFFF,
                )
        except openai.APIConnectionError as exc:
            raise DrafterError(f"openai backend: cannot reach {self.base_url}: {exc}") from None
        except openai.APIStatusError as exc:
            raise DrafterError(f"openai backend: {self.base_url} answered {exc.status_code}: {exc.message}") from None
        out = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            lp = choice.logprobs
            if lp is None or lp.token_logprobs is None:
                raise DrafterError(f"openai backend: {self.base_url} returned no logprobs (it must support logprobs=0)")
            values = [float(x) for x in lp.token_logprobs if x is not None]
            finished = choice.finish_reason == "stop"
            out.append(Completion(choice.text, math.fsum(values), len(values) + int(finished), finished, (), tuple(values)))
        return out
