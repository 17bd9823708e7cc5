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

from serving.model.attention import AttentionMetadata, paged_attention, write_kv
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
        self.k_cache: torch.Tensor | None = None  # set by the engine (`paged.py`)
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, rope: Rope, batch: PaddedBatch, state: KVState | None
    ) -> tuple[torch.Tensor, KVState | None]:
        """x [B, L, hidden] -> [B, L, hidden]; with a state, attends over its keys too and
        returns them with this call's appended after each row's last one."""
        q, gate, k, v = self._project(x, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, L, d]
        if state is not None:
            k, v = self._append(state.keys, k, batch), self._append(state.values, v, batch)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=batch.attn_mask, scale=self.scale, enable_gqa=True
        )
        return self._gated_output(o.transpose(1, 2), gate), None if state is None else KVState(k, v)

    def forward_paged(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        """The engine's form: a step's tokens x [T, hidden] over the paged KV cache that the
        model runner attached (`k_cache`, `v_cache`), as the MoE family attends."""
        q, gate, k, v = self._project(x, rope)
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return self._gated_output(o, gate)

    def _project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """Query, gate [..., heads, d], key and value [..., kv_heads, d] for x [..., hidden],
        normed and rotated: what both layouts share."""
        lead = x.shape[:-1]
        query_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = query_gate.view(*lead, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = partial_rope(rope, self.q_norm(q))
        k = partial_rope(rope, self.k_norm(k.view(*lead, self.num_kv_heads, self.head_dim)))
        return q, gate, k, v.view(*lead, self.num_kv_heads, self.head_dim)

    def _gated_output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o and gate [..., heads, d] -> [..., hidden]."""
        lead = o.shape[:-2]
        gated = o.reshape(*lead, self.q_size) * torch.sigmoid(gate.reshape(*lead, self.q_size))
        return self.o_proj(gated)

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
