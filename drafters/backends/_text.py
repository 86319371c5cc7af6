"""The tokenizer side shared by the in-process backends (transformers, vLLM): chat
rendering, token counting and decoding, the set of end-of-reply tokens, and the
per-prompt sampling seed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from aospec.errors import ConfigError, DrafterError

__all__ = ["TokenizerText", "end_token_ids", "prompt_seed"]

#: Chat end tokens taken as ends of a reply when the vocabulary has them.
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_MAX_COUNTS = 65536


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(i) for i in value}
    return set()


def end_token_ids(tokenizer: Any, generation_eos: Any, *, model: str) -> tuple[int, ...]:
    """Token ids that end a reply: the tokenizer's EOS, :data:`END_TOKENS` present in its
    vocabulary, and the model's generation-config EOS id(s) ``generation_eos``."""
    ids = _ids(tokenizer.eos_token_id) | _ids(generation_eos)
    for tok in END_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    if not ids:
        raise DrafterError(f"model {model!r}: its tokenizer has no end-of-message token")
    return tuple(sorted(ids))


def prompt_seed(prompt: str, backend_seed: int, seed: int, *, bits: int = 63) -> int:
    """The sampling seed of one call: derived from the prompt, so that a prompt's
    candidates do not depend on call order, and from the backend's and the call's seeds."""
    mixed = (backend_seed * 1_000_003 + seed) & 0xFFFFFFFFFFFFFFFF
    return xxhash.xxh64_intdigest(prompt.encode(), seed=mixed) & ((1 << bits) - 1)


class TokenizerText:
    """Text helpers over ``self.tokenizer`` (a Hugging Face tokenizer) for a backend class."""

    tokenizer: Any
    _counts: dict[str, int]

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt of chat ``messages`` (the model's chat template, generation prompt on)."""
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        """Tokens in ``text`` (memoised: prompt budgets count the same texts again and again)."""
        n = self._counts.get(text)
        if n is None:
            if len(self._counts) >= _MAX_COUNTS:
                self._counts.clear()
            n = self._counts[text] = len(self.encode(text))
        return n

    def decode_text(self, ids: Sequence[int]) -> str:
        """``ids`` as text, byte for byte (special tokens and spaces kept as generated)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def request_ids(
        self, prompt: str, *, n: int, max_new_tokens: int, mode: str, temperature: float, limit: int, limit_name: str
    ) -> list[int]:
        """The token ids of ``prompt`` for a ``complete`` call, after checking the call:
        one clear error for bad arguments or a prompt that does not fit ``limit`` tokens."""
        if n < 1 or max_new_tokens < 1:
            raise ConfigError(f"complete: n and max_new_tokens must be >= 1 (got {n}, {max_new_tokens})")
        if mode not in ("sample", "greedy", "beam"):
            raise ConfigError(f"complete: unknown mode {mode!r} (sample, greedy or beam)")
        if mode == "sample" and not temperature > 0:
            raise ConfigError("complete: sampling needs temperature > 0")
        ids = self.encode(prompt)
        if not ids:
            raise DrafterError("complete: empty prompt")
        if len(ids) + max_new_tokens > limit:
            raise DrafterError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens exceeds {limit_name}={limit}; "
                f"lower the drafter's prompt budget or raise {limit_name}"
            )
        return ids
