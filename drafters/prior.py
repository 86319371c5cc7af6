"""The frequency prior of the LM drafters: the most frequent targets of the training set.

A small language model often samples the same text N times (the common empty output),
so its distinct candidates are fewer than the width asked for, and the most frequent
training targets beat it. The LM drafters and ``aospec train``'s evaluation therefore
interpolate the model's finished samples with this prior (Witten-Bell, as the pattern
drafter does over command contexts): with ``n`` finished samples holding ``u`` distinct
texts, the model keeps weight ``λ = n / (n + u)`` and the prior gets the escape mass
``1 - λ``::

    p(c) = λ · p_model(c) + (1 - λ) · p_prior(c)

``p_model`` is the model's sequence probability at temperature 1 (0 for a text it did not
sample) and ``p_prior`` the text's share of the training targets (0 outside the prior's
top texts). A model that is sure (all samples agree) keeps 8/9 of the weight at eight
samples; one that samples eight different texts keeps half; one that finishes no sample
leaves the candidates to the prior; without a prior (no training targets) the model's
candidates are unchanged. The result is a set of distinct texts whose probabilities sum
to at most 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aospec.errors import ConfigError

__all__ = ["PRIOR_SIZE", "FrequencyPrior", "interpolate"]

#: How many of the most frequent training targets a prior keeps.
PRIOR_SIZE = 8

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class FrequencyPrior:
    """The ``size`` most frequent targets of a training set, most frequent first, each with
    its share of all targets (``examples`` of them)."""

    top: tuple[tuple[str, float], ...] = ()
    examples: int = 0

    @classmethod
    def of(cls, targets: Iterable[str], size: int = PRIOR_SIZE) -> FrequencyPrior:
        """The prior of ``targets`` (ties: first seen first)."""
        counts = Counter(targets)
        total = sum(counts.values())
        return cls(tuple((t, n / total) for t, n in counts.most_common(size)), total)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FrequencyPrior:
        """The prior saved by :meth:`to_json` (``aospec-model.json``'s ``prior``)."""
        try:
            top = tuple((str(t), float(p)) for t, p in data.get("top", ()))
            examples = int(data.get("examples", 0))
        except (TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"frequency prior: expected {{'top': [[text, share], ...], 'examples': N}}: {exc}") from None
        if any(not 0.0 <= p <= 1.0 for _, p in top) or examples < 0:
            raise ConfigError("frequency prior: shares must be in [0, 1] and examples >= 0")
        return cls(top, examples)

    def to_json(self) -> dict[str, Any]:
        return {"top": [[t, p] for t, p in self.top], "examples": self.examples}

    def texts(self, k: int | None = None) -> list[str]:
        """The ``k`` most frequent targets (all kept ones by default)."""
        return [t for t, _ in self.top[:k]]


def interpolate(
    candidates: Sequence[tuple[K, float]], prior: Sequence[tuple[K, float]], *, finished_samples: int
) -> list[tuple[K, float]]:
    """Distinct keys of the model's ``candidates`` (key, model probability) and of the
    ``prior`` (key, share; :attr:`FrequencyPrior.top`, or its texts parsed into actions)
    with interpolated probabilities (module doc), most probable first; ties keep the
    model's order, then the prior's. ``finished_samples`` is ``n``: the samples the
    candidates were drawn from, duplicates included."""
    model: dict[K, float] = {}
    for key, p in candidates:
        model.setdefault(key, p)
    shares: dict[K, float] = {}
    for key, p in prior:
        shares.setdefault(key, p)
    if not shares:
        return list(model.items())
    n, u = finished_samples, len(model)
    lam = n / (n + u) if n > 0 and u > 0 else 0.0
    order = list(dict.fromkeys([*model, *shares]))
    scored = [(k, lam * model.get(k, 0.0) + (1.0 - lam) * shares.get(k, 0.0)) for k in order]
    return [scored[i] for i in sorted(range(len(scored)), key=lambda i: (-scored[i][1], i))]
