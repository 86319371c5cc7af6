"""Byte-level BPE tokenizers trained on traces, wrapped for transformers with a chat template.

Byte-level BPE encodes every string losslessly (no unknown tokens), so a drafted
observation decodes back byte for byte: exact-match drafting needs that.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aospec._lazy import require

__all__ = ["BOS_TOKEN", "CHATML_TEMPLATE", "END_TOKEN", "PAD_TOKEN", "SPECIAL_TOKENS", "train_tokenizer"]

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, END_TOKEN)

#: The ChatML template (the layout Qwen models use, without reasoning blocks).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A little text so that a tokenizer built before any training data still has useful merges.
_SEED_CORPUS = (
    "<returncode>0</returncode>\n<output>\n</output>",
    "<returncode>1</returncode>\n<output>\nNo such file or directory\n</output>",
    "ls -la\ncat README.md\npython3 -m pytest -q\ngrep -rn import .\n",
)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 4096, min_frequency: int = 2) -> Any:
    """Train a byte-level BPE on ``texts`` and return a transformers fast tokenizer.

    The tokenizer has ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (end
    of a message, also EOS) as special tokens and the ChatML chat template.
    """
    tokenizers = require("tokenizers", "train", purpose="training a tokenizer")
    transformers = require("transformers", "train", purpose="training a tokenizer")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus() -> Iterable[str]:
        yield from _SEED_CORPUS
        yield from texts

    tok.train_from_iterator(corpus(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
