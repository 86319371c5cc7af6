"""Language-model drafters: candidate observations and target actions with probabilities.

``LMObservationDrafter`` asks a language model (playing the environment) for the output
of an action in flight: it samples N continuations of a chat prompt built from the
history and the action (:mod:`aospec.drafters.prompts`) and returns the distinct finished ones
with their sequence probabilities ``exp(sum of token logprobs)``.

``LMActionDrafter`` asks a language model (playing the agent) for the next actions: each
sample is a chain of up to ``depth`` actions; the probability of action ``a`` at offset
``d`` is estimated by the fraction of samples that hold ``a`` at ``d`` (ties broken by
the sample's sequence probability).

Both interpolate the model's candidates (observations; next actions at offset 0) with the
training set's most frequent targets (:mod:`aospec.drafters.prior`), so a model that samples one
text eight times still proposes distinct candidates and never fewer good ones than the
frequency prior: ``prior=False`` turns that off. The prior comes from the traces given to
``fit``, else from the trained model directory (``aospec train`` saves it).

Both are built from keyword options, e.g. ``LMObservationDrafter(backend="transformers",
model="tiny", samples=8, device="cpu")``; options the drafter does not know go to the
backend. With a shape name as ``model`` (``tiny``...), ``fit(traces)`` trains the
tokenizer and the model on the training traces first (``fit_steps``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aospec.drafters.backends import DecodeMode, LMBackend, make_backend, merge_completions
from aospec.drafters.prior import FrequencyPrior, interpolate
from aospec.drafters.prompts import (
    ACTION_SEPARATOR,
    PromptBudget,
    action_messages,
    observation_messages,
    parse_action,
    render_action,
)

from aospec.errors import ConfigError
from aospec.protocols import ActionDraft, ObservationDraft
from aospec.types import Action, History, Trace

__all__ = ["Calibration", "LMActionDrafter", "LMObservationDrafter", "fit_calibration"]


@dataclass(frozen=True, slots=True)
class Calibration:
    """A monotone map from a draft's probability (the model's sequence probability,
    interpolated with the prior) to how often drafts of that probability were exactly
    right on held-out examples: ``bins`` are (upper bound, hit rate, drafts) with
    increasing bounds and non-decreasing rates (pool-adjacent-violators)."""

    bins: tuple[tuple[float, float, int], ...] = ()

    def __call__(self, p: float) -> float:
        if not self.bins:
            return p
        for upper, rate, _ in self.bins:
            if p <= upper:
                return rate
        return self.bins[-1][1]

    def to_json(self) -> dict[str, Any]:
        return {"bins": [list(b) for b in self.bins]}

    @classmethod
    def from_json(cls, data: Any) -> Calibration:
        try:
            bins = tuple((float(u), float(r), int(n)) for u, r, n in data["bins"])
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(f"calibration: expected {{'bins': [[upper, rate, count], ...]}}: {exc}") from None
        if any(not 0.0 <= r <= 1.0 for _, r, _ in bins) or list(bins) != sorted(bins):
            raise ConfigError("calibration: bounds must increase and rates lie in [0, 1]")
        return cls(bins)


def fit_calibration(pairs: Sequence[tuple[float, bool]], *, bins: int = 8, min_count: int = 5) -> Calibration:
    """A :class:`Calibration` of (probability, was it right) pairs: equal-count bins of
    the probabilities, then adjacent bins pooled until the hit rates never decrease."""
    if len(pairs) < min_count:
        return Calibration()
    ordered = sorted(pairs)
    size = max(min_count, -(-len(ordered) // bins))
    blocks = [[ordered[i : i + size][-1][0], sum(h for _, h in ordered[i : i + size]), len(ordered[i : i + size])]
              for i in range(0, len(ordered), size)]
    pooled: list[list[float]] = []
    for upper, hits, n in blocks:
        pooled.append([upper, hits, n])
        while len(pooled) > 1 and pooled[-2][1] / pooled[-2][2] > pooled[-1][1] / pooled[-1][2]:
            u, h, m = pooled.pop()
            pooled[-1] = [u, pooled[-1][1] + h, pooled[-1][2] + m]
    return Calibration(tuple((u, h / m, int(m)) for u, h, m in pooled))


class _LMDrafter:
    kind = "observation"

    def __init__(
        self,
        backend: str = "transformers",
        model: str = "tiny",
        *,
        samples: int = 8,
        max_new_tokens: int | None = None,
        mode: DecodeMode = "sample",
        temperature: float = 1.0,
        prompt_tokens: int | None = None,
        fit_steps: int | None = None,
        fit_batch_size: int = 8,
        fit_lr: float | None = None,
        min_probability: float = 0.0,
        seed: int = 0,
        cache_size: int = 256,
        prior: bool = True,
        calibrate: bool = True,
        **backend_options: Any,
    ) -> None:
        from aospec.drafters.model import is_shape, trained_meta

        meta = trained_meta(model) if backend in ("transformers", "vllm") else {}
        if prompt_tokens is None:
            prompt_tokens = int(meta.get("prompt", {}).get("total", 512))
        if max_new_tokens is None:
            max_new_tokens = int(meta.get("config", {}).get("target_tokens", 128))
        self.meta = meta
        if samples < 1 or max_new_tokens < 1:
            raise ConfigError(f"{type(self).__name__}: samples and max_new_tokens must be >= 1")
        if mode not in ("sample", "greedy", "beam"):
            raise ConfigError(f"{type(self).__name__}: mode must be sample, greedy or beam, not {mode!r}")
        self.backend_name = backend
        self.model_spec = model
        self.samples = samples
        self.max_new_tokens = max_new_tokens
        self.mode: DecodeMode = mode
        self.temperature = temperature
        self.budget = PromptBudget(total=prompt_tokens, task=max(16, prompt_tokens // 4), text=max(32, prompt_tokens * 3 // 8))
        self.shape = backend == "transformers" and is_shape(model)
        self.fit_steps = (200 if self.shape else 0) if fit_steps is None else fit_steps
        self.fit_batch_size = fit_batch_size
        self.fit_lr = fit_lr
        self.min_probability = min_probability
        self.seed = seed
        self.cache_size = cache_size
        self.use_prior = prior
        self.prior = FrequencyPrior.from_json(meta["prior"]) if isinstance(meta.get("prior"), dict) else FrequencyPrior()
        cal = meta.get("calibration")
        self.calibration = Calibration.from_json(cal) if calibrate and isinstance(cal, dict) else Calibration()
        self.backend_options = dict(backend_options)
        self.backend_options.setdefault("model", model)
        if backend == "transformers":
            self.backend_options.setdefault("seed", seed)
        self._backend: LMBackend | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.fitted_examples = 0

    def check_config(self) -> None:
        """Raise ConfigError (MissingDependencyError for a missing extra) now if the backend
        cannot be built as configured: an unknown backend or option, a model that is neither
        a shape nor a local model directory, a missing package. Loads no model, so a sweep
        can call it before any work starts instead of failing on every drafting call."""
        import importlib.util
        import inspect

        from aospec.drafters import resolve

        from aospec.errors import MissingDependencyError

        name, options = self.backend_name, self.backend_options
        cls = resolve("LM backend", name)
        try:
            inspect.signature(cls).bind(**options)
        except TypeError as exc:
            raise ConfigError(f"{type(self).__name__}: LM backend {name!r}: {exc}") from None
        needs = {"transformers": (("torch", "train"), ("transformers", "train")), "vllm": (("vllm", "vllm"),)}
        for module, extra in needs.get(name, ()):
            if importlib.util.find_spec(module) is None:
                raise MissingDependencyError(
                    f"{module} is not installed for the {name} drafter backend; install it with: "
                    f"pip install 'aospec[{extra}]'"
                )
        model = str(options.get("model", self.model_spec))
        if name == "transformers" and not self.shape:
            from aospec.drafters.model import check_model_spec

            try:
                check_model_spec(model)  # a named model's missing package: MissingDependencyError as is
            except ConfigError as exc:
                raise ConfigError(f"{type(self).__name__}: {exc}") from None
            adapter = options.get("adapter")
            if adapter is not None and not (Path(str(adapter)) / "adapter_config.json").is_file():
                raise ConfigError(f"{type(self).__name__}: adapter {adapter!r} holds no adapter_config.json")
        if name == "vllm":
            from aospec.drafters.backends.vllm import resolve_model

            resolve_model(model, options.get("adapter"))
        if name == "openai":
            self.backend  # noqa: B018  (cheap: checks the package and base_url, connects nowhere)

    @property
    def backend(self) -> LMBackend:
        """The language model backend (built on first use)."""
        if self._backend is None:
            self._backend = make_backend(self.backend_name, self.backend_options)
        return self._backend

    def _examples(self, traces: Sequence[Trace], count: Any) -> list[Any]:
        raise NotImplementedError

    def _prior_targets(self, traces: Sequence[Trace]) -> list[str]:
        raise NotImplementedError

    def fit(self, traces: Sequence[Trace]) -> None:
        """Learn from training traces: the frequency prior of their targets; for a shape
        model a tokenizer trained on them, and ``fit_steps`` optimisation steps of
        fine-tuning (transformers backend only)."""
        self._cache.clear()
        self.prior = FrequencyPrior.of(self._prior_targets(traces))
        if self.fit_steps <= 0 and not self.shape:
            return
        if self.backend_name != "transformers":
            raise ConfigError(f"{type(self).__name__}: fit_steps > 0 needs the transformers backend")
        if self.shape:
            texts = [t for tr in traces for s in tr.steps for t in (s.action.command or s.action.key, s.observation)]
            self._backend = make_backend("transformers", {**self.backend_options, "texts": texts})
        if self.fit_steps <= 0:
            return
        from aospec.drafters.finetune import fit_examples

        backend: Any = self.backend
        examples = self._examples(traces, backend.count_tokens)
        if not examples:
            return
        lr = self.fit_lr if self.fit_lr is not None else (2e-3 if self.shape else 2e-5)
        fit_examples(
            backend.model, backend.tokenizer, examples, steps=self.fit_steps, batch_size=self.fit_batch_size,
            lr=lr, warmup=min(20, self.fit_steps // 5), target_tokens=self.max_new_tokens, seed=self.seed,
            description=f"fitting {self.kind} drafter",
        )
        backend.reset_compiled()
        self.fitted_examples = len(examples)

    async def _complete(self, prompt: str, n: int) -> Any:
        key = f"{n}\0{prompt}"
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        n = 1 if self.mode == "greedy" else n
        comps = await self.backend.complete(
            prompt, n=n, max_new_tokens=self.max_new_tokens, mode=self.mode, temperature=self.temperature,
            seed=self.seed,
        )
        self._cache[key] = comps
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return comps


class LMObservationDrafter(_LMDrafter):
    """Drafts observations with a language model (see the module doc)."""

    kind = "observation"

    def _examples(self, traces: Sequence[Trace], count: Any) -> list[Any]:
        from aospec.drafters.examples import build_examples

        return build_examples(traces, count=count, kind="observation", budget=self.budget)

    def _prior_targets(self, traces: Sequence[Trace]) -> list[str]:
        return [s.observation for t in traces for s in t.steps if s.completed]

    def prompt(self, history: History, action: Action) -> str:
        """The rendered prompt for the observation of ``action`` after ``history``."""
        backend = self.backend
        return backend.render(observation_messages(history, action, self.budget, backend.count_tokens))

    async def draft(self, history: History, action: Action, n: int) -> Sequence[ObservationDraft]:
        if n <= 0:
            return []
        comps = await self._complete(self.prompt(history, action), max(n, self.samples))
        out = []
        for text, p, tokens in rank_observations(comps, self.prior if self.use_prior else FrequencyPrior()):
            p = self.calibration(p)
            if p < self.min_probability:
                continue
            out.append(ObservationDraft(text, p, None, tokens))
            if len(out) == n:
                break
        return out


class LMActionDrafter(_LMDrafter):
    """Drafts target actions with a language model (see the module doc)."""

    kind = "action"

    def __init__(self, backend: str = "transformers", model: str = "tiny", *, depth: int | None = None,
                 **options: Any) -> None:
        super().__init__(backend, model, **options)
        depth = depth if depth is not None else int(self.meta.get("depth", 3))
        if depth < 1:
            raise ConfigError("LMActionDrafter: depth must be >= 1")
        self.train_depth = depth

    def _examples(self, traces: Sequence[Trace], count: Any) -> list[Any]:
        from aospec.drafters.examples import build_examples

        return build_examples(traces, count=count, kind="action", budget=self.budget, depth=self.train_depth)

    def _prior_targets(self, traces: Sequence[Trace]) -> list[str]:
        return [render_action(s.action) for t in traces for s in t.steps]

    def prompt(self, history: History) -> str:
        """The rendered prompt for the next actions after ``history``."""
        backend = self.backend
        return backend.render(action_messages(history, self.budget, backend.count_tokens))

    async def propose(self, history: History, width: int, depth: int) -> Sequence[ActionDraft]:
        if width <= 0 or depth <= 0:
            return []
        comps = await self._complete(self.prompt(history), max(width, self.samples))
        return rank_action_chains(comps, width, depth, self.prior if self.use_prior else None)


def rank_observations(comps: Sequence[Any], prior: FrequencyPrior) -> list[tuple[str, float, int]]:
    """Distinct finished completions, interpolated with ``prior`` (:mod:`aospec.drafters.prior`),
    most probable first, as (text, probability, tokens generated; 0 for the prior's)."""
    finished = [c for c in merge_completions(comps) if c.finished]
    tokens = {c.text: c.tokens for c in finished}
    ranked = interpolate(
        [(c.text, min(1.0, math.exp(c.logprob))) for c in finished], prior.top,
        finished_samples=sum(1 for c in comps if c.finished),
    )
    return [(text, p, tokens.get(text, 0)) for text, p in ranked]


def rank_action_chains(
    comps: Sequence[Any], width: int, depth: int, prior: FrequencyPrior | None = None
) -> list[ActionDraft]:
    """Turn sampled action chains into ranked (offset, action) drafts: probability is the
    fraction of samples holding the action at that offset; at offset 0 interpolated with
    ``prior`` (the most frequent actions of the training set), when given."""
    if not comps and not (prior and prior.top):
        return []
    stats: dict[tuple[int, Action], list[Any]] = {}
    for c in comps:
        parts = c.text.split(ACTION_SEPARATOR)
        if not c.finished:
            parts = parts[:-1]
        for d, part in enumerate(parts[:depth]):
            action = parse_action(part)
            if action is None:
                break
            rec = stats.get((d, action))
            if rec is None:
                stats[(d, action)] = [1, c.logprob, c.tokens]
            else:
                rec[0] += 1
                if c.logprob > rec[1]:
                    rec[1], rec[2] = c.logprob, c.tokens
    total = len(comps)
    probability = {key: rec[0] / total for key, rec in stats.items()}
    if prior is not None and prior.top:
        first = [(a, p) for (d, a), p in probability.items() if d == 0]
        parsed = [(a, share) for a, share in ((parse_action(t), share) for t, share in prior.top) if a is not None]
        usable = sum(rec[0] for (d, _), rec in stats.items() if d == 0)
        for a, p in interpolate(first, parsed, finished_samples=usable):
            probability[(0, a)] = p
            stats.setdefault((0, a), [0, -math.inf, 0])
    ranked = sorted(stats.items(), key=lambda kv: (-probability[kv[0]], kv[0][0], -kv[1][1]))
    return [ActionDraft(a, d, probability[(d, a)], rec[2]) for (d, a), rec in ranked[:width]]

