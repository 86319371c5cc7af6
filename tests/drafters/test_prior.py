"""The frequency prior the LM drafters interpolate with (no model needed)."""

from __future__ import annotations

import math

import pytest
from aospec.drafters.backends import Completion
from aospec.drafters.lm import rank_action_chains, rank_observations
from aospec.drafters.prior import FrequencyPrior, interpolate
from aospec.drafters.prompts import ACTION_SEPARATOR

from aospec.errors import ConfigError
from aospec.types import Action

EMPTY = "<returncode>0</returncode>\n<output>\n</output>"


def test_prior_keeps_the_most_frequent_targets_with_their_shares() -> None:
    prior = FrequencyPrior.of(["a", "b", "a", "c", "a", "b", "d"], size=3)
    assert prior.top == (("a", 3 / 7), ("b", 2 / 7), ("c", 1 / 7))  # ties: first seen first
    assert prior.examples == 7 and prior.texts(2) == ["a", "b"]
    assert FrequencyPrior.from_json(prior.to_json()) == prior
    assert FrequencyPrior.of([]) == FrequencyPrior()


@pytest.mark.parametrize("bad", [{"top": [["a", 2.0]]}, {"top": "x"}, {"top": [], "examples": -1}, {"top": [[1]]}])
def test_a_malformed_saved_prior_is_a_config_error(bad: dict) -> None:
    with pytest.raises(ConfigError, match="frequency prior"):
        FrequencyPrior.from_json(bad)


def test_a_sure_model_keeps_most_of_the_weight_and_the_prior_fills_the_rest() -> None:
    prior = FrequencyPrior((("a", 0.5), ("b", 0.3), ("c", 0.2)), 10)
    # Eight samples of one text: lambda = 8 / 9.
    ranked = interpolate([("x", 0.9)], prior.top, finished_samples=8)
    assert [t for t, _ in ranked] == ["x", "a", "b", "c"]
    probs = dict(ranked)
    assert math.isclose(probs["x"], 8 / 9 * 0.9) and math.isclose(probs["a"], 1 / 9 * 0.5)
    assert sum(probs.values()) <= 1.0


def test_a_model_that_samples_many_texts_keeps_half_and_duplicates_merge() -> None:
    prior = FrequencyPrior((("a", 0.6), ("x", 0.2)), 10)
    ranked = interpolate([("x", 0.1), ("y", 0.05), ("x", 0.3)], prior.top, finished_samples=2)
    assert len({t for t, _ in ranked}) == len(ranked) == 3
    probs = dict(ranked)
    assert math.isclose(probs["x"], 0.5 * 0.1 + 0.5 * 0.2)  # the first probability of a text counts
    assert math.isclose(probs["a"], 0.3) and ranked[0][0] == "a"


def test_without_finished_samples_the_prior_decides_and_without_a_prior_the_model() -> None:
    prior = FrequencyPrior((("a", 0.6), ("b", 0.4)), 5)
    assert interpolate([], prior.top, finished_samples=0) == [("a", 0.6), ("b", 0.4)]
    assert interpolate([("x", 0.2), ("y", 0.1)], (), finished_samples=3) == [("x", 0.2), ("y", 0.1)]


def test_observation_candidates_are_distinct_and_never_fewer_than_the_priors() -> None:
    # A small model's typical answer: the same text eight times (one distinct candidate).
    comps = [Completion(EMPTY, math.log(0.7), 12, True) for _ in range(8)]
    prior = FrequencyPrior.of([EMPTY] * 5 + ["<returncode>1</returncode>\n<output>\n</output>"] * 2 + ["ok"])
    ranked = rank_observations(comps, prior)
    texts = [t for t, _, _ in ranked]
    assert texts[0] == EMPTY and len(set(texts)) == len(texts) == 3
    assert set(prior.texts(5)) <= set(texts[:5])
    assert [tokens for _, _, tokens in ranked] == [12, 0, 0]  # the prior's texts cost no generation
    assert [t for t, _, _ in rank_observations(comps, FrequencyPrior())] == [EMPTY]
    unfinished = [Completion("cut", -1.0, 64, False)]
    assert [t for t, _, _ in rank_observations(unfinished, prior)] == prior.texts()


def test_action_chains_merge_the_prior_at_offset_zero_only() -> None:
    sep = ACTION_SEPARATOR
    comps = [Completion(f"ls{sep}cat a", -1.0, 5, True)] * 4
    prior = FrequencyPrior.of(["ls -la"] * 3 + ["ls"] * 2 + ["@submit {}"])
    drafts = rank_action_chains(comps, width=10, depth=2, prior=prior)
    by_key = {(d.offset, d.action): d.probability for d in drafts}
    lam = 4 / 5
    assert math.isclose(by_key[(0, Action.bash("ls"))], lam * 1.0 + (1 - lam) * 2 / 6)
    assert math.isclose(by_key[(0, Action.bash("ls -la"))], (1 - lam) * 3 / 6)
    assert math.isclose(by_key[(0, Action("submit", {}))], (1 - lam) * 1 / 6)
    assert by_key[(1, Action.bash("cat a"))] == 1.0
    assert sum(p for (d, _), p in by_key.items() if d == 0) <= 1 + 1e-9
    assert rank_action_chains(comps, width=10, depth=2) == rank_action_chains(comps, 10, 2, FrequencyPrior())


def test_calibration_maps_probabilities_to_monotone_held_out_hit_rates() -> None:
    from aospec.drafters.lm import Calibration, fit_calibration

    # over-confident drafts: those at 0.9 are right half the time, those at 0.1 never
    pairs = [(0.9, i % 2 == 0) for i in range(20)] + [(0.1, False)] * 20 + [(0.5, i % 4 == 0) for i in range(20)]
    cal = fit_calibration(pairs, bins=3)
    assert cal(0.1) == 0.0 and cal(0.5) == 0.25 and cal(0.9) == 0.5 and cal(1.0) == 0.5
    rates = [rate for _, rate, _ in cal.bins]
    assert rates == sorted(rates) and sum(n for _, _, n in cal.bins) == len(pairs)
    # a rate that would fall is pooled with its neighbour: the map never reverses an order
    dip = [(0.2, True)] * 10 + [(0.6, False)] * 10 + [(0.8, True)] * 10
    pooled = fit_calibration(dip, bins=3)
    assert [r for _, r, _ in pooled.bins] == sorted(r for _, r, _ in pooled.bins)
    assert Calibration.from_json(cal.to_json()) == cal
    assert fit_calibration([(0.5, True)]) == Calibration() and Calibration()(0.37) == 0.37  # too few: identity
    with pytest.raises(ConfigError):
        Calibration.from_json({"bins": [[0.5, 1.5, 3]]})
