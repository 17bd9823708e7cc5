"""Per-sequence state of a hybrid model between calls: what prefill hands to decode.

A Gated DeltaNet layer carries a fixed-size state whatever the context length: the last
`kernel - 1` inputs of its causal convolution and the delta rule's matrix per value head. A
full-attention layer carries its keys and values, here as one dense tensor per layer, each
row's tokens contiguous from slot 0 (the reference form; the engine keeps these in its paged
KV cache instead, and the DeltaNet states in per-sequence slots: `paged.py`, `slots.py`).
"""

from dataclasses import dataclass

import torch

from serving.model.hybrid.config import LINEAR, HybridConfig


@dataclass
class LinearState:
    conv: torch.Tensor  # [B, conv_dim, kernel - 1]: the convolution's latest inputs, oldest first
    recurrent: torch.Tensor  # [B, value_heads, key_head_dim, value_head_dim], fp32


@dataclass
class KVState:
    keys: torch.Tensor  # [B, kv_heads, width, head_dim]: row b's tokens in slots [0, lengths[b])
    values: torch.Tensor


@dataclass
class HybridState:
    lengths: torch.Tensor  # [B] long: tokens each sequence has seen
    layers: list[LinearState | KVState]

    @classmethod
    def empty(
        cls, config: HybridConfig, batch: int, dtype: torch.dtype, device: torch.device
    ) -> "HybridState":
        """The state of `batch` sequences before their first token."""
        layers: list[LinearState | KVState] = []
        for kind in config.layer_types:
            if kind == LINEAR:
                conv = torch.zeros(
                    batch, config.conv_dim, config.linear_conv_kernel_dim - 1,
                    dtype=dtype, device=device,
                )  # fmt: skip
                recurrent = torch.zeros(
                    batch, config.linear_num_value_heads, config.linear_key_head_dim,
                    config.linear_value_head_dim, device=device,
                )  # fmt: skip
                layers.append(LinearState(conv, recurrent))
            else:
                shape = (batch, config.num_key_value_heads, 0, config.head_dim)
                empty = torch.zeros(shape, dtype=dtype, device=device)
                layers.append(KVState(empty, empty))
        return cls(torch.zeros(batch, dtype=torch.long, device=device), layers)
