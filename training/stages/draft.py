"""The `draft` stage: a small dense drafter distilled from a target model's next-token
distributions, on the target's SFT data, or on its own greedy completions of the same
prompts (`draft_data = "target"`): what a drafter is asked to guess when it serves."""

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from training.config import FromCheckpoint
from training.data.datasets import IGNORE, Batch, SFTDataset
from training.objectives.losses import LossFn, LossParts, distillation_loss_sum, token_loss_sum
from training.stages.outputs import begin, bf16_export, finish, new_model, pad_id
from training.stages.sft import sft_data
from training.stages.trainer import Trainer


class DraftStage(FromCheckpoint):
    """`init` is the target the drafter learns from."""

    stage: Literal["draft"] = "draft"
    shape: dict[str, Any]  # the drafter's config.json fields
    kd_temperature: float = Field(1.0, gt=0)  # softmax temperature of the distillation
    draft_data: Literal["reference", "target"] = "reference"


def distill_loss(teacher: CausalLM, temperature: float) -> LossFn:
    """KL from the teacher's next-token distributions on the completion tokens."""

    def loss(model: CausalLM, batch: Batch) -> LossParts:
        with torch.no_grad():
            t_hidden = teacher(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
            t_logits = teacher.compute_logits(t_hidden)
        logits = model.compute_logits(
            model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
        )
        kd = distillation_loss_sum(logits, t_logits, batch.labels, temperature)
        keep = batch.labels != IGNORE
        agree = (logits.argmax(-1) == t_logits.argmax(-1))[keep].float().mean()
        ce = token_loss_sum(logits.detach(), batch.labels)
        return LossParts(kd, ce, torch.zeros(()), {"agreement": agree.item()})

    return loss


def draft(config: DraftStage, out_dir: Path) -> Path:
    """Distil the drafter into `out_dir`; returns its exported directory."""
    out_dir = begin(config, out_dir)
    cfg, tok_dir = config.train, Path(config.init)
    tokenizer = Tokenizer.from_dir(tok_dir)
    path = sft_data(config, tokenizer, out_dir, distil=False, draft_data=config.draft_data)
    model = new_model(config.shape, tokenizer, False, cfg.seed)
    loss = distill_loss(load_checkpoint(config.init), config.kd_temperature)
    dataset = SFTDataset(path, pad_id(tokenizer))
    trainer = Trainer(model, cfg, dataset, out_dir, loss, None, desc="draft")
    return finish(trainer, config, out_dir, bf16_export(tok_dir))
