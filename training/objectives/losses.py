"""The losses every stage combines: token cross-entropy, MoE router losses, MTP, distillation.

Token losses are returned as sums, not means: the trainer divides by the number of target
tokens in the whole global batch (all micro-batches, all processes), so the gradient does
not depend on how a batch was split into micro-batches or processes.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from serving.model.families import LanguageModel
from serving.model.hybrid.model import HybridCausalLM
from training.data.datasets import IGNORE, Batch


@dataclass
class LossParts:
    token_sum: torch.Tensor  # the objective summed over target tokens: normalised here
    ce_sum: torch.Tensor  # the plain next-token cross-entropy, summed: logged as `ce`
    extra: torch.Tensor  # already a mean (router losses): added as is
    metrics: dict[str, float] = field(default_factory=dict)  # summed over micro-batches


LossFn = Callable[[LanguageModel, Batch], LossParts]


def hidden_states(
    model: LanguageModel, batch: Batch, router_logits: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The final hidden states [B, L, hidden] of a batch's rows, each a right-padded sequence
    from its first token. The hybrid family's forward takes no positions: it counts them
    along each row from the padding mask, as its DeltaNet layers run their recurrence along
    the row, and leaves a padded token out of their state."""
    if isinstance(model, HybridCausalLM):
        return model(batch.input_ids, batch.padding_mask, router_logits=router_logits)[0]
    return model(
        batch.input_ids, batch.positions, padding_mask=batch.padding_mask,
        router_logits=router_logits,
    )  # fmt: skip


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over positions whose label is not IGNORE (fp32)."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy [B, L], 0 where the label is IGNORE (fp32): for losses
    broken down by position kind or domain."""
    flat = F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return flat.view(labels.shape)


def load_balancing_loss(
    router_logits: list[torch.Tensor], top_k: int, token_mask: torch.Tensor
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as Qwen3-MoE (and Mixtral) train with it:
    E * sum_e f_e * P_e, with f_e the top-k slots routed to expert e per real token and P_e
    its mean router probability, both pooled over all sparse layers. Equals top_k when the
    routing is perfectly balanced, more when it is not."""
    mask = token_mask.flatten().float()
    num_experts = router_logits[0].shape[-1]
    slots = torch.zeros(num_experts)
    prob = torch.zeros(num_experts)
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1).float()
        slots = slots + (chosen * mask[:, None]).sum(0)
        prob = prob + (probs * mask[:, None]).sum(0)
    rows = (mask.sum() * len(router_logits)).clamp(min=1)
    return num_experts * ((slots / rows) * (prob / rows)).sum()


def router_z_loss(router_logits: list[torch.Tensor], token_mask: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: mean squared log-partition of the router logits over real tokens,
    which keeps them small and the routing softmax numerically stable."""
    mask = token_mask.flatten().float()
    real = mask.sum().clamp(min=1)
    per_layer = [
        (torch.logsumexp(logits.float(), dim=-1).square() * mask).sum() / real
        for logits in router_logits
    ]
    return torch.stack(per_layer).mean()


def shift_labels(labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Labels of MTP depth `depth`: position t predicts labels[t + depth]."""
    out = torch.full_like(labels, IGNORE)
    out[:, :-depth] = labels[:, depth:]
    return out


def distillation_loss_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Summed KL(teacher || student) of the temperature-softened distributions over the
    positions that carry a label, scaled by T^2 (Hinton et al.) so gradients keep their size."""
    keep = labels.flatten() != IGNORE
    return kl_sum(
        student_logits.flatten(0, -2)[keep], teacher_logits.flatten(0, -2)[keep], temperature
    )


def kl_sum(
    student_rows: torch.Tensor, teacher_rows: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Summed T^2 * KL(teacher || student) over matching rows of logits [N, V] (fp32)."""
    s = (student_rows.float() / temperature).log_softmax(-1)
    t = (teacher_rows.float() / temperature).log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="sum") * temperature**2
