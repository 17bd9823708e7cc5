"""The RL stage end to end on a toy verifiable task: the reward rises, per-domain curves are
logged, a run killed with SIGKILL resumes to exactly the curves of an uninterrupted one
(same rollouts, rewards, losses and gradient norms), the MTP head the objective does not
train leaves as it came, a reward model's rewards join the verdicts, and under `[qat]` the
policy samples through the FP4 weights it trains through and ships."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from serving.model.checkpoint import load_checkpoint
from tests import REPO
from tests.training.toy_domain import train_command
from training.objectives.reward_model import RewardModel, save_reward_model
from training.stages.init_checkpoint import DEFAULT_SHAPE, init_checkpoint

pytestmark = pytest.mark.slow


def rl_command(init: Path, out: Path, steps: int) -> list[str]:
    sets = {
        "data.mix": "{vowels = 1.0}",
        "train.steps": str(steps),
        "train.micro_batch": "8",
        "train.seq_len": "256",
        "train.save_every": "3",
        "train.optim.lr": "2e-2",
        "train.optim.min_lr_ratio": "1.0",
        "train.optim.warmup_steps": "0",
        "train.eval_every": "0",
        "train.eval_n": "1",
        "train.eval_max_tokens": "16",
        "rl.tasks_per_step": "4",
        "rl.group_size": "8",
        "rl.max_tokens": "12",
        "rl.max_turns": "1",
    }
    return train_command("rl", init, out, sets)


def curves(out: Path) -> list[dict[str, float]]:
    """Every logged figure of every step but the wall-clock rate."""
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in rows]


def test_reward_rises_and_per_domain_curves_are_logged(random_checkpoint: Path, tmp_path: Path):
    out = tmp_path / "rl"
    subprocess.run(rl_command(random_checkpoint, out, 14), check=True, cwd=REPO)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    rewards = [row["reward/vowels"] for row in log]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, rewards
    diagnostics = ("clip_frac", "ratio_mean", "ratio_std", "kl", "adv_std", "zero_variance_groups")
    for key in ("success/vowels", "length/vowels", "entropy/vowels", "weight/vowels", *diagnostics):
        assert key in log[-1]
    # The rollout engine and the trainer agree on the policy that sampled: the importance
    # ratio is 1 up to their numerics at every step (the optimizer steps after the rollouts).
    assert max(row["ratio_max_dev"] for row in log) < 1e-3, [row["ratio_max_dev"] for row in log]
    assert log[0]["kl"] < 1e-6 < log[-1]["kl"]  # the policy starts at `init`, then moves
    assert (out / "model" / "model.safetensors").exists() and (out / "curves.png").exists()


def test_resume_after_sigkill_repeats_the_losses(random_checkpoint: Path, tmp_path: Path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(rl_command(random_checkpoint, whole, 6), check=True, cwd=REPO)
    proc = subprocess.Popen(rl_command(random_checkpoint, cut, 6), cwd=REPO)
    deadline = time.monotonic() + 300
    while not list((cut / "checkpoints").glob("step-000002")) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cut / "model").exists(), "killed before the end"
    subprocess.run(rl_command(random_checkpoint, cut, 6), check=True, cwd=REPO)
    assert curves(cut) == curves(whole)  # losses, grad norms, rewards, domain weights


def test_the_mtp_head_leaves_as_it_came(tmp_path: Path) -> None:
    init = init_checkpoint(
        tmp_path / "tiny-mtp", DEFAULT_SHAPE | {"tierserve_mtp": {"num_layers": 1}}
    )
    out = tmp_path / "rl"
    subprocess.run(rl_command(init, out, 3), check=True, cwd=REPO)
    start, end = load_checkpoint(init).state_dict(), load_checkpoint(out / "model").state_dict()

    def exported_unchanged(key: str) -> bool:  # the export is bf16
        return torch.equal(start[key].to(torch.bfloat16).float(), end[key])

    mtp = [k for k in start if k.startswith("mtp.")]
    assert mtp and all(exported_unchanged(k) for k in mtp), [
        k for k in mtp if not exported_unchanged(k)
    ]
    assert not all(exported_unchanged(k) for k in start if k.startswith("layers."))


def test_rl_through_fp4_weights_samples_them_and_exports_them(
    random_checkpoint: Path, tmp_path: Path
):
    out = tmp_path / "rl"
    command = [*rl_command(random_checkpoint, out, 3), "--set", 'qat.format="nvfp4"']
    subprocess.run(command, check=True, cwd=REPO)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    # Rollouts from the latent weights would disagree with the trainer's FP4-rounded forward.
    assert max(row["ratio_max_dev"] for row in log) < 1e-3, [row["ratio_max_dev"] for row in log]
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert not (out / "model-latent").exists()
    start = load_checkpoint(random_checkpoint)
    end = load_checkpoint(out / "model", keep_fp4=False)
    pairs = zip(start.parameters(), end.parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)  # the policy moved


def test_a_reward_model_joins_the_verdicts(random_checkpoint: Path, tmp_path: Path):
    torch.manual_seed(0)
    rm = RewardModel(load_checkpoint(random_checkpoint), ["correctness", "chain"])
    save_reward_model(rm, tmp_path / "rm", random_checkpoint)
    out = tmp_path / "rl"
    command = rl_command(random_checkpoint, out, 2)
    command += ["--set", f"rl.reward_model={json.dumps(str(tmp_path / 'rm'))}"]
    subprocess.run(command, check=True, cwd=REPO)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    # The toy domain is judged on correctness alone: its merged reward is that head's.
    assert all(abs(row["learned/vowels"]) > 0 for row in log), log
