"""The vLLM backend without vLLM: model resolution on real `aospec train` output, the
tokenizer side against the transformers backend, output conversion, the missing-package
error. (vllm.LLM itself needs a GPU; scripts/device_train_check.sh runs it there.)"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from aospec.drafters.backends import make_backend
from aospec.drafters.backends.transformers import TransformersBackend
from aospec.drafters.backends.vllm import (
    VLLMText,
    completion_from_output,
    hf_overrides_for,
    lora_rank_slot,
    resolve_model,
)
from aospec.replay import bundled_traces_path

from aospec.cli import main
from aospec.errors import AospecError, ConfigError, DrafterError, MissingDependencyError

FAST = ["--steps", "2", "--batch-size", "2", "--prompt-tokens", "128", "--target-tokens", "16", "--vocab-size", "384",
        "--eval-limit", "1", "--eval-samples", "1", "--checkpoint-every", "100", "--device", "cpu"]
MESSAGES = [{"role": "system", "content": "fix the failing test"}, {"role": "user", "content": "ls -la /app"}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A LoRA (rank 4) and a full fine-tune of the tiny model, written by the real trainer."""
    root = tmp_path_factory.mktemp("vllm-models")
    out = {"lora": root / "lora", "full": root / "full"}
    traces = ["train", "--train-traces", str(bundled_traces_path()), "--base-model", "tiny"]
    assert main([*traces, "--out", str(out["lora"]), "--lora", "--lora-r", "4", *FAST]) == 0
    assert main([*traces, "--out", str(out["full"]), "--full", *FAST]) == 0
    return out


# ----------------------------------------------------------------- resolution


@pytest.mark.slow
def test_lora_result_runs_as_its_base_plus_the_adapter(trained: dict[str, Path]) -> None:
    out = trained["lora"]
    spec = resolve_model(str(out))
    assert (spec.model, spec.tokenizer, spec.adapter) == (str(out / "base"), str(out / "tokenizer"), str(out / "adapter"))
    assert spec.lora_rank == 4 and lora_rank_slot(spec.lora_rank) == 8
    assert spec.max_position_embeddings == 8192


def test_full_result_runs_its_model_directory(trained: dict[str, Path]) -> None:
    out = trained["full"]
    spec = resolve_model(str(out))
    assert (spec.model, spec.tokenizer, spec.adapter, spec.lora_rank) == (
        str(out / "model"), str(out / "tokenizer"), None, None)


def test_plain_model_directory_with_an_explicit_adapter(trained: dict[str, Path]) -> None:
    base, adapter = trained["lora"] / "base", trained["lora"] / "adapter"
    assert resolve_model(str(base)).adapter is None
    spec = resolve_model(str(base), str(adapter))
    assert (spec.model, spec.tokenizer, spec.adapter, spec.lora_rank) == (str(base), str(base), str(adapter), 4)
    # an explicit adapter also overrides the one of a LoRA result
    assert resolve_model(str(trained["lora"]), str(adapter)).adapter == str(adapter)


