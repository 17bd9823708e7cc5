"""A stage of phases cut at any point resumes to exactly the run that was never cut: the cut
phase from its last checkpoint, the finished ones skipped (their checkpoints already gone),
the whole chain's log and the last model byte for byte the uncut run's."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training.trainer_runs import env

pytestmark = pytest.mark.slow

# Two SFT phases from a random checkpoint, at a constant learning rate each; the second draws
# other tasks at another rate, as a curriculum's continuation does.
STAGE = """stage = "sft"
[data]
mix = { math = 1.0, tools = 1.0 }
examples = 16
difficulties = [1, 2]
[train]
steps = 4
micro_batch = 2
seq_len = 768
save_every = 2
eval_n = 1
eval_max_tokens = 4
optim = { warmup_steps = 0, min_lr_ratio = 1.0 }

[[phase]]
name = "first"

[[phase]]
name = "second"
data = { seed = 5000 }
train = { steps = 6, optim = { lr = 5e-4 } }
"""

DRIVER = """
import sys
from pathlib import Path
from training.recipes.phases import plan_stage, run_stage_runs
from training.stages.run import run_stage
src, work, init = map(Path, sys.argv[1:])
wiring = {"init": str(init), "style": "think"}
runs = plan_stage(src, work, "sft-think", "sft.toml", wiring, set())
run_stage_runs(runs, work / "sft-think", run_stage)
"""


def _command(src: Path, work: Path, init: Path) -> list[str]:
    return [sys.executable, "-c", DRIVER, str(src), str(work), str(init)]


def _outputs(work: Path) -> tuple[list[tuple], bytes]:
    stage = work / "sft-think"
    rows = [json.loads(line) for line in (stage / "log.jsonl").read_text().splitlines()]
    keys = ("run", "step", "loss", "ce", "lr", "tokens")
    weights = (stage / "model" / "model.safetensors").read_bytes()
    return [tuple(row[k] for k in keys) for row in rows], weights


def _run_to_end(src: Path, work: Path, init: Path) -> None:
    subprocess.run(
        _command(src, work, init), env=env(), check=True, timeout=600, capture_output=True
    )


def test_a_chain_cut_mid_phase_resumes_to_the_uncut_result(random_checkpoint, tmp_path) -> None:
    src = tmp_path / "recipe"
    src.mkdir()
    (src / "sft.toml").write_text(STAGE)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _run_to_end(src, straight, random_checkpoint)
    proc = subprocess.Popen(
        _command(src, cut, random_checkpoint),
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    mid = cut / "sft-think" / "second" / "checkpoints" / "step-000001"
    deadline = time.monotonic() + 400
    while not mid.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the second phase never saved"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (cut / "sft-think" / "second" / "summary.json").exists()  # cut mid-phase
    assert not (cut / "sft-think" / "first" / "checkpoints").exists()  # finished: pruned
    _run_to_end(src, cut, random_checkpoint)
    log, weights = _outputs(straight)
    assert [row[:2] for row in log] == [("first", s) for s in range(4)] + [
        ("second", s) for s in range(4, 10)
    ]
    assert {row[4] for row in log[4:]} == {5e-4}  # the second phase's own settings
    assert _outputs(cut) == (log, weights)
    phases = json.loads((cut / "sft-think" / "phases.json").read_text())
    assert [(p["phase"], p["first_step"], p["steps"]) for p in phases] == [
        ("first", 0, 4),
        ("second", 4, 6),
    ]
    assert (cut / "sft-think" / "curves.png").stat().st_size > 1000
