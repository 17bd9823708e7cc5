"""Qwen3-Next's two RMSNorms, which differ from Qwen3's (`serving.model.causal_lm.RMSNorm`).

- The decoder's norms (and q/k norms) are zero-centred: the scale is `1 + w`, so a weight
  decayed towards zero keeps the identity, and the product is taken in fp32 before the cast
  back (Qwen3 casts first, then scales).
- The DeltaNet output norm is gated: a plain-`w` RMSNorm per value head, times `silu(z)` of
  the layer's own gate projection.
"""

import torch
import torch.nn.functional as F
from torch import nn


def _rms_normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class ZeroCentredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalize_fp32(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32, scale in x's dtype, gate in fp32 (transformers' order)."""
        h = self.weight * _rms_normalize_fp32(x, self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
