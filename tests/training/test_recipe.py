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
    stages = (
        *("pretrain", "sft-think", "sft-short", "qat-short", "rl-short", "mtp-short"),
        *("dpo", "rl", "draft"),
    )
    for stage in stages:
        run = smoke / "runs" / stage
        assert (run / "curves.png").stat().st_size > 1000
        assert len((run / "log.jsonl").read_text().splitlines()) >= 3
        assert (run / "model" / "model.safetensors").exists()
    think = smoke / "runs" / "sft-think"
    assert (think / "a" / "eval-step-3.md").read_text().startswith("| domain")
    assert "reward/" in (think / "rl-a" / "log.jsonl").read_text()  # RL between SFT phases
    assert [json.loads(line)["run"] for line in (think / "log.jsonl").read_text().splitlines()] == [
        *["a"] * 3,
        *["rl-a"] * 3,
        *["b"] * 2,
    ]
    assert not list(smoke.glob("runs/*/*/checkpoints"))  # finished phases keep no optimizer
    assert (think / "model" / "model.safetensors").read_bytes() == (
        think / "b" / "model" / "model.safetensors"
    ).read_bytes()
    summary = json.loads((smoke / "runs" / "recipe-summary.json").read_text())
    assert set(summary["sizes_mb"]) == {"full", "highspeed", "draft"}
    assert 0.0 <= summary["draft_agreement"] <= 1.0
    assert summary["full_stages"] == ["sft-think", "dpo", "rl"]
    assert summary["shipped_full"] in summary["full_stages"]
    assert summary["runs"]["sft-short/st-b"] == 2 and summary["not_published"] == {}
    shipped = smoke / "models" / "smoke-highspeed" / "model.safetensors"
    assert (
        shipped.read_bytes()
        == (smoke / "runs" / "mtp-short" / "model" / "model.safetensors").read_bytes()
    )
    out = (smoke / "stdout.txt").read_text()
    for stage in (*summary["full_stages"], "sft-short", "qat-short", "rl-short"):
        assert f"### {stage}" in out  # every post-training stage's table, by name
        assert (smoke / "runs" / f"eval-{stage}.md").read_text().startswith("| domain")
    assert (smoke / "runs" / "dpo" / "win-rates.md").read_text().startswith("| objective")
    assert "reward/" in (smoke / "runs" / "rl" / "log.jsonl").read_text()
    rl_short = json.loads((smoke / "runs" / "rl-short" / "model" / "config.json").read_text())
    assert rl_short["quantization_config"]["format"] == "nvfp4-pack-quantized"
    router = json.loads((smoke / "runs" / "router" / "summary.json").read_text())
    assert router["paired_tasks"] == 4  # one task a domain at difficulty 1, both tiers
    assert (smoke / "models" / "router.npz").read_bytes() == (
        smoke / "runs" / "router" / "router.npz"
    ).read_bytes()
    assert "sft-think/rl-a" in (smoke / "models" / "smoke-full" / "README.md").read_text()


