"""In-process vLLM backend (``vllm.LLM``), with LoRA adapters from ``aospec train``.

``model`` is a local model directory or an ``aospec train`` output directory: a LoRA
result runs as its base model plus a ``LoRARequest`` for its adapter, a full result as
its ``model/`` directory. vLLM is imported only here; without it the backend raises one
MissingDependencyError naming ``pip install 'aospec[vllm]'``.

Checked against the sources of vLLM 0.8.5, 0.10.2, 0.11.0, 0.20.0 and 0.33.0 (V1 engine). The prompt is tokenized here with the
model's own tokenizer (as the transformers backend does) and passed as token ids; the
sampled token's log-probability comes from ``logprobs=0`` (V1 reports raw log-probabilities,
before temperature, so sequence probabilities are at temperature 1); the reply ends on the
same end tokens as the transformers backend (``stop_token_ids``), and a completion is
``finished`` when it ends on one of them: an end token drawn as the very last allowed
token counts as finished, which V1 up to 0.11 reports as ``finish_reason="length"``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aospec.drafters.backends import BlockingCompletions, Completion, DecodeMode, Offload, _text
from aospec.drafters.backends._text import TokenizerText, prompt_seed

from aospec._lazy import require
from aospec.errors import ConfigError, DrafterError

__all__ = [
    "VLLMBackend",
    "VLLMModel",
    "VLLMText",
    "completion_from_output",
    "end_token_ids",
    "hf_overrides_for",
    "lora_rank_slot",
    "resolve_model",
]

#: Values vLLM accepts for ``max_lora_rank`` (0.8.5 to 0.33; 0.20+ also 1).
LORA_RANK_SLOTS = (8, 16, 32, 64, 128, 256, 320, 512)
#: Context length used when ``max_model_len`` is not given (capped by the model's own).
DEFAULT_MAX_MODEL_LEN = 4096
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMModel:
    """What ``vllm.LLM`` runs for a model spec (see :func:`resolve_model`)."""

    model: str
    tokenizer: str
    adapter: str | None = None
    lora_rank: int | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def max_position_embeddings(self) -> int | None:
        value = self.config.get("max_position_embeddings")
        return int(value) if isinstance(value, int) else None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {what} is not a JSON object")
    return value


def _adapter_rank(adapter: Path) -> int:
    cfg = _read_json(adapter / "adapter_config.json", "the PEFT adapter config")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{adapter}: vLLM serves LoRA adapters only, this one is {cfg.get('peft_type')!r}")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{adapter / 'adapter_config.json'}: field 'r' (the LoRA rank) is missing or invalid")
    return rank


def resolve_model(model: str, adapter: str | None = None) -> VLLMModel:
    """The model directory, tokenizer directory and adapter of ``model``: an ``aospec
    train`` output (LoRA: its base plus ``adapter/``; full: ``model/``) or a local Hugging
    Face model directory, plus an optional explicit PEFT ``adapter`` directory."""
    from aospec.drafters.model import is_shape, trained_meta

    if is_shape(model):
        raise ConfigError(
            f"vllm backend: {model!r} is a model shape, built only by the transformers backend; "
            f"train it first (aospec train --base-model {model} --out DIR) and pass model=DIR"
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(f"vllm backend: {model!r} is not a local model directory")
    meta = trained_meta(str(path))
    if meta:
        tokenizer = path / "tokenizer"
        weights = path / str(meta.get("weights") or ("adapter" if meta.get("mode") == "lora" else "model"))
        if meta.get("mode") == "lora":
            base = path / "base" if (path / "base").is_dir() else Path(str(meta.get("base", "")))
            if not (base / "config.json").is_file():
                raise ConfigError(f"{path}: its base model {str(base)!r} is gone (no config.json there)")
            if adapter is None:
                if not (weights / "adapter_config.json").is_file():
                    raise ConfigError(f"{path}: training has not finished (no {weights.name}/ yet); "
                                      "finish it with aospec train --resume")
                adapter = str(weights)
        else:
            base = weights
            if not (base / "config.json").is_file():
                raise ConfigError(f"{path}: training has not finished (no {weights.name}/ yet); "
                                  "finish it with aospec train --resume")
        if not tokenizer.is_dir():
            tokenizer = base
    else:
        base = tokenizer = path
        if not (base / "config.json").is_file():
            raise ConfigError(f"vllm backend: {model!r} holds no config.json (not a Hugging Face model directory)")
    rank = None
    if adapter is not None:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise ConfigError(f"adapter {adapter!r}: no adapter_config.json there (not a PEFT adapter directory)")
        rank = _adapter_rank(Path(adapter))
    config = _read_json(base / "config.json", "the model config")
    return VLLMModel(str(base), str(tokenizer), adapter, rank, config)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of rank ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if rank <= slot:
            return slot
    raise ConfigError(f"vllm backend: LoRA rank {rank} exceeds vLLM's largest max_lora_rank ({LORA_RANK_SLOTS[-1]})")


def hf_overrides_for(config: Mapping[str, Any], transformers_version: str) -> dict[str, Any]:
    """Config fields a transformers-4 reader needs restated from a transformers-5 config.

    Many vLLM releases run with transformers 4 (some pin ``<5``, 0.33 needs 5.16+);
    transformers 5 writes the RoPE base only inside ``rope_parameters``, which
    transformers 4 ignores (falling back to a default ``rope_theta`` silently: the model
    would run with the wrong positions)."""
    major = int(transformers_version.split(".")[0])
    rope = config.get("rope_parameters")
    if major >= 5 or "rope_theta" in config or not isinstance(rope, Mapping) or "rope_theta" not in rope:
        return {}
    return {"rope_theta": rope["rope_theta"]}


def end_token_ids(tokenizer: Any, model_dir: str | Path) -> tuple[int, ...]:
    """Token ids that end a reply (the same set as the transformers backend): the
    tokenizer's and the model's generation-config EOS ids and the chat end tokens."""
    model_dir = Path(model_dir)
    eos = None
    for name in ("generation_config.json", "config.json"):
        if (model_dir / name).is_file():
            eos = _read_json(model_dir / name, name).get("eos_token_id")
            break
    return _text.end_token_ids(tokenizer, eos, model=str(model_dir))


def completion_from_output(
    token_ids: Sequence[int],
    token_logprobs: Sequence[float],
    finish_reason: str | None,
    *,
    end_ids: Iterable[int],
    decode: Callable[[list[int]], str],
) -> Completion:
    """A :class:`Completion` from one vLLM output given as plain values: generated ids,
    the sampled tokens' log-probabilities, and vLLM's ``finish_reason``.

    The continuation is cut after its first end token (beam search runs on past the ones
    vLLM does not know); it is finished when it ends on one, or when vLLM says ``stop``
    (no stop strings are passed, so a stop is always a stop token, the last id). The text
    leaves the end token out; the log-probability and token count include it."""
    ids = [int(t) for t in token_ids]
    ends = set(end_ids)
    cut = next((i + 1 for i, t in enumerate(ids) if t in ends), None)
    if cut is not None:
        ids = ids[:cut]
    finished = cut is not None or (finish_reason == "stop" and bool(ids))
    lps = [float(x) for x in token_logprobs]
    if len(lps) < len(ids):
        raise DrafterError(f"vllm backend: {len(lps)} log-probabilities for {len(ids)} generated tokens")
    lps = lps[: len(ids)]
    body = ids[:-1] if finished else ids
    return Completion(decode(body), math.fsum(lps), len(ids), finished, tuple(ids), tuple(lps))


def _step_logprobs(token_ids: Sequence[int], steps: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """The sampled tokens' log-probabilities out of vLLM's per-position ``{id: Logprob}``."""
    if steps is None:
        raise DrafterError("vllm backend: vLLM returned no log-probabilities (logprobs=0 was requested)")
    out = []
    for tok, step in zip(token_ids, steps, strict=False):
        entry = step.get(tok)
        if entry is None:
            raise DrafterError(f"vllm backend: no log-probability for sampled token {tok}")
        out.append(float(entry.logprob))
    return out


def _field_names(cls: type) -> set[str]:
    """Constructor fields of a msgspec Struct, dataclass or plain class."""
    fields = getattr(cls, "__struct_fields__", None)
    if fields is not None:
        return set(fields)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


def _load_tokenizer(transformers: Any, path: str) -> Any:
    # transformers 5 builds an empty tokenizer from config.json alone: insist on its files.
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise ConfigError(f"vllm backend: cannot load the tokenizer in {path}: none of {', '.join(_TOKENIZER_FILES)} there")
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        hint = ""
        if "TokenizersBackend" in str(exc):
            hint = ('; it was saved by transformers 5, which transformers 4 cannot read: set "tokenizer_class": '
                    '"PreTrainedTokenizerFast" in its tokenizer_config.json, or train in this environment')
        raise ConfigError(
            f"vllm backend: cannot load the tokenizer in {path} with transformers "
            f"{transformers.__version__}: {exc}{hint}"
        ) from None


class VLLMText(TokenizerText):
    """The tokenizer side of :class:`VLLMBackend` (no vLLM needed): chat rendering, token
    counting, end tokens, and turning generated ids into :class:`Completion`."""

    def __init__(self, spec: VLLMModel) -> None:
        transformers = require("transformers", "vllm", purpose="the vLLM backend's tokenizer")
        self.spec = spec
        self.transformers_version = str(transformers.__version__)
        self.tokenizer = _load_tokenizer(transformers, spec.tokenizer)
        self.end_ids = end_token_ids(self.tokenizer, spec.model)
        self._counts: dict[str, int] = {}

    def completion(self, token_ids: Sequence[int], token_logprobs: Sequence[float], finish_reason: str | None) -> Completion:
        """:func:`completion_from_output` with this model's end tokens and decoding."""
        return completion_from_output(token_ids, token_logprobs, finish_reason, end_ids=self.end_ids, decode=self.decode_text)


