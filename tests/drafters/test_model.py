"""Tokenizers trained on traces and the Qwen3 model factory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from aospec.drafters.model import SHAPES, build_model, load_model, qwen3_config  # noqa: E402
from aospec.drafters.tokenizer import CHATML_TEMPLATE, END_TOKEN, train_tokenizer  # noqa: E402
from aospec.replay import bundled_traces_path, load_traces  # noqa: E402

from aospec.errors import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def texts() -> list[str]:
    traces = load_traces([bundled_traces_path()])
    return [x for t in traces for s in t.steps for x in (s.action.command or s.action.key, s.observation)]


@pytest.fixture(scope="module")
def tokenizer(texts: list[str]):
    return train_tokenizer(texts, vocab_size=2048)


def roundtrip(tok, text: str) -> str:
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"], clean_up_tokenization_spaces=False)


def test_tokenizer_round_trips_every_trace_text_byte_for_byte(tokenizer, texts: list[str]) -> None:
    assert len(tokenizer) == 2048
    for text in texts:
        assert roundtrip(tokenizer, text) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_tokenizer_round_trips_arbitrary_text(tokenizer, text: str) -> None:
    assert roundtrip(tokenizer, text) == text


def test_tokenizer_compresses_trace_text(tokenizer, texts: list[str]) -> None:
    sample = "".join(texts[:200])
    assert len(tokenizer(sample, add_special_tokens=False)["input_ids"]) < len(sample.encode()) / 2.5


def test_chat_template_is_chatml_with_the_end_token(tokenizer) -> None:
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert tokenizer.eos_token == END_TOKEN
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "ls"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nls<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(END_TOKEN)) == 2


def test_tiny_model_is_deterministic_for_a_seed(tokenizer) -> None:
    a = build_model("tiny", tokenizer, seed=3)
    b = build_model("tiny", tokenizer, seed=3)
    c = build_model("tiny", tokenizer, seed=4)
    pa, pb, pc = (torch.nn.utils.parameters_to_vector(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)
    assert a.config.model_type == "qwen3"
    assert a.config.vocab_size >= len(tokenizer) and a.config.vocab_size % 64 == 0
    assert a.config.eos_token_id == tokenizer.convert_tokens_to_ids(END_TOKEN)


def test_qwen3_0_6b_shape_has_the_real_parameter_count(tokenizer) -> None:
    config = qwen3_config("qwen3-0.6b", tokenizer)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (28, 1024, 151936)
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    assert 590e6 < n < 610e6  # Qwen3-0.6B: 596M with tied embeddings


def test_unknown_shapes_and_paths_are_config_errors(tokenizer, tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown model shape"):
        qwen3_config("huge", tokenizer)
    with pytest.raises(ConfigError, match="neither a shape"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot load a causal LM"):
        load_model(str(tmp_path))
    assert set(SHAPES) >= {"tiny", "small", "qwen3-0.6b"}


def test_a_saved_model_directory_loads_back_identically(tokenizer, tmp_path) -> None:
    model = build_model("tiny", tokenizer, seed=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        assert torch.allclose(model(input_ids=ids).logits, loaded.model(input_ids=ids).logits, atol=1e-6)
    assert loaded.tokenizer.chat_template == CHATML_TEMPLATE
