"""Qwen3-architecture model factory and loading of base models and trained drafters.

A *model spec* is one of:

- a shape name from :data:`SHAPES` (``tiny``, ``small``, ``qwen3-0.6b``): a randomly
  initialised Qwen3 model of that shape with a byte-level BPE tokenizer trained on the
  given texts (no hub: this is how tests and demos get a model);
- a directory written by ``aospec train`` (it holds ``aospec-model.json``): the trained
  drafter (full weights, or base + PEFT adapter);
- any local Hugging Face model directory (e.g. Qwen3-0.6B), loaded with
  ``local_files_only=True``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aospec._files import new_file_mode
from aospec._lazy import require
from aospec.errors import ConfigError

__all__ = [
    "MODEL_META",
    "SHAPES",
    "LoadedModel",
    "build_model",
    "check_model_spec",
    "fix_modes",
    "is_shape",
    "load_model",
    "make_portable",
    "qwen3_config",
    "resolve_device",
    "resolve_dtype",
    "trained_meta",
]

#: File that marks a directory written by ``aospec train``.
MODEL_META = "aospec-model.json"

#: Model shapes by name (Qwen3 hyper-parameters; the vocabulary comes from the tokenizer).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32,
    ),
    "small": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
}


def is_shape(spec: str) -> bool:
    return spec in SHAPES


def check_model_spec(spec: str) -> None:
    """ConfigError unless ``spec`` can name a model (see the module doc): a shape, an
    ``aospec train`` directory or a model directory with a ``config.json``. Checks only the
    files, without importing torch."""
    if is_shape(spec):
        return
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ConfigError(f"model {spec!r} is neither a shape ({', '.join(SHAPES)}) nor a local model directory")
    if not (path / MODEL_META).is_file() and not (path / "config.json").is_file():
        raise ConfigError(
            f"cannot load a causal LM from {path}: no config.json (nor {MODEL_META}) there; "
            f"give a Hugging Face model directory, an aospec train output or a shape ({', '.join(SHAPES)})"
        )


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM ready for inference or training, with its tokenizer and provenance."""

    model: Any
    tokenizer: Any
    spec: str
    meta: Mapping[str, Any]


def resolve_device(device: str = "auto") -> str:
    torch = require("torch", "train")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available here (use device='cpu')")
    return device


def resolve_dtype(dtype: str | None, device: str) -> Any:
    torch = require("torch", "train")
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        raise ConfigError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)") from None
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)")
    return value


