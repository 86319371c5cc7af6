"""Per-harness training of the drafter models (docs/training.md).

- :mod:`aospec.training.dataset`: split traces and examples by task (the examples themselves,
  with token-budget truncation and oversampling of long tool calls, come from
  :mod:`aospec.drafters.examples`);
- :mod:`aospec.training.trainer`: LoRA/full fine-tuning with checkpoints, resume, export and
  top-1/top-5 evaluation (``aospec train``).

The model factory (:mod:`aospec.drafters.model`), the tokenizer (:mod:`aospec.drafters.tokenizer`) and
the optimisation loop (:mod:`aospec.drafters.finetune`) belong to the drafters, which load and fit
them at run time; training builds on them (docs/architecture.md).

torch, transformers and peft are imported only when a function that needs them runs.
"""

from aospec.training.dataset import Example, build_examples, split_by_task
from aospec.training.trainer import TrainConfig, TrainResult, train

__all__ = ["Example", "TrainConfig", "TrainResult", "build_examples", "split_by_task", "train"]
