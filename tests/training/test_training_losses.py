"""Training losses against their references: transformers' Qwen3-MoE load-balancing loss,
the ST-MoE z-loss formula, and distillation's fixed points."""

import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from training.data.datasets import IGNORE
from training.objectives.losses import (
    distillation_loss_sum,
    load_balancing_loss,
    router_z_loss,
    shift_labels,
    token_loss_sum,
)
from training.stages import trainer


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_load_balancing_matches_transformers(top_k: int, padded: bool) -> None:
    g = torch.Generator().manual_seed(top_k)
    batch, length, experts, layers = 3, 7, 8, 3
    logits = [torch.randn(batch * length, experts, generator=g) * 2 for _ in range(layers)]
    mask = torch.ones(batch, length, dtype=torch.bool)
    if padded:
        mask[0, 4:] = False
        mask[2, 1:] = False
    ours = load_balancing_loss(logits, top_k, mask)
    theirs = load_balancing_loss_func(
        tuple(logits), experts, top_k, mask.long() if padded else None
    )
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)


def test_load_balancing_is_top_k_when_balanced_and_larger_when_not() -> None:
    eye = torch.eye(8).repeat(8, 1) * 10  # each expert the top choice of 8 tokens
    mask = torch.ones(64, dtype=torch.bool)
    loss = load_balancing_loss([eye], 1, mask)
    assert math.isclose(float(loss), 1.0, rel_tol=1e-3)
    collapsed = torch.zeros(64, 8)
    collapsed[:, 0] = 10
    assert float(load_balancing_loss([collapsed], 1, mask)) > 7.9


def test_z_loss_is_mean_squared_logsumexp_over_real_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0], [3.0, 1.0], [100.0, 100.0]])
    mask = torch.tensor([True, True, False])
    expected = (math.log(2) ** 2 + math.log(math.exp(3) + math.exp(1)) ** 2) / 2
    assert math.isclose(float(router_z_loss([logits], mask)), expected, rel_tol=1e-5)


def test_token_loss_sums_only_labelled_positions() -> None:
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, IGNORE, 4], [IGNORE, IGNORE, 0]])
    expected = sum(
        -torch.log_softmax(logits[b, t], -1)[labels[b, t]] for b, t in [(0, 0), (0, 2), (1, 2)]
    )
    torch.testing.assert_close(token_loss_sum(logits, labels), expected)


def test_shift_labels_for_mtp_depths() -> None:
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels, 1).tolist() == [[6, 7, 8, IGNORE]]
    assert shift_labels(labels, 2).tolist() == [[7, 8, IGNORE, IGNORE]]


def test_distillation_is_zero_at_the_teacher_and_positive_elsewhere() -> None:
    teacher = torch.randn(2, 4, 11)
    labels = torch.zeros(2, 4, dtype=torch.long)
    labels[0, 0] = IGNORE
    assert float(distillation_loss_sum(teacher.clone(), teacher, labels, 2.0)) == pytest.approx(
        0.0, abs=1e-5
    )
    assert float(distillation_loss_sum(torch.randn(2, 4, 11), teacher, labels, 2.0)) > 0.1


def test_auto_dtype_is_bf16_only_where_bf16_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    for native in (False, True):
        monkeypatch.setattr(trainer, "is_supported", lambda dtype, device, n=native: n)
        assert trainer.autocast_bf16("auto", cpu) is native
        assert trainer.autocast_bf16("bf16", cpu) and not trainer.autocast_bf16("fp32", cpu)
