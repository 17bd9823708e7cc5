"""A padded batch without a mask where causal attention alone hides the padding (right
padding): the same outputs and gradients on real tokens as the explicit mask gives."""

import pytest
import torch

import serving.model.causal_lm as causal_lm
from serving.model.causal_lm import CausalLM, causal_mask
from serving.model.config import ModelConfig
from tests.tiny_models import TINY_MOE

CONFIG = dict(TINY_MOE, architectures=["Qwen3MoeForCausalLM"], tierserve_mtp={"num_layers": 1})


def explicit_mask(length: int, padding_mask: torch.Tensor | None, device) -> torch.Tensor:
    """The mask written out for every batch: causal, padded keys hidden, each query sees itself."""
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if padding_mask is None:
        return causal
    return causal & padding_mask[:, None, None, :] | torch.eye(length, dtype=torch.bool)


def test_right_padding_and_no_padding_need_no_mask_and_left_padding_does():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert causal_mask(4, None, right.device) is None
    assert causal_mask(4, right, right.device) is None
    left = right.flip(-1)
    assert torch.equal(causal_mask(4, left, left.device), explicit_mask(4, left, left.device))


@pytest.mark.parametrize("padded", ["right", "none"])
def test_causal_attention_alone_gives_the_masked_outputs_and_gradients(monkeypatch, padded):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(CONFIG))
    model.init_weights(std=0.2)
    lengths = [13, 6, 9] if padded == "right" else [13, 13, 13]
    ids = torch.randint(1, TINY_MOE["vocab_size"], (3, 13))
    real = torch.arange(13)[None] < torch.tensor(lengths)[:, None]
    positions = torch.arange(13).expand(3, -1)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        hidden = model(ids, positions, padding_mask=real)
        loss = model.compute_logits(hidden).log_softmax(-1)[..., 0][real].sum()
        for logits in model.mtp_logits(hidden, ids, positions, padding_mask=real):
            loss = loss + logits.log_softmax(-1)[..., 0][real].sum()
        loss.backward()
        return hidden[real].detach(), [p.grad.clone() for p in model.parameters()]

    fast, fast_grads = run()
    monkeypatch.setattr(causal_lm, "causal_mask", explicit_mask)
    masked, masked_grads = run()
    torch.testing.assert_close(fast, masked, atol=2e-5, rtol=1e-4)
    for a, b in zip(fast_grads, masked_grads, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
