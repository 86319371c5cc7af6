"""Per-harness training of the drafter models (docs/training.md).

- :mod:`training.dataset`: (history, action) -> observation examples, token-budget
  truncation, oversampling of long tool calls, split by task;
- :mod:`training.tokenizer`: byte-level BPE tokenizers trained on traces (ChatML template);
- :mod:`training.model`: the Qwen3 model factory (``tiny``, ``small``, ``qwen3-0.6b``) and
  loading of local models and ``aospec train`` outputs;
- :mod:`training.trainer`: LoRA/full fine-tuning with checkpoints, resume, export and
  top-1/top-5 evaluation (``aospec train``).

torch, transformers and peft are imported only when a function that needs them runs.
"""

from training.dataset import Example, build_examples, split_by_task
from training.trainer import TrainConfig, TrainResult, train

__all__ = ["Example", "TrainConfig", "TrainResult", "build_examples", "split_by_task", "train"]