class VLLMBackend(BlockingCompletions):
    """Sampling through an in-process ``vllm.LLM``.

    ``adapter`` (a PEFT LoRA directory, implied by an ``aospec train`` LoRA directory),
    ``seed``, ``gpu_memory_utilization`` (default 0.3: the drafter shares the GPU),
    ``max_model_len`` (default min(4096, the model's)), ``max_lora_rank`` (default the
    smallest vLLM slot above the adapter's rank); other options go to ``vllm.LLM`` (any
    ``vllm.EngineArgs`` field, e.g. ``enforce_eager``, ``dtype``) and unknown ones are
    rejected before vLLM starts.
    """

    def __init__(
        self,
        model: str,
        *,
        adapter: str | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        max_lora_rank: int | None = None,
        offload: Offload = "auto",
        **llm_options: Any,
    ) -> None:
        vllm = require("vllm", "vllm", purpose="the vLLM drafter backend")
        spec = resolve_model(model, adapter)
        self.spec = spec
        self._vllm = vllm
        self.text = VLLMText(spec)
        self.tokenizer = self.text.tokenizer
        self.max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, spec.max_position_embeddings or DEFAULT_MAX_MODEL_LEN)
        self.seed = seed
        self.offload = offload
        options: dict[str, Any] = dict(
            model=spec.model, tokenizer=spec.tokenizer, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=self.max_model_len,
        )
        if spec.adapter is not None:
            options.update(enable_lora=True, max_lora_rank=max_lora_rank or lora_rank_slot(spec.lora_rank or 1))
        overrides = hf_overrides_for(spec.config, self.text.transformers_version)
        if overrides and not callable(llm_options.get("hf_overrides")):
            options["hf_overrides"] = {**overrides, **(llm_options.pop("hf_overrides", None) or {})}
        options.update(llm_options)
        self._check_options(vllm, options)
        try:
            self.llm = vllm.LLM(**options)
        except Exception as exc:
            raise DrafterError(f"vllm backend: vllm.LLM did not start on {spec.model}: {type(exc).__name__}: {exc}") from exc
        self.lora = self._lora_request(spec.adapter) if spec.adapter is not None else None
        self._lock = threading.Lock()

    @staticmethod
    def _check_options(vllm: Any, options: Mapping[str, Any]) -> None:
        known = set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
        if dataclasses.is_dataclass(vllm.EngineArgs):
            known |= {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"vllm backend: vllm.LLM has no option {', '.join(map(repr, unknown))} "
                              f"(vLLM {getattr(vllm, '__version__', '?')}; see vllm.EngineArgs)")

    @staticmethod
    def _lora_request(adapter: str) -> Any:
        from vllm.lora.request import LoRARequest

        # The path field is ``lora_path`` since vLLM 0.6 (``lora_local_path`` before).
        path_field = "lora_path" if "lora_path" in _field_names(LoRARequest) else "lora_local_path"
        return LoRARequest(lora_name="aospec-drafter", lora_int_id=1, **{path_field: str(adapter)})

    # ----------------------------------------------------------------- text helpers

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        return self.text.render(messages)

    def count_tokens(self, text: str) -> int:
        return self.text.count_tokens(text)

    def _seed(self, prompt: str, seed: int) -> int:
        # 31 bits: vLLM gives the k-th of n samples seed + k.
        return prompt_seed(prompt, self.seed, seed, bits=31)

    # ----------------------------------------------------------------- decoding

    def complete_sync(
        self,
        prompt: str,
        *,
        n: int,
        max_new_tokens: int,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        seed: int = 0,
        stop: threading.Event | None = None,
    ) -> list[Completion]:
        """Blocking completions (1 for greedy); the sequence log-probability sums the
        generated tokens' (end token included). vLLM's ``generate`` cannot be interrupted:
        ``stop`` is not consulted (a cancelled caller waits for the generation)."""
        ids = self.text.request_ids(prompt, n=n, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                              limit=self.max_model_len, limit_name="max_model_len")
        with self._lock:
            if mode == "beam":
                return self._beam(ids, n, max_new_tokens)
            greedy = mode == "greedy"
            params = self._vllm.SamplingParams(
                n=1 if greedy else n,
                temperature=0.0 if greedy else temperature,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=None if greedy else self._seed(prompt, seed),
                stop_token_ids=list(self.text.end_ids),
                detokenize=False,
            )
            try:
                result = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self.lora)
            except Exception as exc:
                raise DrafterError(f"vllm backend: generation failed: {type(exc).__name__}: {exc}") from exc
        outputs = sorted(result[0].outputs, key=lambda c: c.index)
        return [self.text.completion(c.token_ids, _step_logprobs(c.token_ids, c.logprobs), c.finish_reason)
                for c in outputs]

    def _beam(self, ids: list[int], n: int, max_new_tokens: int) -> list[Completion]:
        from vllm.sampling_params import BeamSearchParams

        kwargs: dict[str, Any] = dict(beam_width=n, max_tokens=max_new_tokens)
        if "length_penalty" in _field_names(BeamSearchParams):
            kwargs["length_penalty"] = 0.0  # rank beams by sequence log-probability, as the transformers backend
        accepts = inspect.signature(self.llm.beam_search).parameters
        call: dict[str, Any] = {}
        if self.lora is not None:
            if "lora_request" not in accepts:
                raise ConfigError("vllm backend: this vLLM's beam_search takes no LoRA adapter (0.8 does not, "
                                  "0.10+ does); use mode sample or greedy, or a newer vLLM")
            call["lora_request"] = self.lora
        try:
            result = self.llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(**kwargs), **call)
        except Exception as exc:
            raise DrafterError(f"vllm backend: beam search failed: {type(exc).__name__}: {exc}") from exc
        out = []
        for seq in result[0].sequences[:n]:
            gen = list(seq.tokens[len(ids):])  # a beam's tokens start with the prompt
            steps = list(seq.logprobs)  # one {id: Logprob} per generated token
            if len(steps) == len(gen) + 1:  # an end token left out of ``tokens`` (online beam search does)
                ends = [t for t in steps[-1] if t in self.text.end_ids]
                if len(ends) == 1:
                    gen.append(ends[0])
            out.append(self.text.completion(gen, _step_logprobs(gen, steps[: len(gen)]), seq.finish_reason))
        return out
