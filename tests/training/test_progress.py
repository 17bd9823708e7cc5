"""One progress display for a whole recipe: every trainer's steps advance the run's one bar,
which counts the steps done before a resume, and says which run is at which of its steps."""

import json
from pathlib import Path

import pytest

from training.config import TrainConfig
from training.recipes.phases import Run
from training.stages import checkpointing, progress
from training.stages.sft import SFTStage


def test_trainers_advance_the_one_bar_of_the_run() -> None:
    with progress.run_progress(total=10, done=3) as run:
        progress.begin("sft-think/full2")
        bar = progress.step_bar("sft", start=1, total=4, disable=False)
        bar.update(1)
        bar.update(1)
        assert run.bar.n == 5 and run.bar.total == 10
        assert run.bar.desc == "sft-think/full2 3/4"
        bar.close()
        progress.note("held-out evaluation of sft-think")
        assert run.bar.desc == "held-out evaluation of sft-think"
        with pytest.raises(RuntimeError), progress.run_progress(1, 0):
            pass
    assert progress._active is None
    alone = progress.step_bar("sft", start=0, total=4, disable=True)  # no recipe: its own
    assert alone is not None and not isinstance(alone, type(bar))


def _manifest(path: Path) -> None:
    path.mkdir(parents=True)
    (path / checkpointing.MANIFEST).write_text(json.dumps({"step": 0, "files": {}}))


def test_a_run_counts_the_steps_it_has_behind_it(tmp_path: Path) -> None:
    config = SFTStage(init="m", train=TrainConfig(steps=8))
    run = Run("sft-think", "full2", tmp_path / "full2", config)
    assert run.steps_done() == 0
    _manifest(tmp_path / "full2" / "checkpoints" / "step-000004")
    assert run.steps_done() == 5  # steps 0-4 are in that checkpoint
    (tmp_path / "full2" / "model").mkdir()
    (tmp_path / "full2" / "summary.json").write_text("{}")
    assert run.finished() and run.steps_done() == 8
