"""The DeepSpeed trainer across two processes (ZeRO-2 matching one process) and in bf16, run
as users run it (`tierserve train ...` in its own process)."""

import json
import subprocess
import sys

import pytest

from tests.training.trainer_runs import TIERSERVE, env, pretrain_args, read_log, train

pytestmark = pytest.mark.slow


def test_two_processes_with_zero2_match_one_process(random_checkpoint, tmp_path) -> None:
    single = train(tmp_path / "one", random_checkpoint, "train.grad_accum=2")
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        "--no-python",
        *TIERSERVE,
    ]
    cmd = [*launcher, *pretrain_args(tmp_path / "two", random_checkpoint, "train.zero_stage=2")]
    subprocess.run(cmd, env=env(), check=True, capture_output=True, timeout=300)
    double = read_log(tmp_path / "two")
    assert len(double) == len(single) == 8
    for a, b in zip(single, double, strict=True):
        assert b["tokens"] == a["tokens"]  # the same global batch
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


def test_bf16_trains(random_checkpoint, tmp_path) -> None:
    log = train(tmp_path / "bf16", random_checkpoint, 'train.dtype="bf16"', "train.zero_stage=1")
    assert all(row["loss"] == row["loss"] for row in log)  # no NaN
    assert log[-1]["loss"] < log[0]["loss"]
    config = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
