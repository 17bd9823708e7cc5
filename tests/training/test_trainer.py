"""The DeepSpeed trainer, run as users run it (`tierserve train ...` in its own process):
exact resume after SIGKILL (pretraining, and curriculum SFT with the same batches) and atomic
checkpoints. Two processes and bf16: `test_trainer_zero_bf16.py`."""

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.training.trainer_runs import TIERSERVE, env, pretrain_args, read_log, train
from training.stages import checkpointing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(random_checkpoint: Path, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("train") / "a"
    return out, train(out, random_checkpoint)


def test_sigkill_then_resume_gives_the_same_losses(uninterrupted, random_checkpoint, tmp_path):
    log_a = uninterrupted[1]
    assert [row["step"] for row in log_a] == list(range(8))
    assert log_a[-1]["loss"] < log_a[0]["loss"]
    out = tmp_path / "b"
    proc = subprocess.Popen(
        [*TIERSERVE, *pretrain_args(out, random_checkpoint)],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not (out / "checkpoints" / "step-000003").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpointing.latest(out / "checkpoints") is not None
    log_b = train(out, random_checkpoint)
    assert [(r["step"], r["loss"], r["ce"], r["lr"]) for r in log_b] == [
        (r["step"], r["loss"], r["ce"], r["lr"]) for r in log_a
    ]
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "model" / "model.safetensors").exists()


def test_damaged_or_unfinished_checkpoints_are_never_resumed(uninterrupted, tmp_path) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted[0] / "checkpoints", root)
    newest, older = sorted(root.glob("step-*"), reverse=True)[:2]
    assert checkpointing.latest(root) == newest
    (root / ".tmp-step-000009").mkdir()  # a save killed before its rename
    assert checkpointing.latest(root) == newest
    victim = next(p for p in newest.rglob("*.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    victim.write_bytes(bytes(data))
    assert checkpointing.latest(root) == older
    (older / checkpointing.MANIFEST).unlink()
    assert checkpointing.latest(root) is None


def _sft(out: Path, init: Path, steps: int) -> list[dict]:
    """A curriculum SFT run at a constant learning rate, so a shorter run is a prefix."""
    sets = [
        "data.mix={math = 1.0, tools = 1.0}",
        "data.examples=16",
        "data.difficulties=[1, 2]",
        "data.natural=0.5",
        f"train.steps={steps}",
        "train.micro_batch=2",
        "train.seq_len=768",
        "train.save_every=2",
        "train.eval_n=1",
        "train.eval_max_tokens=4",
        "train.optim.warmup_steps=0",
        "train.optim.min_lr_ratio=1.0",
        "curriculum.enabled=true",
        "curriculum.max_first_steps=3",
        "curriculum.heldout_examples=2",
    ]
    cmd = ["train", "sft", "--out", str(out), "--init", str(init)]
    subprocess.run(
        [*TIERSERVE, *cmd, *[f"--set={s}" for s in sets]],
        env=env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return read_log(out)


def test_curriculum_sft_resumes_with_the_same_batches(random_checkpoint, tmp_path) -> None:
    straight = _sft(tmp_path / "a", random_checkpoint, 6)
    assert [row["phase"] for row in straight] == [1, 1, 1, 2, 2, 2]
    assert all(row["copy_loss"] is not None for row in straight)
    _sft(tmp_path / "b", random_checkpoint, 4)
    resumed = _sft(tmp_path / "b", random_checkpoint, 6)
    keys = ("step", "loss", "copy_loss", "phase", "mix/math", "tokens")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]
    assert "held-out copy-position loss" in (tmp_path / "a" / "eval-step-6.md").read_text()
