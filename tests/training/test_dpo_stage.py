"""The DPO stage end to end on a tiny model and the toy vowels task (whose correctness varies
between any model's samples, so pairs exist): pairs from its own samples, a training run that
widens the implicit reward margin on them, and the before/after win-rate table."""

import json
import subprocess
from pathlib import Path

import pytest

from tests import REPO
from tests.training.toy_domain import train_command

pytestmark = pytest.mark.slow


def test_dpo_trains_on_its_own_pairs_and_reports_win_rates(
    random_checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "dpo"
    sets = {
        "data.mix": "{vowels = 1.0}",
        "style": "short",
        "data.examples": "8",
        "data.difficulties": "[1]",
        "dpo.samples": "4",
        "dpo.max_tokens": "12",
        "dpo.eval_tasks": "4",
        "train.steps": "6",
        "train.micro_batch": "4",
        "train.seq_len": "1024",
        "train.save_every": "6",
        "train.optim.lr": "1e-3",
        "train.optim.warmup_steps": "0",
        "train.eval_n": "1",
        "train.eval_max_tokens": "16",
    }
    subprocess.run(train_command("dpo", random_checkpoint, out, sets), check=True, cwd=REPO)
    pairs = [json.loads(line) for line in (out / "data" / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen"] != p["rejected"] for p in pairs)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["reward_margin"] > log[0]["reward_margin"]
    table = (out / "win-rates.md").read_text()
    for objective in ("correctness", "format", "brevity", "combined"):
        assert f"| {objective} |" in table
    assert (out / "model" / "model.safetensors").exists()
