"""The language-model objective of pretraining and SFT, with what it is made of logged.

Next-token cross-entropy (copy positions weighted `copy_weight`), the MoE router losses, the
MTP loss, and for a distilled student the KL from its teacher; each part reported beside the
total so a run's curves say which one moved.
"""

from dataclasses import dataclass

import torch

from serving.model.families import LanguageModel
from training.config import TrainConfig
from training.data.curriculum import domain_sums
from training.data.datasets import IGNORE, Batch
from training.objectives.losses import (
    LossFn,
    LossParts,
    hidden_states,
    kl_sum,
    load_balancing_loss,
    router_z_loss,
    shift_labels,
    token_loss_sum,
    token_losses,
)


@dataclass
class Teacher:
    model: LanguageModel
    weight: float
    temperature: float


def lm_loss(
    cfg: TrainConfig, domains: list[str] | None = None, teacher: Teacher | None = None
) -> LossFn:
    """Next-token cross-entropy (copy positions weighted `copy_weight`), plus the MoE router
    losses and lambda * the MTP loss. With `domains` (the curriculum's), also the summed
    cross-entropy at copy positions and per domain, with their counts, as metrics. With a
    `teacher`, plus weight * the KL from the teacher's distributions at the same answer tokens,
    which it predicts after its reasoning (`Batch.teacher`): the short-style student learns
    what the reasoning tier concludes."""

    def loss(model: LanguageModel, batch: Batch) -> LossParts:
        router_logits: list[torch.Tensor] | None = [] if model.config.is_moe else None
        hidden = hidden_states(model, batch, router_logits)
        logits = model.compute_logits(hidden)
        metrics: dict[str, float] = {}
        ce = token_losses(logits, batch.labels)
        ce_sum = token_sum = ce.sum()
        if cfg.copy_weight != 1 and batch.copy_mask is not None:
            token_sum = ce_sum + (cfg.copy_weight - 1) * ce[batch.copy_mask].sum()
        if domains is not None:
            metrics |= loss_breakdown(ce.detach(), batch, domains)
        if teacher is not None:
            assert batch.teacher is not None  # a dataset built with the teacher's turns
            t = batch.teacher
            with torch.no_grad():
                t_hidden = hidden_states(teacher.model, t)
                t_logits = teacher.model.compute_logits(t_hidden)
            kd = kl_sum(
                logits[batch.labels != IGNORE], t_logits[t.labels != IGNORE], teacher.temperature
            )
            token_sum = token_sum + teacher.weight * kd
            metrics["kd_loss"] = kd.item() / max(1, batch.num_targets)
        extra = torch.zeros(())
        if router_logits:
            aux = load_balancing_loss(
                router_logits, model.config.num_experts_per_tok, batch.padding_mask
            )
            z = router_z_loss(router_logits, batch.padding_mask)
            extra = cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
            metrics |= {"aux_loss": aux.item(), "z_loss": z.item()}
        if cfg.mtp_weight and len(model.mtp):
            mtp_logits = model.mtp_logits(
                hidden, batch.input_ids, batch.positions, batch.padding_mask
            )
            mtp_sum = torch.zeros(())
            for depth, logits in enumerate(mtp_logits, start=1):
                mtp_sum = mtp_sum + token_loss_sum(logits, shift_labels(batch.labels, depth))
            token_sum = token_sum + cfg.mtp_weight * mtp_sum
            metrics["mtp_loss"] = mtp_sum.item() / max(1, batch.num_targets)
        return LossParts(token_sum, ce_sum, extra, metrics)

    return loss


def loss_breakdown(ce: torch.Tensor, batch: Batch, domains: list[str]) -> dict[str, float]:
    """Summed cross-entropy and target counts at copy positions and per domain, every key
    always present (the trainer all-reduces metrics by position)."""
    assert batch.copy_mask is not None and batch.domains is not None  # SFT batches
    targets = batch.labels != IGNORE
    out = {"copy_ce_sum": float(ce[batch.copy_mask].sum()), "copy_n": float(batch.copy_mask.sum())}
    for d in domains:
        rows = torch.tensor([x == d for x in batch.domains])
        ce_key, n_key = domain_sums(d)
        out[ce_key] = float(ce[rows].sum())
        out[n_key] = float(targets[rows].sum())
    return out