def _fake_chain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rates: dict[str, float]
) -> tuple[Path, dict[str, str]]:
    """The smoke recipe with a 2-point regression gate, every run and evaluation faked: a
    stage's model completes `rates[stage]` of math."""
    from training.recipes import run as recipes

    strict = tmp_path / "strict"
    shutil.copytree(recipes.recipe_dir("smoke"), strict)
    toml = (strict / "recipe.toml").read_text().replace("max_drop = 100.0", "max_drop = 2.0")
    (strict / "recipe.toml").write_text(toml)
    inits: dict[str, str] = {}

    def run_stage(config, out: Path) -> Path:
        inits[out.name] = getattr(config, "init", "")
        (out / "model").mkdir(parents=True, exist_ok=True)
        (out / "log.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0, "lr": 1e-3}) + "\n")
        (out / "evals.json").write_text("[]")
        (out / "summary.json").write_text("{}")
        return out / "model"

    def evaluate(model_dir: Path, spec: object, out: Path) -> list[dict]:
        rate = rates[model_dir.parent.name]
        row = {"domain": "math", "difficulty": "all", "n": 10, "completion_rate": rate}
        return [row | {"completion_ci": (rate, rate), "mean_reward": (rate, 0.0)}
                | {"output_tokens": (9.0, 1.0), "latency_s": (0.1, 0.0)}]  # fmt: skip

    def publish(model_dir: Path, target: Path, *_: object) -> None:
        target.mkdir(parents=True)
        (target / "from").write_text(str(model_dir))

    def train_router(models: dict, domains: list, spec: object, out: Path, _: object) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        (out / "router.npz").write_bytes(b"router")
        return out / "router.npz"

    monkeypatch.setattr(recipes, "recipe_dir", lambda name: strict)
    monkeypatch.setattr(recipes, "build_tokenizer", lambda out, *_: out)
    monkeypatch.setattr(recipes, "run_stage", run_stage)
    monkeypatch.setattr(recipes, "evaluate_model", evaluate)
    monkeypatch.setattr(recipes, "draft_agreement", lambda *_: 0.5)
    monkeypatch.setattr(recipes, "publish", publish)
    monkeypatch.setattr(recipes, "train_router", train_router)
    monkeypatch.setattr(recipes, "size_mb", lambda _: 1.0)
    return tmp_path / "runs", inits


def test_the_regression_gate_keeps_only_stages_that_lose_no_domain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The RL stage's model completes fewer math tasks than DPO's, beyond the allowed drop:
    it is not kept, and the full tier ships DPO's model. The highspeed student's RL gains:
    its MTP head is trained on it."""
    from training.recipes import run as recipes

    rates = {"sft-think": 0.5, "sft-short": 0.5, "qat-short": 0.5, "rl-short": 0.6}
    rates |= {"dpo": 0.6, "rl": 0.3}
    work, inits = _fake_chain(monkeypatch, tmp_path, rates)
    recipes.run_recipe("smoke", work, tmp_path / "models")
    summary = json.loads((work / "recipe-summary.json").read_text())
    assert summary["full_stages"] == ["sft-think", "dpo"] and summary["shipped_full"] == "dpo"
    assert summary["rejected"] == {
        "rl": "against dpo: math: 30.0% vs baseline 60.0% (-30.0 points > 2.0)"
    }
    assert "### rl (not kept: against dpo: math" in summary["tables"]["full"]
    assert inits["draft"] == str(work / "dpo" / "model")  # distilled from the kept
    assert inits["rl"] == str(work / "dpo" / "model")
    assert inits["st-a"] == str(work / "sft-think" / "a" / "model")
    assert inits["rl-short"] == str(work / "qat-short" / "model")
    assert inits["mtp-short"] == str(work / "rl-short" / "model")
    assert "### rl-short (shipped)" in summary["tables"]["highspeed"]
    assert (tmp_path / "models" / "smoke-full" / "from").read_text() == str(work / "dpo" / "model")
    assert (tmp_path / "models" / "router.npz").read_bytes() == b"router"


def test_tiers_that_lose_to_the_models_they_replace_are_not_published(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from training.recipes import run as recipes
    from training.recipes.gate import GateError

    rates = {"sft-think": 0.5, "sft-short": 0.5, "qat-short": 0.5, "rl-short": 0.4}
    rates |= {"dpo": 0.5, "rl": 0.5}
    work, inits = _fake_chain(monkeypatch, tmp_path, rates | {"models": 0.9})
    shipped = tmp_path / "models" / "smoke-full"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("{}")  # the model the new full tier would replace
    (shipped / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(GateError, match=r"full: math: 50\.0% vs baseline 90\.0%"):
        recipes.run_recipe("smoke", work, tmp_path / "models")
    assert sorted(p.name for p in shipped.iterdir()) == ["config.json", "model.safetensors"]
    assert (work / "candidates" / "smoke-full" / "from").exists()
    summary = json.loads((work / "recipe-summary.json").read_text())
    assert list(summary["not_published"]) == ["full"]  # nothing was there for highspeed
    # the student's RL lost math: the highspeed tier is the QAT model, with its MTP head
    assert summary["rejected"] == {
        "rl-short": "against qat-short: math: 40.0% vs baseline 50.0% (-10.0 points > 2.0)"
    }
    assert inits["mtp-short"] == str(work / "qat-short" / "model")
    assert "### qat-short (shipped)" in summary["tables"]["highspeed"]


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
