"""Reward models: the layout transformers loads as `Qwen3MoeForSequenceClassification` with
the same rewards, the judges' objectives, and the stage end to end on a tiny model: pairs from
its own answers, heads whose training accuracy rises, and the held-out accuracy table."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from serving.model.checkpoint import load_checkpoint
from tasks import DOMAINS
from tasks.math import chain_coverage
from tests import REPO
from tests.training.toy_domain import train_command
from training.objectives.reward_model import (
    RewardModel,
    bradley_terry_losses,
    load_reward_model,
    merged_reward,
    save_reward_model,
)
from training.stages.reward_model import judged_weights


def test_transformers_reads_our_reward_model_and_agrees(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = RewardModel(load_checkpoint(random_checkpoint), ["correctness", "chain"]).eval()
    save_reward_model(model, tmp_path / "rm", random_checkpoint)
    ids = torch.randint(3, 200, (3, 11))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 7:], mask[2, 4:] = False, False
    ids = ids.masked_fill(~mask, model.model.config.pad_token_id or 0)
    ours = model(ids, mask)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "rm", dtype=torch.float32
    )
    assert theirs.config.id2label == {0: "correctness", 1: "chain"}
    with torch.no_grad():
        logits = theirs(input_ids=ids, attention_mask=mask.long()).logits
    assert torch.allclose(ours.detach(), logits, atol=1e-4), (ours, logits)
    again = load_reward_model(tmp_path / "rm")
    assert again.objectives == ["correctness", "chain"]
    assert torch.allclose(again(ids, mask), ours.detach(), atol=1e-6)


def test_bradley_terry_and_the_merged_reward() -> None:
    losses = bradley_terry_losses(torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0]))
    assert losses[0] < 0.2 < 2.0 < losses[1]
    rewards = torch.tensor([[1.0, 2.0, 5.0]])
    assert merged_reward(rewards, ["a", "b", "c"], {"a": 1.0, "b": 0.5}).item() == 2.0
    # An answer's merged reward weighs its own domain's objectives alone.
    weights = {"correctness": 1.0, "chain": 0.3, "maintainability": 0.3, "steps": 0.3}
    assert judged_weights("math", weights) == {"correctness": 1.0, "chain": 0.3}
    assert judged_weights("tools", weights) == {"correctness": 1.0}


def test_a_math_chain_counts_the_worked_steps_in_order() -> None:
    task = DOMAINS["math"].generate(5, 2)
    reference = DOMAINS["math"].reference(task, "short")[0]
    assert chain_coverage(task, reference) == 1.0
    assert chain_coverage(task, str(task.data["answer"])) == 0.0  # the answer alone: no chain
    steps = [line for line in reference.splitlines() if " = " in line and line[0].isdigit()]
    assert len(steps) == 2
    assert chain_coverage(task, steps[0]) == 0.5
    assert chain_coverage(task, steps[1] + "\n" + steps[0]) == 0.5  # out of order: one counts


@pytest.mark.slow
def test_the_stage_learns_its_pairs_and_reports_held_out_accuracy(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rm"
    sets = {
        "data.mix": "{vowels = 1.0}",
        "data.examples": "8",
        "data.difficulties": "[1]",
        "reward_model.samples": "4",
        "reward_model.max_tokens": "12",
        "reward_model.eval_tasks": "4",
        "train.steps": "8",
        "train.micro_batch": "4",
        "train.seq_len": "1024",
        "train.save_every": "8",
        "train.optim.lr": "1e-3",
        "train.optim.warmup_steps": "0",
    }
    subprocess.run(
        train_command("reward-model", random_checkpoint, out, sets), check=True, cwd=REPO
    )
    pairs = [json.loads(line) for line in (out / "data" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen"] != p["rejected"] for p in pairs)
    assert {p["objective"] for p in pairs} == {"correctness"}  # the toy domain's only judge
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert sum(r["margin"] for r in log[-3:]) > sum(r["margin"] for r in log[:3])
    table = (out / "accuracy.md").read_text()
    assert "| correctness | all |" in table and "| merged | all |" in table
    model = load_reward_model(out / "model")
    assert model.objectives == ["correctness", "chain", "maintainability", "steps"]
