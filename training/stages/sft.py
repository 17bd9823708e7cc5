"""The `sft` stage: chat fine-tuning on the assistant's tokens, in the think style (the full
tier: reasoning trace, then the answer) or the short style (the highspeed tier).

Options that make the highspeed tier: `keep_layers` starts from some of `init`'s decoder
layers (depth pruning), `teacher` distils a think-style model's answer distributions into the
short-style student, `[qat]` trains through FP4 weights and exports the FP4 checkpoint. A
`[curriculum]` orders the examples by difficulty and domain loss.
"""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from serving.model.checkpoint import load_checkpoint
from serving.model.families import load_model
from serving.model.hybrid.model import HybridCausalLM
from serving.model.tokenizer import Tokenizer
from training.config import ConfigError, CurriculumConfig, FromCheckpoint, QATConfig
from training.data.curriculum import Curriculum
from training.data.datasets import SFTDataset, build_sft
from training.data.target_data import target_completions
from training.objectives.lm_loss import Teacher, lm_loss
from training.stages.heldout import harness_eval
from training.stages.outputs import begin, build_once, finish, pad_id, trained_export
from training.stages.pruning import keep_layers
from training.stages.qat import enable_qat
from training.stages.trainer import Trainer

# Training seeds of the held-out SFT examples: far past any run's own (still below the
# evaluation seed space, which is the harness's alone).
HELDOUT_SEED_OFFSET = 2_000_000_000


class SFTStage(FromCheckpoint):
    stage: Literal["sft"] = "sft"
    # start from these decoder layers of `init` only (depth pruning, pruning.py)
    keep_layers: list[int] | None = None
    # short style: the think-style checkpoint whose answer-token distributions, given its
    # reasoning, the student learns (logit KL at kd_temperature), weighted by kd_weight
    teacher: str | None = None
    kd_weight: float = Field(1.0, ge=0)
    kd_temperature: float = Field(1.0, gt=0)
    curriculum: CurriculumConfig = CurriculumConfig()
    qat: QATConfig = QATConfig()

    @model_validator(mode="after")
    def _teacher_teaches_short(self) -> "SFTStage":
        if self.teacher is not None and self.style != "short":
            raise ValueError("`teacher` distils a think-style model into the short style")
        return self


def sft_data(
    config: FromCheckpoint,
    tokenizer: Tokenizer,
    out_dir: Path,
    distil: bool,
    draft_data: Literal["reference", "target"] = "reference",
) -> Path:
    """The stage's tokenized SFT examples in its style, built once under `OUT/data`; with
    `draft_data = "target"`, the same prompts completed by `init` itself (greedy)."""
    data_dir = out_dir / "data"
    name = f"sft-{config.style}" + ("-teacher" if distil else "")
    path = data_dir / f"{name}.jsonl"
    seq_len = config.train.seq_len
    build_once(path, lambda: build_sft(config.data, config.style, tokenizer, path, seq_len, distil))
    if draft_data == "reference":
        return path
    target = data_dir / f"{name}-target.jsonl"
    return build_once(target, lambda: target_completions(path, target, config.init, seq_len))


def _heldout(config: SFTStage, tokenizer: Tokenizer, out_dir: Path) -> SFTDataset:
    """SFT examples from seeds no run trains on, whose copy-position loss each eval prints."""
    data = config.data.model_copy(
        update={
            "seed": config.data.seed + HELDOUT_SEED_OFFSET,
            "examples": config.curriculum.heldout_examples,
        }
    )
    path = out_dir / "data" / f"heldout-{config.style}.jsonl"
    seq_len = config.train.seq_len
    build_once(path, lambda: build_sft(data, config.style, tokenizer, path, seq_len))
    return SFTDataset(path, pad_id(tokenizer))


def sft(config: SFTStage, out_dir: Path) -> Path:
    """Fine-tune `init` into `out_dir`; returns its exported directory (FP4 with `[qat]`)."""
    out_dir = begin(config, out_dir)
    cfg, tok_dir = config.train, Path(config.init)
    tokenizer = Tokenizer.from_dir(tok_dir)
    dataset = SFTDataset(
        sft_data(config, tokenizer, out_dir, distil=config.teacher is not None), pad_id(tokenizer)
    )
    model = load_model(config.init, keep_fp4=False)  # trained: plain weights
    if isinstance(model, HybridCausalLM) and (
        config.keep_layers or config.qat.format or cfg.mtp_weight
    ):
        raise ConfigError("keep_layers, [qat] and an MTP loss are the MoE family's alone")
    if config.keep_layers is not None:
        model = keep_layers(model, config.keep_layers)
    if config.qat.format is not None:
        enable_qat(model, config.qat.format, config.qat.all_linear)
    curriculum = heldout = None
    if config.curriculum.enabled:
        curriculum = Curriculum(dataset, config.curriculum, cfg.seed)
        heldout = _heldout(config, tokenizer, out_dir)
    teacher = None
    if config.teacher is not None:
        teacher_model = load_checkpoint(config.teacher).eval()
        teacher = Teacher(teacher_model, config.kd_weight, config.kd_temperature)
    domains = list(config.data.mix)
    trainer = Trainer(
        model,
        cfg,
        dataset,
        out_dir,
        lm_loss(cfg, curriculum.domains if curriculum else None, teacher),
        harness_eval(out_dir, tok_dir, cfg, domains, heldout),
        desc="sft",
        sampler=curriculum,
    )
    return finish(trainer, config, out_dir, trained_export(config.qat, tok_dir, out_dir))
