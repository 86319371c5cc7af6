"""The OpenAI-compatible backend against a real HTTP completions server; vLLM's absence."""

from __future__ import annotations

import math
import socket

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

from aospec.drafters.backends.openai import OpenAIBackend, render_chatml
from aospec.drafters.backends.server import CompletionServer
from aospec.drafters.backends.transformers import TransformersBackend

from aospec.errors import ConfigError, DrafterError

MESSAGES = [{"role": "system", "content": "task"}, {"role": "user", "content": "cat notes.txt"}]


@pytest.fixture(scope="module")
def local() -> TransformersBackend:
    return TransformersBackend("tiny", texts=["cat notes.txt", "hello world"] * 20, vocab_size=400, device="cpu")


@pytest.fixture(scope="module")
def url(local: TransformersBackend):
    with CompletionServer(local, name="obs").running() as base_url:
        yield base_url


def test_chatml_rendering_matches_the_trained_tokenizer_template(local: TransformersBackend) -> None:
    assert render_chatml(MESSAGES) == local.render(MESSAGES)


def test_completions_carry_summed_logprobs(local: TransformersBackend, url: str) -> None:
    remote = OpenAIBackend("obs", base_url=url)
    prompt = remote.render(MESSAGES)
    comps = anyio.run(lambda: remote.complete(prompt, n=1, max_new_tokens=12, mode="greedy"))
    ref = local.complete_sync(prompt, n=1, max_new_tokens=12, mode="greedy")[0]
    assert len(comps) == 1
    got = comps[0]
    assert got.text == ref.text and got.finished == ref.finished
    # servers leave the stop token's log-probability out of token_logprobs
    end_lp = ref.token_logprobs[-1] if ref.finished else 0.0
    assert math.isclose(got.logprob, ref.logprob - end_lp, abs_tol=1e-4)
    assert got.tokens == ref.tokens


def test_n_samples_come_back_in_order(url: str) -> None:
    remote = OpenAIBackend("obs", base_url=url)
    comps = anyio.run(lambda: remote.complete(remote.render(MESSAGES), n=3, max_new_tokens=6))
    assert len(comps) == 3
    assert all(c.logprob <= 0 and c.tokens >= 1 for c in comps)


def test_server_errors_and_unreachable_servers_are_drafter_errors(url: str) -> None:
    wrong = OpenAIBackend("no-such-model", base_url=url)
    with pytest.raises(DrafterError, match="404"):
        anyio.run(lambda: wrong.complete("x", n=1, max_new_tokens=2))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = OpenAIBackend("obs", base_url=f"http://127.0.0.1:{port}/v1", timeout_s=2)
    with pytest.raises(DrafterError, match="cannot reach"):
        anyio.run(lambda: down.complete("x", n=1, max_new_tokens=2))


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="http"):
        OpenAIBackend("m", base_url="localhost:8000")
    with pytest.raises(ConfigError, match="beam"):
        anyio.run(lambda: OpenAIBackend("m").complete("x", n=2, max_new_tokens=2, mode="beam"))
    assert OpenAIBackend("m").count_tokens("12345678") == 2
