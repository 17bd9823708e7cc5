"""The SFT loss's copy weight: copy positions count `copy_weight` times, the rest once."""

import torch
import torch.nn.functional as F

from serving.model.causal_lm import CausalLM
from serving.model.config import ModelConfig
from tests.tiny_models import TINY_MOE
from training.config import TrainConfig
from training.data.datasets import completion_batch
from training.objectives.lm_loss import lm_loss


def test_copy_positions_weigh_copy_weight_times() -> None:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(dict(TINY_MOE, architectures=["Qwen3MoeForCausalLM"])))
    model.init_weights(std=0.2)
    batch = completion_batch([([5, 6, 7], [8, 9, 10, 11]), ([5, 6], [12, 13])], pad_id=0)
    batch.copy_mask = torch.zeros_like(batch.padding_mask)
    batch.copy_mask[0, 3] = batch.copy_mask[1, 1] = True  # two labelled positions
    with torch.no_grad():
        logits = model.compute_logits(model(batch.input_ids, batch.positions))
    ce = F.cross_entropy(logits.transpose(1, 2).float(), batch.labels, reduction="none")
    labelled = ce[batch.labels != -100].sum()
    copies = ce[batch.copy_mask].sum()
    plain, weighted = (
        lm_loss(TrainConfig(copy_weight=w, aux_loss_coef=0, z_loss_coef=0))(model, batch)
        for w in (1.0, 3.0)
    )
    torch.testing.assert_close(plain.token_sum.detach(), labelled)
    torch.testing.assert_close(weighted.token_sum.detach(), labelled + 2 * copies)
    torch.testing.assert_close(weighted.ce_sum.detach(), labelled)  # the reported loss is plain