def test_unusable_model_specs_fail_with_one_clear_error(trained: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"aospec train --base-model tiny"):
        resolve_model("tiny")
    with pytest.raises(ConfigError, match="not a local model directory"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        resolve_model(str(trained["full"]), str(tmp_path))

    unfinished = tmp_path / "unfinished"  # aospec train writes its description first
    unfinished.mkdir()
    shutil.copy(trained["lora"] / "aospec-model.json", unfinished)
    shutil.copytree(trained["lora"] / "tokenizer", unfinished / "tokenizer")
    shutil.copytree(trained["lora"] / "base", unfinished / "base")
    with pytest.raises(ConfigError, match=r"training has not finished.*--resume"):
        resolve_model(str(unfinished))
    shutil.copy(trained["full"] / "aospec-model.json", unfinished)
    with pytest.raises(ConfigError, match=r"training has not finished"):
        resolve_model(str(unfinished))

    moved = tmp_path / "moved"  # a LoRA result whose base was built elsewhere and is gone
    shutil.copytree(trained["lora"], moved, ignore=shutil.ignore_patterns("base", "checkpoints"))
    meta = json.loads((moved / "aospec-model.json").read_text())
    (moved / "aospec-model.json").write_text(json.dumps({**meta, "base": str(tmp_path / "gone")}))
    with pytest.raises(ConfigError, match=r"base model .*gone.* is gone"):
        resolve_model(str(moved))

    (unfinished / "aospec-model.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"aospec-model\.json"):
        resolve_model(str(unfinished))

    bad_rank = tmp_path / "adapter"
    shutil.copytree(trained["lora"] / "adapter", bad_rank)
    cfg = json.loads((bad_rank / "adapter_config.json").read_text())
    (bad_rank / "adapter_config.json").write_text(json.dumps({**cfg, "r": None}))
    with pytest.raises(ConfigError, match=r"adapter_config.json: field 'r'"):
        resolve_model(str(trained["lora"] / "base"), str(bad_rank))


def test_lora_rank_slots() -> None:
    assert [lora_rank_slot(r) for r in (1, 8, 9, 16, 64, 65, 256, 300, 512)] == [8, 8, 16, 16, 64, 128, 256, 320, 512]
    with pytest.raises(ConfigError, match="exceeds"):
        lora_rank_slot(513)


def test_rope_base_is_restated_for_transformers_4_readers(trained: dict[str, Path]) -> None:
    config = resolve_model(str(trained["lora"])).config
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    assert theta == 1_000_000.0
    if "rope_theta" in config:  # written by transformers 4: nothing to restate
        assert hf_overrides_for(config, "4.57.1") == {}
    else:
        assert hf_overrides_for(config, "4.57.1") == {"rope_theta": 1_000_000.0}
    assert hf_overrides_for(config, "5.0.0") == {}


# ----------------------------------------------------------------- tokenizer side


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_tokenizer_side_matches_the_transformers_backend(trained: dict[str, Path], kind: str) -> None:
    text = VLLMText(resolve_model(str(trained[kind])))
    reference = TransformersBackend(str(trained[kind]), device="cpu")
    prompt = text.render(MESSAGES)
    assert prompt == reference.render(MESSAGES)
    assert text.encode(prompt) == reference.encode(prompt)
    assert text.count_tokens(prompt) == reference.count_tokens(prompt) > 0
    assert text.end_ids == reference._end_ids
    assert text.tokenizer.convert_tokens_to_ids("<|im_end|>") in text.end_ids


def test_unloadable_tokenizer_is_a_config_error(trained: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(trained["full"] / "model", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ConfigError, match=r"cannot load the tokenizer in .*model"):
        VLLMText(resolve_model(str(model)))


# ----------------------------------------------------------------- output conversion


def test_conversion_reproduces_the_transformers_backend_completions(trained: dict[str, Path]) -> None:
    reference = TransformersBackend(str(trained["full"]), device="cpu")
    text = VLLMText(resolve_model(str(trained["full"])))
    prompt = reference.render(MESSAGES)
    comps = reference.complete_sync(prompt, n=6, max_new_tokens=10, seed=3)
    assert comps
    for c in comps:
        assert len(c.token_logprobs) == len(c.token_ids) == c.tokens
        reason = "stop" if c.finished else "length"
        assert text.completion(c.token_ids, c.token_logprobs, reason) == c

    c = next(c for c in comps if not c.finished)
    end = text.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = text.completion([*c.token_ids, end], [*c.token_logprobs, -0.5], "stop")
    assert ended.finished and ended.text == c.text and ended.tokens == c.tokens + 1
    assert ended.logprob == pytest.approx(c.logprob - 0.5)
    # V1 checks the length cap before the end token: an end drawn as the last allowed
    # token comes back as "length", yet the model did end the observation.
    assert text.completion([*c.token_ids, end], [*c.token_logprobs, -0.5], "length") == ended


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_conversion_cuts_after_the_first_end_token_and_sums_up_to_it() -> None:
    # beam search only knows the tokenizer's EOS and runs on past other end tokens
    c = completion_from_output([0, 1, 9, 2, 3], [-0.1, -0.2, -0.3, -0.4, -0.5], None, end_ids={7, 9}, decode=decode)
    assert (c.text, c.tokens, c.finished, c.token_ids) == ("ab", 3, True, (0, 1, 9))
    assert c.logprob == pytest.approx(-0.6) and c.token_logprobs == (-0.1, -0.2, -0.3)
    cut = completion_from_output([0, 1, 2], [-1.0, -1.0, -1.0], "length", end_ids={9}, decode=decode)
    assert (cut.text, cut.tokens, cut.finished, cut.logprob) == ("abc", 3, False, -3.0)
    # a stop on an end id that only vLLM knew (generation_config): still the model's end
    other = completion_from_output([0, 4], [-1.0, -2.0], "stop", end_ids={9}, decode=decode)
    assert (other.text, other.tokens, other.finished, other.logprob) == ("a", 2, True, -3.0)
    assert not completion_from_output([], [], "abort", end_ids={9}, decode=decode).finished
    assert math.isfinite(completion_from_output([0], [-1e-9], "length", end_ids={9}, decode=decode).logprob)


def test_missing_logprobs_are_an_error_not_a_partial_result() -> None:
    with pytest.raises(DrafterError, match="2 log-probabilities for 3 generated tokens"):
        completion_from_output([0, 1, 2], [-1.0, -1.0], "length", end_ids={9}, decode=decode)


# ----------------------------------------------------------------- without vLLM


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_vllm_is_one_line_naming_the_install_command(trained: dict[str, Path]) -> None:
    from aospec.drafters.lm import LMObservationDrafter

    for build in (
        lambda: make_backend("vllm", {"model": str(trained["lora"])}),
        lambda: LMObservationDrafter(backend="vllm", model=str(trained["lora"])).backend,
    ):
        with pytest.raises(MissingDependencyError) as info:
            build()
        message = str(info.value)
        assert "pip install 'aospec[vllm]'" in message and "\n" not in message
        assert isinstance(info.value, AospecError)
