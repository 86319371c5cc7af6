"""LM observation and action drafters on a tiny Qwen3 model trained on the bundled traces."""

from __future__ import annotations

import math
from collections import Counter

import anyio
import pytest

pytest.importorskip("torch")

from aospec.drafters import resolve
from aospec.drafters.backends import Completion, merge_completions
from aospec.drafters.lm import LMActionDrafter, LMObservationDrafter, rank_action_chains, rank_observations
from aospec.drafters.prompts import ACTION_SEPARATOR
from aospec.replay import bundled_traces_path, load_traces
from aospec.training.dataset import split_by_task

from aospec.errors import ConfigError
from aospec.protocols import ActionDrafter, ObservationDrafter, Trainable
from aospec.types import Action, History, Trace

OPTIONS = dict(prompt_tokens=192, max_new_tokens=64, samples=6, device="cpu", vocab_size=768, fit_batch_size=6)


@pytest.fixture(scope="module")
def split() -> tuple[list[Trace], list[Trace]]:
    traces = load_traces([bundled_traces_path()])
    train, evals, _ = split_by_task(traces, eval_tasks=["oom", "solana-data"])
    return train, evals


def true_observation_logprob(drafter: LMObservationDrafter, traces: list[Trace], limit: int = 16) -> float:
    backend = drafter.backend
    scores = []
    for trace in traces:
        for i, step in enumerate(trace.steps[:12]):
            if step.completed and len(scores) < limit:
                prompt = drafter.prompt(trace.history(i), step.action)
                scores.append(backend.score(prompt, [step.observation[:200]], finished=len(step.observation) <= 200)[0])
    return sum(scores) / len(scores)


def test_drafters_are_registered_and_implement_the_seams() -> None:
    assert resolve("observation drafter", "lm") is LMObservationDrafter
    assert resolve("action drafter", "lm") is LMActionDrafter
    obs = LMObservationDrafter(model="tiny", **OPTIONS)
    act = LMActionDrafter(model="tiny", **OPTIONS)
    assert isinstance(obs, ObservationDrafter) and isinstance(obs, Trainable)
    assert isinstance(act, ActionDrafter) and isinstance(act, Trainable)


@pytest.mark.slow
def test_fit_learns_the_observations_of_held_out_tasks(split) -> None:
    train, evals = split
    untrained = LMObservationDrafter(model="tiny", fit_steps=0, **OPTIONS)
    untrained.fit(train)  # tokenizer only
    trained = LMObservationDrafter(model="tiny", fit_steps=30, **OPTIONS)
    trained.fit(train)
    assert trained.fitted_examples > 100
    before = true_observation_logprob(untrained, evals)
    after = true_observation_logprob(trained, evals)
    assert after > before + 50  # nats per observation: the format and common outputs are learnt

    history = evals[0].history(2)
    action = evals[0].steps[2].action
    drafts = anyio.run(trained.draft, history, action, 4)
    assert 0 < len(drafts) <= 4
    assert len({d.text for d in drafts}) == len(drafts)
    probs = [d.probability for d in drafts]
    assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)
    assert all(d.tokens >= 1 or d.text in trained.prior.texts() for d in drafts)  # the prior's cost nothing
    assert anyio.run(trained.draft, history, action, 4) == drafts  # deterministic per (history, action)
    assert anyio.run(trained.draft, history, action, 0) == []


@pytest.mark.slow
def test_observation_probabilities_are_the_backend_sequence_probabilities(split) -> None:
    train, _ = split
    drafter = LMObservationDrafter(model="tiny", fit_steps=0, prior=False, **OPTIONS)
    drafter.fit(train[:2])
    history = History("task", ())
    action = Action.bash("ls")
    drafts = anyio.run(drafter.draft, history, action, 6)
    comps = drafter.backend.complete_sync(drafter.prompt(history, action), n=OPTIONS["samples"],
                                          max_new_tokens=OPTIONS["max_new_tokens"], seed=drafter.seed)
    finished = [c for c in merge_completions(comps) if c.finished]
    assert [d.text for d in drafts] == [c.text for c in finished]
    for d, c in zip(drafts, finished, strict=True):
        assert math.isclose(math.log(d.probability), c.logprob, rel_tol=1e-9)
        assert d.tokens == c.tokens


@pytest.mark.slow
def test_fit_sets_the_frequency_prior_the_drafts_are_interpolated_with(split) -> None:
    train, _ = split
    drafter = LMObservationDrafter(model="tiny", fit_steps=0, **OPTIONS)
    drafter.fit(train)
    common = Counter(s.observation for t in train for s in t.steps if s.completed).most_common(1)[0]
    assert drafter.prior.top[0][0] == common[0]
    history, action = History("task", ()), Action.bash("ls")
    drafts = anyio.run(drafter.draft, history, action, 8)
    comps = drafter.backend.complete_sync(drafter.prompt(history, action), n=OPTIONS["samples"],
                                          max_new_tokens=OPTIONS["max_new_tokens"], seed=drafter.seed)
    assert [(d.text, d.probability) for d in drafts] == [(t, p) for t, p, _ in rank_observations(comps, drafter.prior)][:8]
    assert common[0] in {d.text for d in drafts}


@pytest.mark.slow
def test_action_drafter_proposes_ranked_targets_within_width_and_depth(split) -> None:
    train, evals = split
    drafter = LMActionDrafter(model="tiny", fit_steps=20, depth=2, **OPTIONS)
    drafter.fit(train)
    drafts = anyio.run(drafter.propose, evals[0].history(3), 5, 2)
    assert len(drafts) <= 5
    assert all(d.offset in (0, 1) for d in drafts)
    assert all(0 < d.probability <= 1 for d in drafts)
    for offset in (0, 1):
        assert sum(d.probability for d in drafts if d.offset == offset) <= 1 + 1e-9
    assert anyio.run(drafter.propose, evals[0].history(3), 0, 2) == []


def test_action_chains_rank_by_sample_frequency() -> None:
    sep = ACTION_SEPARATOR
    comps = [
        Completion(f"ls{sep}cat a", -1.0, 5, True),
        Completion(f"ls{sep}cat b", -2.0, 5, True),
        Completion(f"pwd{sep}ls", -0.5, 5, True),
        Completion(f"ls{sep}cat a{sep}trunc", -3.0, 8, False),  # unfinished: last part dropped
    ]
    drafts = rank_action_chains(comps, width=10, depth=3)
    first = drafts[0]
    assert (first.action, first.offset, first.probability) == (Action.bash("ls"), 0, 0.75)
    by_key = {(d.offset, d.action.command): d.probability for d in drafts}
    assert by_key[(1, "cat a")] == 0.5 and by_key[(0, "pwd")] == 0.25 and by_key[(1, "ls")] == 0.25
    assert (2, "trunc") not in by_key
    assert len(rank_action_chains(comps, width=2, depth=1)) == 2
    assert all(d.offset == 0 for d in rank_action_chains(comps, width=10, depth=1))


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="samples"):
        LMObservationDrafter(samples=0)
    with pytest.raises(ConfigError, match="mode"):
        LMObservationDrafter(mode="nucleus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="depth"):
        LMActionDrafter(depth=0)
    drafter = LMObservationDrafter(backend="transformers", model="tiny", no_such_option=1, **OPTIONS)
    with pytest.raises(ConfigError, match="no_such_option"):
        drafter.backend  # noqa: B018
    remote = LMObservationDrafter(backend="openai", model="obs", fit_steps=5)
    with pytest.raises(ConfigError, match="transformers backend"):
        remote.fit([])
