"""Qwen3-Next's full-attention layer: Qwen3's attention with an output gate and partial RoPE.

- `q_proj` yields, per head, the query and a gate of the same size; the attention output is
  multiplied by `sigmoid(gate)` before `o_proj`. Held fused here with `k_proj` and `v_proj` as
  `qkv_proj` ([query and gate per head | keys | values]), the layout our loader builds from
  separate q/k/v tensors.
- RoPE rotates only the first `partial_rotary_factor` of each head; the rest carries no
  position.
- q and k norms are zero-centred (`norms.ZeroCentredRMSNorm`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from serving.model.causal_lm import Rope
from serving.model.hybrid.batch import PaddedBatch
from serving.model.hybrid.config import HybridConfig
from serving.model.hybrid.norms import ZeroCentredRMSNorm
from serving.model.hybrid.state import KVState
from serving.model.linear import Linear


def partial_rope(rope: Rope, x: torch.Tensor) -> torch.Tensor:
    """Rotate the leading dimensions of each head that the rope table covers."""
    rotary = rope.cos.shape[-1]
    return torch.cat([rope.apply(x[..., :rotary]), x[..., rotary:]], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: Rope, batch: PaddedBatch, state: KVState | None
    ) -> tuple[torch.Tensor, KVState | None]:
        """x [B, L, hidden] -> [B, L, hidden]; with a state, attends over its keys too and
        returns them with this call's appended after each row's last one."""
        b, length, _ = x.shape
        query_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = query_gate.view(b, length, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rope(rope, self.q_norm(q)).transpose(1, 2)  # [B, heads, L, d]
        k = partial_rope(rope, self.k_norm(k.view(b, length, self.num_kv_heads, -1)))
        k, v = k.transpose(1, 2), v.view(b, length, self.num_kv_heads, -1).transpose(1, 2)
        if state is not None:
            k, v = self._append(state.keys, k, batch), self._append(state.values, v, batch)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=batch.attn_mask, scale=self.scale, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(b, length, self.q_size)
        y = self.o_proj(o * torch.sigmoid(gate.reshape(b, length, self.q_size)))
        return y, None if state is None else KVState(k, v)

    @staticmethod
    def _append(stored: torch.Tensor, new: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        """[B, kv, width, d] with row b's new tokens at slots past[b], past[b] + 1, ... (its
        padding lands past its last real token, where the mask hides it and the next call
        overwrites it)."""
        b, heads, length, d = new.shape
        out = new.new_zeros(b, heads, batch.kv_width, d)
        out[:, :, : stored.shape[2]] = stored
        slots = batch.positions[:, None, :, None].expand(b, heads, length, d)
        return out.scatter_(2, slots, new)
