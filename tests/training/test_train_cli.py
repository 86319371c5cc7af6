"""`aospec train` end to end on the bundled traces with a tiny model (few steps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from aospec.replay import bundled_traces_path, load_traces  # noqa: E402

from aospec._files import new_file_mode  # noqa: E402
from aospec.cli import main  # noqa: E402

FAST = ["--steps", "4", "--batch-size", "4", "--prompt-tokens", "128", "--target-tokens", "32", "--vocab-size", "512",
        "--eval-limit", "3", "--eval-samples", "2", "--checkpoint-every", "2", "--device", "cpu"]


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", "--train-traces", str(bundled_traces_path()), *args])
    out, err = capsys.readouterr()
    return code, out, err


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_full_fine_tune_reports_json_and_writes_every_artifact(tmp_path: Path, capsys) -> None:
    out = tmp_path / "full"
    code, stdout, _ = run(capsys, "--base-model", "tiny", "--out", str(out), "--full", "--format", "json", *FAST)
    assert code == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert {"examples", "steps", "eval_tasks", "top1", "top5", "seconds"} <= set(summary)
    assert summary["steps"] == 4 and summary["evaluated"] == 3
    assert 0.0 <= summary["top1"] <= summary["top5"] <= 1.0
    tasks = {t.task for t in load_traces([bundled_traces_path()])}
    assert summary["eval_tasks"] and set(summary["eval_tasks"]) < tasks
    assert summary["examples"] == summary["train_examples"] + summary["eval_examples"]
    meta = json.loads((out / "aospec-model.json").read_text())
    assert (meta["kind"], meta["mode"], meta["weights"]) == ("observation", "full", "model")
    for name in ("model/model.safetensors", "model/config.json", "tokenizer/tokenizer.json", "metrics.json", "loss.png"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    # Every file gets the umask's mode (safetensors alone writes the weights 0600).
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {new_file_mode()}
    metrics = json.loads((out / "metrics.json").read_text())
    assert [s for s, _ in metrics["losses"]] == [1, 2, 3, 4]
    # Portable to transformers 4 (vLLM's pins): a tokenizer class both know, a top-level RoPE base.
    for d in ("tokenizer", "model"):
        assert json.loads((out / d / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    from aospec.drafters.model import load_model

    loaded = load_model(str(out))
    assert loaded.model.config.rope_parameters["rope_theta"] == config["rope_theta"]
    assert type(loaded.tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")


def test_lora_adapter_is_exported_in_peft_format_for_vllm(tmp_path: Path, capsys) -> None:
    out = tmp_path / "lora"
    code, _, _ = run(capsys, "--base-model", "tiny", "--out", str(out), "--lora", "--lora-r", "4", *FAST)
    assert code == 0
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert Path(config["base_model_name_or_path"]) == (out / "base").resolve()
    assert (out / "base" / "config.json").is_file() and (out / "base" / "tokenizer.json").is_file()
    tensors = weights(adapter / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert any(k.startswith("base_model.model.model.layers.0.self_attn.q_proj.lora_A") for k in tensors)
    base = weights(out / "base" / "model.safetensors")
    assert not any("lora" in k for k in base)

    from aospec.drafters.backends.transformers import TransformersBackend

    backend = TransformersBackend(str(out), device="cpu")  # base + adapter, merged
    prompt = backend.render([{"role": "system", "content": "t"}, {"role": "user", "content": "ls"}])
    assert backend.complete_sync(prompt, n=2, max_new_tokens=4)


def test_resumed_training_equals_uninterrupted_training(tmp_path: Path, capsys) -> None:
    straight, chunked = tmp_path / "straight", tmp_path / "chunked"
    assert run(capsys, "--base-model", "tiny", "--out", str(straight), "--full", *FAST)[0] == 0
    code, _, _ = run(capsys, "--base-model", "tiny", "--out", str(chunked), "--full", "--stop-after", "2", *FAST)
    assert code == 0
    assert not (chunked / "model").exists()  # not finished: no export yet
    (chunked / "checkpoints" / "step-000003.tmp").mkdir()  # a save interrupted by a crash is ignored
    code, stdout, _ = run(capsys, "--base-model", "tiny", "--out", str(chunked), "--full", "--resume",
                          "--format", "json", *FAST)
    assert code == 0
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["resumed_from"] == 2 and summary["steps"] == 4
    a = weights(straight / "model" / "model.safetensors")
    b = weights(chunked / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    la = json.loads((straight / "metrics.json").read_text())["losses"]
    lb = json.loads((chunked / "metrics.json").read_text())["losses"]
    assert [s for s, _ in lb] == [1, 2, 3, 4]
    assert [v for _, v in lb] == pytest.approx([v for _, v in la], abs=1e-5)


def test_mistakes_give_one_line_errors(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "--out", str(tmp_path / "none"), "--resume", *FAST)
    assert code == 2 and "no checkpoint" in err and len(err.strip().splitlines()) == 1
    done = tmp_path / "done"
    assert run(capsys, "--out", str(done), *FAST)[0] == 0
    code, _, err = run(capsys, "--out", str(done), *FAST)
    assert code == 2 and "already holds a trained model" in err
    code = main(["train", "--train-traces", str(tmp_path / "missing"), "--out", str(tmp_path / "x"), *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "missing" in err
    code, _, err = run(capsys, "--out", str(tmp_path / "y"), "--eval-tasks", "no-such-task", *FAST)
    assert code == 2 and "no-such-task" in err


def test_a_base_model_that_does_not_exist_is_one_error_and_writes_nothing(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    missing = tmp_path / "no-such-model"
    code, _, err = run(capsys, "--base-model", str(missing), "--out", str(out), *FAST)
    assert code == 2
    assert err.strip().splitlines() == [
        f"aospec: error: model '{missing}' is neither a shape (tiny, small, qwen3-0.6b), a named model (smollm2), "
        "a .gguf file nor a local model directory"
    ]
    assert not out.exists()


def test_a_train_that_fails_before_its_first_checkpoint_removes_the_directory_it_made(tmp_path: Path, capsys) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = tmp_path / "out"
    code, _, err = run(capsys, "--base-model", str(broken), "--out", str(out), *FAST)
    assert code == 2 and f"cannot load a causal LM from {broken}" in err
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    code, _, _ = run(capsys, "--base-model", str(broken), "--out", str(kept), *FAST)
    assert code == 2 and kept.is_dir()  # not made by this run: left alone
