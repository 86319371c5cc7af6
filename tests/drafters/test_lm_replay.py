"""Replay and sweep with the LM observation drafter (tiny model, CPU) and the embedding
kernel, through the replay package's public API: every replay invariant is checked by the
sweep itself (committed trajectory = recorded, no policy beats its ceiling)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from aospec.replay import bundled_traces_path, load_traces
from aospec.replay.policies import parse_policies
from aospec.replay.sweep import run_sweep

LM = {"model": "tiny", "device": "cpu", "prompt_tokens": 160, "max_new_tokens": 48, "samples": 6,
      "fit_steps": 30, "fit_batch_size": 6, "vocab_size": 768}


@pytest.fixture(scope="module")
def split():
    traces = load_traces([bundled_traces_path()])
    evals = [t for t in traces if t.task == "openssl-selfsigned-cert"]
    train = [t for t in traces if t.task != "openssl-selfsigned-cert"]
    assert evals and train
    return train, evals


@pytest.mark.slow
def test_sweep_with_lm_drafter_rankings_and_kernels(split) -> None:
    train, evals = split
    specs = [
        "serial",
        "aospec:obs_drafter=lm",
        "aospec:obs_drafter=lm:rank=likelihood",
        "aospec:obs_drafter=lm:rank=tooltime",
        "aospec:obs_drafter=lm:kernel=embedding",
    ]
    options = {"lm": LM, "embedding": {"encoder": "minilm"}}
    results = run_sweep(evals, parse_policies(specs), train_traces=train, tpots_ms=[10.0], drafter_options=options)
    assert len(results) == len(specs) * len(evals)
    by_policy = {spec: [r for r in results if r.policy == spec] for spec in specs}
    serial = by_policy["serial"][0]
    assert serial.latency_ns == serial.serial_ns and serial.drafts_started == 0
    for spec in specs[1:]:
        for r in by_policy[spec]:
            assert r.steps == serial.steps
            assert r.drafts_started > 0, spec  # the LM drafter's candidates reached the engine
            assert r.latency_ns <= r.serial_ns * 1.05, spec

