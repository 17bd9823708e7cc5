"""The DeepSpeed trainer, run as users run it (`tierserve train ...` in its own process):
exact resume after SIGKILL, two processes matching one, ZeRO and bf16, atomic checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import REPO
from training import checkpointing

pytestmark = pytest.mark.slow

TOY = REPO / "training" / "recipes" / "smoke" / "pretrain.toml"
TIERSERVE = [sys.executable, "-c", "from serving.cli import main; main()"]


def _env() -> dict[str, str]:
    # One thread per process: deterministic reductions, and two processes fit two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _args(out: Path, tokenizer: Path, *overrides: str) -> list[str]:
    # A learning rate at which 8 steps of the toy visibly lower the loss (at the config's
    # warmup the loss only wanders, and which way depends on the data).
    toy = ("data.examples=30", "train.steps=8", "train.optim.lr=1e-2", "train.optim.warmup_steps=0")
    sets = [f"--set={o}" for o in (*toy, *overrides)]
    return [
        "train",
        "pretrain",
        "--config",
        str(TOY),
        "--out",
        str(out),
        "--tokenizer",
        str(tokenizer),
        *sets,
    ]


def _train(out: Path, tokenizer: Path, *overrides: str) -> list[dict]:
    subprocess.run(
        [*TIERSERVE, *_args(out, tokenizer, *overrides)],
        env=_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return _log(out)


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(random_checkpoint: Path, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("train") / "a"
    return out, _train(out, random_checkpoint)


def test_sigkill_then_resume_gives_the_same_losses(uninterrupted, random_checkpoint, tmp_path):
    log_a = uninterrupted[1]
    assert [row["step"] for row in log_a] == list(range(8))
    assert log_a[-1]["loss"] < log_a[0]["loss"]
    out = tmp_path / "b"
    proc = subprocess.Popen(
        [*TIERSERVE, *_args(out, random_checkpoint)],
        env=_env(),
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
    log_b = _train(out, random_checkpoint)
    assert [(r["step"], r["loss"], r["ce"], r["lr"]) for r in log_b] == [
        (r["step"], r["loss"], r["ce"], r["lr"]) for r in log_a
    ]
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "model" / "model.safetensors").exists()


def test_two_processes_with_zero2_match_one_process(random_checkpoint, tmp_path) -> None:
    single = _train(tmp_path / "one", random_checkpoint, "train.grad_accum=2")
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        "--no-python",
        *TIERSERVE,
    ]
    cmd = [*launcher, *_args(tmp_path / "two", random_checkpoint, "train.zero_stage=2")]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=300)
    double = _log(tmp_path / "two")
    assert len(double) == len(single) == 8
    for a, b in zip(single, double, strict=True):
        assert b["tokens"] == a["tokens"]  # the same global batch
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


def test_bf16_trains(random_checkpoint, tmp_path) -> None:
    log = _train(tmp_path / "bf16", random_checkpoint, 'train.dtype="bf16"', "train.zero_stage=1")
    assert all(row["loss"] == row["loss"] for row in log)  # no NaN
    assert log[-1]["loss"] < log[0]["loss"]
    config = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


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
        env=_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return _log(out)


def test_curriculum_sft_resumes_with_the_same_batches(random_checkpoint, tmp_path) -> None:
    straight = _sft(tmp_path / "a", random_checkpoint, 6)
    assert [row["phase"] for row in straight] == [1, 1, 1, 2, 2, 2]
    assert all(row["copy_loss"] is not None for row in straight)
    _sft(tmp_path / "b", random_checkpoint, 4)
    resumed = _sft(tmp_path / "b", random_checkpoint, 6)
    keys = ("step", "loss", "copy_loss", "phase", "mix/math", "tokens")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]
    assert "held-out copy-position loss" in (tmp_path / "a" / "eval-step-6.md").read_text()
