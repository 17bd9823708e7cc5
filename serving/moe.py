"""Sparse MoE MLP of Qwen3-MoE: softmax router, top-k experts, grouped expert compute.

Expert weights are held fused, `gate_up [E, 2I, H]` (gate rows first, then up) and
`down [E, H, I]`, the layout transformers uses in memory, so expert compute is a
grouped product over tokens sorted by expert rather than one module per expert.
"""

import torch
import torch.nn.functional as F
from torch import nn

from serving.config import ModelConfig


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights, softmax in fp32 as transformers does."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for x [T, H].

    Tokens are sorted by expert so each used expert runs one matrix product over a
    contiguous slice; unused experts cost nothing.
    """
    _num_tokens, top_k = experts.shape
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // top_k
    xs = x[token_of]
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = slice(start, start + n)
            out[seg] = F.linear(silu_and_mul(F.linear(xs[seg], gate_up[e])), down[e])
            start += n
    out *= weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))

    def forward(
        self, x: torch.Tensor, router_logits_out: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        if router_logits_out is not None:
            router_logits_out.append(logits)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        return grouped_experts(x, weights, experts, self.gate_up, self.down).view(shape)
