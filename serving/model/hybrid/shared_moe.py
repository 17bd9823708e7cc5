"""Qwen3-Next's sparse MoE block: Qwen3-MoE's routed experts plus one shared expert.

The routed part is `serving.model.moe.SparseMoE` unchanged (softmax router, top-k, fused
expert weights). The shared expert is a dense SwiGLU MLP that every token runs, scaled per
token by `sigmoid(shared_expert_gate(x))`, so the model can learn how much of each token goes
through the common path.
"""

import torch
from torch import nn

from serving.model.hybrid.config import HybridConfig
from serving.model.linear import Linear
from serving.model.moe import DenseMLP, SparseMoE


class SharedExpertMoE(SparseMoE):
    def __init__(self, config: HybridConfig) -> None:
        # SparseMoE reads the expert fields by name, which HybridConfig shares with ModelConfig.
        super().__init__(config)  # type: ignore[arg-type]
        h = config.hidden_size
        self.shared_expert = DenseMLP(h, config.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(h, 1, bias=False)

    def forward(
        self, x: torch.Tensor, router_logits_out: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        routed = super().forward(x, router_logits_out)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def hybrid_mlp(config: HybridConfig, layer: int) -> nn.Module:
    """The layer's MLP: sparse with a shared expert, or dense where the config says so."""
    if config.layer_is_sparse(layer):
        return SharedExpertMoE(config)
    return DenseMLP(config.hidden_size, config.intermediate_size)
