"""A recipe's stage as a chain of phases, and the plan of runs that a recipe is.

The shipped full tier was not one SFT run: it is a curriculum of continuations, each from the
model before, on fresh tasks with its own data mix, learning rate and length, with RL runs
between some of them. A stage file's `[[phase]]` list writes that chain down: each phase is
the file's base settings with the phase's own on top (`data`, `train`, `curriculum`... as in
the file), run from the previous phase's model into `WORK/STAGE/PHASE/`. A phase can take
another stage file of the recipe as its base (`config = "rl.toml"`: an RL run between SFT
phases), and start from or distil another run's model (`init`, `teacher`: a stage or
`stage/phase` of the same run, e.g. a student distilled from a mid-curriculum model). The
first phase gets the stage's wiring from the recipe (its `init`, and for the student its
`keep_layers` and `teacher`); a later one only its style and the model before it.

Every run's config is built and validated when the plan is made, before anything trains: a
typo in the last phase fails in a second, not after hours. A run is finished when its
`summary.json` is written (after its model): a rerun skips it, and an interrupted run resumes
from its last checkpoint, exactly (`training/stages/trainer.py`). A finished phase's
checkpoints are deleted (a demo chain has dozens of runs, each checkpoint holding the optimizer's
state); its model, logs, curves and tables stay.
"""

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import ConfigError, read_stage_file
from training.reports.curves import plot_curves
from training.stages import checkpointing
from training.stages.run import StageConfig, load_stage_config

PHASE_NAME = r"^[a-z0-9][a-z0-9-]*$"


class PhaseSpec(BaseModel):
    """One `[[phase]]` table: its name and wiring; every other key is a stage setting."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=PHASE_NAME)
    config: str | None = None  # another stage file of the recipe as this phase's base
    init: str | None = None  # a stage or `stage/phase` of this run to start from
    teacher: str | None = None  # a stage or `stage/phase` of this run to distil


@dataclass(frozen=True)
class Run:
    """One training run of the plan: a stage, or one phase of it."""

    stage: str
    phase: str | None
    out: Path
    config: StageConfig

    @property
    def name(self) -> str:
        return self.stage if self.phase is None else f"{self.stage}/{self.phase}"

    @property
    def steps(self) -> int:
        return self.config.train.steps

    def finished(self) -> bool:
        return (self.out / "summary.json").exists() and (self.out / "model").is_dir()

    def steps_done(self) -> int:
        """Training steps this run has behind it: all when finished, else its checkpoint's."""
        if self.finished():
            return self.steps
        latest = checkpointing.latest(self.out / "checkpoints")
        return 0 if latest is None else int(re.sub(r"\D", "", latest.name)) + 1


def plan_stage(
    src: Path, work: Path, stage: str, file: str, wiring: dict[str, Any], known: set[str]
) -> list[Run]:
    """The runs of one stage, validated; `known` holds the names of the runs before it (and
    gets this stage's), so `init` and `teacher` can only name a model made earlier."""
    path = src / file
    _, phases = read_stage_file(path)
    try:
        if not phases:
            runs = [Run(stage, None, work / stage, load_stage_config(path, **wiring))]
        else:
            runs = _plan_phases(src, work, stage, path, wiring, phases, known)
    except ValidationError as e:
        raise ConfigError(f"{path}: invalid [[phase]]:\n{e}") from e
    known.update(run.name for run in runs)
    known.add(stage)
    return runs


def _plan_phases(
    src: Path,
    work: Path,
    stage: str,
    path: Path,
    wiring: dict[str, Any],
    phases: list[dict[str, Any]],
    known: set[str],
) -> list[Run]:
    runs: list[Run] = []
    for raw in phases:
        spec = PhaseSpec.model_validate(raw)
        name = f"{stage}/{spec.name}"
        if name in known or any(run.name == name for run in runs):
            raise ConfigError(f"{path}: two phases named {spec.name!r}")
        if not runs:
            fields = dict(wiring)
        elif "init" not in wiring:
            raise ConfigError(f"{path}: a stage trained from scratch has no later phases")
        else:
            fields = {"init": str(runs[-1].out / "model"), "style": wiring["style"]}
        earlier = known | {run.name for run in runs}
        for key in ("init", "teacher"):
            ref = getattr(spec, key)
            if ref is None:
                continue
            if ref not in earlier:
                raise ConfigError(
                    f"{path}: phase {spec.name!r}: {key} = {ref!r} names no stage or phase "
                    f"run before it (earlier: {', '.join(sorted(earlier))})"
                )
            fields[key] = str(work / ref / "model")
        base = src / spec.config if spec.config is not None else path
        config = load_stage_config(base, layers=[spec.model_extra or {}], **fields)
        runs.append(Run(stage, spec.name, work / stage / spec.name, config))
    return runs


def run_stage_runs(
    runs: list[Run],
    stage_dir: Path,
    train: Callable[[StageConfig, Path], Path],
    note: Callable[[str], None] = lambda name: None,
) -> Path:
    """Train a stage's runs in order (`train(config, out)`), skipping finished ones; a chain
    of phases leaves its last model as `STAGE/model`, with the whole chain's curves beside
    it. Returns the stage's model directory."""
    for run in runs:
        if not run.finished():
            note(run.name)
            train(run.config, run.out)
        if run.phase is not None:
            shutil.rmtree(run.out / "checkpoints", ignore_errors=True)
    last = runs[-1]
    if last.phase is None:
        return last.out / "model"
    final = stage_dir / "model"
    if not (stage_dir / "phases.json").exists():
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(last.out / "model", final)
        write_chain_curves(runs, stage_dir)
    return final


def write_chain_curves(runs: list[Run], stage_dir: Path) -> None:
    """The phases' logs end to end (`log.jsonl`, `curves.png` with a line at each phase's
    start) and which phase ran which steps (`phases.json`, written last: the stage is done)."""
    log: list[dict] = []
    evals: list[dict] = []
    spans = []
    for run in runs:
        offset = len(log)
        rows = [json.loads(line) for line in (run.out / "log.jsonl").read_text().splitlines()]
        log += [row | {"step": row["step"] + offset, "run": run.phase} for row in rows]
        held = json.loads((run.out / "evals.json").read_text())
        evals += [row | {"step": row["step"] + offset} for row in held]
        spans.append({"phase": run.phase, "first_step": offset, "steps": len(rows)})
    (stage_dir / "log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (stage_dir / "evals.json").write_text(json.dumps(evals, indent=1) + "\n")
    boundaries = [(span["first_step"], span["phase"]) for span in spans]
    plot_curves(log, evals, stage_dir / "curves.png", stage_dir.name, boundaries)
    (stage_dir / "phases.json").write_text(json.dumps(spans, indent=1) + "\n")
