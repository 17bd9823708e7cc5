"""A stage from its config: `stage = "..."` in a TOML file picks the stage's own config class,
which validates the file, and the stage's function, which trains it.

Each stage builds (or reuses) its tokenized data under `OUT/data`, trains through the shared
`Trainer` with checkpoints under `OUT/checkpoints` (rerunning the same command resumes), and
exports the result as a Hugging Face directory under `OUT/model`, with the loss curves and
held-out evaluation tables beside it.
"""

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from training.config import load_config
from training.stages.dpo import DPOStage, dpo
from training.stages.draft import DraftStage, draft
from training.stages.mtp import MTPStage, train_mtp
from training.stages.pretrain import PretrainStage, pretrain
from training.stages.reward_model import RewardModelStage, reward_model
from training.stages.rl import RLStage, rl
from training.stages.sft import SFTStage, sft

StageConfig = (
    PretrainStage | SFTStage | DraftStage | MTPStage | DPOStage | RewardModelStage | RLStage
)

STAGES: dict[type, Callable[[Any, Path], Path]] = {
    PretrainStage: pretrain,
    SFTStage: sft,
    DraftStage: draft,
    MTPStage: train_mtp,
    DPOStage: dpo,
    RewardModelStage: reward_model,
    RLStage: rl,
}

_CONFIGS: TypeAdapter[StageConfig] = TypeAdapter(
    Annotated[StageConfig, Field(discriminator="stage")]
)


def load_stage_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    layers: Iterable[dict[str, Any]] = (),
    **defaults: Any,
) -> StageConfig:
    """`defaults` (the command's flags, a recipe's wiring), then the TOML file, then a recipe
    phase's `layers`, then `--set`."""
    return load_config(path, overrides, _CONFIGS.validate_python, layers, **defaults)


def run_stage(config: StageConfig, out_dir: Path) -> Path:
    """Train one stage into `out_dir`; returns the exported model directory."""
    return STAGES[type(config)](config, Path(out_dir))
