"""`tierserve train recipe smoke`: the whole chain at toy size, checked from the outside:
transformers loads every model it writes with our logits, renders our chat template as our
server does with the trained tokenizer, and every stage leaves its curves and tables."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from serving.model.checkpoint import load_checkpoint, save_checkpoint
from serving.model.tokenizer import Tokenizer
from training.config import DataConfig
from training.data.datasets import chat_examples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-c",
        "from serving.cli import main; main()",
        "train",
        "recipe",
        "smoke",
        "--work",
        str(root / "runs"),
        "--models",
        str(root / "models"),
    ]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900)
    (root / "stdout.txt").write_text(done.stdout)
    return root


def test_every_stage_leaves_a_model_curves_and_logs(smoke: Path) -> None:
    stages = ("pretrain", "sft-think", "sft-short", "qat-short", "mtp-short", "dpo", "rl", "draft")
    for stage in stages:
        run = smoke / "runs" / stage
        assert (run / "curves.png").stat().st_size > 1000
        assert len((run / "log.jsonl").read_text().splitlines()) >= 3
        assert (run / "model" / "model.safetensors").exists()
    assert (smoke / "runs" / "sft-think" / "eval-step-3.md").read_text().startswith("| domain")
    summary = json.loads((smoke / "runs" / "recipe-summary.json").read_text())
    assert set(summary["sizes_mb"]) == {"full", "highspeed", "draft"}
    assert 0.0 <= summary["draft_agreement"] <= 1.0
    assert summary["full_stages"] == ["sft-think", "dpo", "rl"]
    assert summary["shipped_full"] in summary["full_stages"]
    shipped = smoke / "models" / "smoke-highspeed" / "model.safetensors"
    assert (
        shipped.read_bytes()
        == (smoke / "runs" / "mtp-short" / "model" / "model.safetensors").read_bytes()
    )
    out = (smoke / "stdout.txt").read_text()
    for stage in (*summary["full_stages"], "sft-short", "qat-short"):
        assert f"### {stage}" in out  # every post-training stage's table, by name
    assert (smoke / "runs" / "dpo" / "win-rates.md").read_text().startswith("| objective")
    assert "reward/" in (smoke / "runs" / "rl" / "log.jsonl").read_text()


def test_the_regression_gate_keeps_only_stages_that_lose_no_domain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The RL stage's model completes fewer math tasks than DPO's, beyond the allowed drop:
    it is not kept, and the full tier ships DPO's model."""
    from training.recipes import run as recipes

    rates = {"sft-think": 0.5, "sft-short": 0.5, "qat-short": 0.5, "dpo": 0.6, "rl": 0.3}
    strict = tmp_path / "strict"
    shutil.copytree(recipes.recipe_dir("smoke"), strict)
    toml = (strict / "recipe.toml").read_text().replace("max_drop = 100.0", "max_drop = 2.0")
    (strict / "recipe.toml").write_text(toml)
    inits: dict[str, str] = {}

    def run_stage(config, out: Path) -> Path:
        inits[out.name] = getattr(config, "init", "")
        (out / "model").mkdir(parents=True, exist_ok=True)
        return out / "model"

    def evaluate(model_dir: Path, recipe: object, out: Path) -> list[dict]:
        rate = rates[model_dir.parent.name]
        row = {"domain": "math", "difficulty": "all", "n": 10, "completion_rate": rate}
        return [row | {"completion_ci": (rate, rate), "mean_reward": (rate, 0.0)}
                | {"output_tokens": (9.0, 1.0), "latency_s": (0.1, 0.0)}]  # fmt: skip

    monkeypatch.setattr(recipes, "recipe_dir", lambda name: strict)
    monkeypatch.setattr(recipes, "build_tokenizer", lambda out, *_: out)
    monkeypatch.setattr(recipes, "run_stage", run_stage)
    monkeypatch.setattr(recipes, "evaluate_model", evaluate)
    monkeypatch.setattr(recipes, "draft_agreement", lambda *_: 0.5)
    monkeypatch.setattr(recipes, "recommend_sampling", lambda *_: None)
    monkeypatch.setattr(recipes, "write_card", lambda *_: None)
    monkeypatch.setattr(recipes, "_size_mb", lambda _: 1.0)
    recipes.run_recipe("smoke", tmp_path / "runs", tmp_path / "models")
    summary = json.loads((tmp_path / "runs" / "recipe-summary.json").read_text())
    assert summary["full_stages"] == ["sft-think", "dpo"] and summary["shipped_full"] == "dpo"
    assert summary["rejected"] == {
        "rl": "against dpo: math: 30.0% vs baseline 60.0% (-30.0 points > 2.0)"
    }
    assert "### rl (not kept: against dpo: math" in summary["tables"]["full"]
    assert inits["draft"] == str(tmp_path / "runs" / "dpo" / "model")  # distilled from the kept


@pytest.mark.parametrize("tier", ["full", "highspeed", "draft"])
def test_shipped_models_load_in_transformers_with_our_logits(
    smoke: Path, tier: str, tmp_path: Path
) -> None:
    path = smoke / "models" / f"smoke-{tier}"
    card = (path / "README.md").read_text()
    assert "tierserve train recipe smoke" in card and "MB" in card
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    expected_arch = "Qwen3ForCausalLM" if tier == "draft" else "Qwen3MoeForCausalLM"
    assert config["architectures"] == [expected_arch]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation | {"temperature": 0.0, "top_p": 0.95, "top_k": 20} == generation
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    ours = load_checkpoint(path)
    hidden = ours(ids, torch.arange(ids.shape[1])[None])
    if tier == "highspeed":  # the QAT export: NVFP4 experts, which transformers 5 cannot
        # place in its fused experts; it reads the values those bytes hold instead
        assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
        save_checkpoint(load_checkpoint(path, keep_fp4=False), tmp_path / "dequantized", path)
        path = tmp_path / "dequantized"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            ours.compute_logits(hidden), ref(ids).logits.float(), atol=1e-4, rtol=1e-4
        )


def test_trained_tokenizer_renders_chats_as_transformers_does(smoke: Path) -> None:
    path = smoke / "models" / "smoke-full"
    ours = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    special = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    for token in special:
        assert len(ours.encode(token)) == 1
    for style in ("think", "short"):
        for example in chat_examples(DataConfig(examples=12), style):
            for messages, turn in example["turns"]:
                kwargs = {"tools": example.get("tools"), "add_generation_prompt": True}
                text = ours.apply_chat_template(messages, **kwargs)
                assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
                ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
                assert ours.encode(text) == ids
                assert ours.decode(ours.encode(turn)) == turn