def qwen3_config(shape: str | Mapping[str, Any], tokenizer: Any, **overrides: Any) -> Any:
    """A Qwen3Config of ``shape`` whose vocabulary covers ``tokenizer``."""
    transformers = require("transformers", "train")
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
        params = dict(SHAPES[shape])
    else:
        params = dict(shape)
    params.update(overrides)
    vocab = max(params.pop("vocab_size", 0), -(-len(tokenizer) // 64) * 64)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.convert_tokens_to_ids(tokenizer.pad_token) if tokenizer.pad_token else eos
    kwargs = dict(
        vocab_size=vocab,
        max_position_embeddings=params.pop("max_position_embeddings", 8192),
        tie_word_embeddings=params.pop("tie_word_embeddings", True),
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        **params,
    )
    theta = kwargs.pop("rope_theta", 1_000_000.0)
    try:
        return transformers.Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": theta}, **kwargs)
    except TypeError:  # transformers < 5 takes rope_theta directly
        return transformers.Qwen3Config(rope_theta=theta, **kwargs)


def build_model(
    shape: str | Mapping[str, Any],
    tokenizer: Any,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: Any = None,
    attn_implementation: str = "sdpa",
) -> Any:
    """A randomly initialised Qwen3ForCausalLM of ``shape`` (deterministic for ``seed``)."""
    torch = require("torch", "train")
    transformers = require("transformers", "train")
    config = qwen3_config(shape, tokenizer)
    config._attn_implementation = attn_implementation
    # Initialise on the target device (a 0.6B model initialises in seconds on a GPU,
    # much longer on a CPU); the seed fixes the weights for CPU builds.
    with torch.random.fork_rng(devices=[device] if device.startswith("cuda") else []), torch.device(device):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(dtype=dtype or torch.float32)


def make_portable(directory: str | Path) -> None:
    """Make a model or tokenizer directory saved by transformers 5 loadable by transformers
    4 too (vLLM releases often pin it): the tokenizer class is named as the fast tokenizer
    both know, and the RoPE base, which transformers 5 keeps only inside
    ``rope_parameters``, is restated at the top level where transformers 4 reads it
    (transformers 5 reads either, to the same value)."""
    path = Path(directory)
    tok = path / "tokenizer_config.json"
    if tok.is_file():
        data = json.loads(tok.read_text())
        if data.get("tokenizer_class") == "TokenizersBackend":
            data["tokenizer_class"] = "PreTrainedTokenizerFast"
            tok.write_text(json.dumps(data, indent=2) + "\n")
    cfg = path / "config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        theta = (data.get("rope_parameters") or {}).get("rope_theta")
        if "rope_theta" not in data and theta is not None:
            data["rope_theta"] = theta
            cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def fix_modes(directory: str | Path) -> None:
    """Give the files under ``directory`` that were written private (mode 0600, as
    safetensors writes ``model.safetensors``) the mode the umask gives new files (0644
    under the usual umask 022), so a saved model can be served by another user."""
    mode = new_file_mode()
    for path in Path(directory).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600 and mode != 0o600:
            path.chmod(mode)


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / MODEL_META).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path / MODEL_META}: cannot read the trained-model description: {exc}") from None


def trained_meta(spec: str) -> dict[str, Any]:
    """The ``aospec-model.json`` of an ``aospec train`` directory, or {} for any other spec."""
    path = Path(spec).expanduser()
    if is_shape(spec) or not (path / MODEL_META).is_file():
        return {}
    return _read_meta(path)


def load_model(
    spec: str,
    *,
    adapter: str | None = None,
    device: str = "cpu",
    dtype: Any = None,
    texts: Iterable[str] | None = None,
    vocab_size: int = 4096,
    seed: int = 0,
    merge_adapter: bool = True,
) -> LoadedModel:
    """Load (or, for a shape name, build) a causal LM and its tokenizer; see the module doc.

    ``adapter`` is a PEFT adapter directory applied on top (merged into the weights when
    ``merge_adapter``, which is what fast decoding wants).
    """
    torch = require("torch", "train")
    transformers = require("transformers", "train")
    from aospec.drafters.tokenizer import train_tokenizer

    transformers.utils.logging.disable_progress_bar()
    dtype = dtype or torch.float32
    meta: dict[str, Any] = {}
    if is_shape(spec):
        tokenizer = train_tokenizer(texts or (), vocab_size=vocab_size)
        model = build_model(spec, tokenizer, seed=seed, device=device, dtype=dtype)
        meta = {"base": spec}
    else:
        check_model_spec(spec)
        path = Path(spec).expanduser()
        if (path / MODEL_META).is_file():
            meta = _read_meta(path)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
            weights = path / meta.get("weights", "model")
            if meta.get("mode") == "lora":
                base = path / "base" if (path / "base").is_dir() else Path(meta["base"])
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(base), local_files_only=True, dtype=dtype
                )
                if adapter is None:
                    adapter = str(weights)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(weights), local_files_only=True, dtype=dtype
                )
        else:
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path), local_files_only=True, dtype=dtype
                )
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot load a causal LM from {path}: {exc}") from None
            meta = {"base": str(path.resolve())}
        model = model.to(device)
    if adapter is not None:
        peft = require("peft", "train", purpose="loading a LoRA adapter")
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise ConfigError(f"adapter {adapter!r}: no adapter_config.json there (not a PEFT adapter directory)")
        model = peft.PeftModel.from_pretrained(model, adapter)
        if merge_adapter:
            model = model.merge_and_unload()
        meta = {**meta, "adapter": str(adapter)}
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, meta=meta)
