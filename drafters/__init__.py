"""Observation and action drafters, chosen by short name (or any dotted path).

Heavy backends (torch, vLLM, openai) are imported only when a drafter that needs them is
built.
"""

from __future__ import annotations

from typing import Any

from aospec._lazy import import_object

__all__ = [
    "ACTION_DRAFTERS",
    "KERNELS",
    "LM_BACKENDS",
    "OBSERVATION_DRAFTERS",
    "resolve",
]

#: name -> "module:attr" of observation drafter classes.
OBSERVATION_DRAFTERS: dict[str, str] = {
    "cache": "aospec.drafters.cache:ObservationCache",
    "trajectory": "aospec.drafters.trajectory:TrajectoryDrafter",
    "patterns": "aospec.drafters.patterns:PatternDrafter",
    "lm": "aospec.drafters.lm:LMObservationDrafter",
}

#: name -> "module:attr" of action drafter classes.
ACTION_DRAFTERS: dict[str, str] = {
    "history": "aospec.drafters.history:HistoryActionDrafter",
    "moves": "aospec.drafters.moves:MovesActionDrafter",
    "calls": "aospec.drafters.calls:CallsActionDrafter",
    "lm": "aospec.drafters.lm:LMActionDrafter",
}

#: name -> "module:attr" of language-model backends used by the LM drafters.
LM_BACKENDS: dict[str, str] = {
    "transformers": "aospec.drafters.backends.transformers:TransformersBackend",
    "vllm": "aospec.drafters.backends.vllm:VLLMBackend",
    "openai": "aospec.drafters.backends.openai:OpenAIBackend",
}

#: name -> "module:attr" of EVD similarity kernels.
KERNELS: dict[str, str] = {
    "pattern": "aospec.evd:PatternKernel",
    "embedding": "aospec.drafters.embedding:EmbeddingKernel",
}

_REGISTRIES = {
    "observation drafter": OBSERVATION_DRAFTERS,
    "action drafter": ACTION_DRAFTERS,
    "LM backend": LM_BACKENDS,
    "EVD kernel": KERNELS,
}


def resolve(kind: str, name: str) -> Any:
    """The class registered as ``name`` for ``kind`` (one of the registry kinds above)."""
    return import_object(name, _REGISTRIES[kind], kind)
