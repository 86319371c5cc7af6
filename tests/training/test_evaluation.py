"""`aospec train`'s top-k evaluation: distinct candidates, interpolated with the frequency
prior it reports, so never below that prior; the prior travels with the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from aospec.drafters.backends import Completion
from aospec.drafters.lm import LMObservationDrafter
from aospec.drafters.prior import FrequencyPrior
from aospec.drafters.prompts import ACTION_SEPARATOR
from aospec.replay import bundled_traces_path
from aospec.training.dataset import Example
from aospec.training.trainer import _first_actions, frequency_baseline, frequency_prior

from aospec.cli import main

FAST = ["--steps", "4", "--batch-size", "4", "--prompt-tokens", "128", "--target-tokens", "32", "--vocab-size", "512",
        "--eval-limit", "6", "--eval-samples", "4", "--checkpoint-every", "4", "--device", "cpu"]


def example(target: str) -> Example:
    return Example("t", "t.1", 0, (), target, None)


def test_baseline_and_prior_agree_on_the_most_frequent_targets() -> None:
    train = [example(t) for t in ["a", "b", "a", "c", "a", "b", "d", "e", "f"]]
    prior = frequency_prior(train)
    assert prior.texts(5) == ["a", "b", "c", "d", "e"]
    evals = [example(t) for t in ["a", "b", "f", "z"]]
    assert frequency_baseline(train, evals) == (1 / 4, 2 / 4)
    sep = ACTION_SEPARATOR
    actions = [example(f"ls{sep}cat x"), example(f"ls{sep}pwd"), example("pwd")]
    assert frequency_prior(actions, kind="action").top == (("ls", 2 / 3), ("pwd", 1 / 3))


def test_first_actions_are_distinct_ranked_by_samples_then_merged_with_the_prior() -> None:
    sep = ACTION_SEPARATOR
    comps = [
        Completion(f"pwd{sep}ls", -3.0, 4, True),
        Completion(f"ls{sep}cat a", -1.0, 4, True),
        Completion(f"ls{sep}cat b", -2.0, 4, True),
        Completion("cut off", -0.1, 32, False),  # unfinished, no separator: no first action
    ]
    assert _first_actions(comps, FrequencyPrior()) == ["ls", "pwd"]
    prior = FrequencyPrior((("git status", 0.9),), 10)
    # 3 usable samples, 2 distinct: lambda = 3/5. "git status" 0.4 * 0.9 = 0.36 > "ls" 0.6 * 2/4 = 0.3.
    assert _first_actions(comps, prior) == ["git status", "ls", "pwd"]


def test_train_reports_and_saves_the_prior_and_never_scores_below_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    code = main(["train", "--train-traces", str(bundled_traces_path()), "--base-model", "tiny", "--out", str(out),
                 "--full", "--format", "json", *FAST])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Four steps teach a model little: its candidates come from the prior, which it matches.
    assert summary["top1"] >= summary["baseline_top1"] and summary["top5"] >= summary["baseline_top5"]
    assert summary["top5"] >= summary["model_top5"] and summary["top1"] <= summary["top5"]
    meta = json.loads((out / "aospec-model.json").read_text())
    saved = FrequencyPrior.from_json(meta["prior"])
    assert saved.examples == summary["train_examples"] and saved.top
    assert LMObservationDrafter(model=str(out), device="cpu").prior == saved
    assert LMObservationDrafter(model=str(out), device="cpu", prior=False).use_prior is False


def test_top_k_and_call_length_buckets_score_ranked_candidates() -> None:
    from aospec.training.trainer import bucket_of, top_k

    examples = [Example("t", "t.1", i, (), target, tool) for i, (target, tool) in
                enumerate([("a", 0.2), ("b", 3.0), ("c", 30.0), ("d", None)])]
    ranked = [[("a", 0.9)], [("x", 0.5), ("b", 0.4)], [], [("x", 0.2), ("y", 0.1), ("z", 0.1), ("w", 0.1), ("v", 0.1),
                                                          ("d", 0.1)]]
    assert top_k(ranked, examples) == (1 / 4, 2 / 4)  # "d" is sixth: not in the top five
    assert [bucket_of(e) for e in examples] == ["< 1 s", "1-10 s", ">= 10 s", "unknown"]
    assert top_k([], []) == (None, None)
