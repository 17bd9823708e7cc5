"""Running `tierserve train` as users run it, in its own process, for the trainer tests."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import REPO

TOY = REPO / "training" / "recipes" / "smoke" / "pretrain.toml"
TIERSERVE = [sys.executable, "-c", "from serving.cli import main; main()"]


def env() -> dict[str, str]:
    # One thread per process: deterministic reductions, and two processes fit two cores.
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def pretrain_args(out: Path, tokenizer: Path, *overrides: str) -> list[str]:
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


def train(out: Path, tokenizer: Path, *overrides: str) -> list[dict]:
    subprocess.run(
        [*TIERSERVE, *pretrain_args(out, tokenizer, *overrides)],
        env=env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    return read_log(out)


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
