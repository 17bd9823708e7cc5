"""The engine's DeltaNet states: one slot per running sequence, beside the paged KV cache.

A DeltaNet layer remembers a sequence in a state of fixed size (the convolution's last inputs
and the delta rule's matrix per value head), not in per-token keys and values, so it is not
paged: each running sequence holds one slot, the same index in every DeltaNet layer, from
admission to finish, abort or preemption. The engine's scheduler hands the indices out
(`serving/engine/state_slots.py`); this module owns the tensors (each DeltaNet layer's
`conv_slots` and `recurrent_slots`, which `GatedDeltaNet.forward_slots` reads and writes).

A slot is zeroed when a span starts its sequence (position 0), so a preempted sequence is
recomputed from the start as recompute preemption does for the KV cache.
"""

import torch

from serving.model.hybrid.config import LINEAR, HybridConfig
from serving.model.hybrid.deltanet import GatedDeltaNet
from serving.model.hybrid.model import HybridCausalLM


def state_bytes_per_slot(config: HybridConfig, dtype: torch.dtype) -> int:
    """One sequence's state in every DeltaNet layer: the convolution's inputs in the model's
    dtype, the recurrent matrix in fp32 (it accumulates over the whole context)."""
    conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * dtype.itemsize
    recurrent = (
        config.linear_num_value_heads
        * config.linear_key_head_dim
        * config.linear_value_head_dim
        * torch.float32.itemsize
    )
    layers = sum(1 for kind in config.layer_types if kind == LINEAR)
    return (conv + recurrent) * layers


def deltanet_layers(model: HybridCausalLM) -> list[GatedDeltaNet]:
    return [layer.linear_attn for layer in model.layers if layer.is_linear]


def attach_slots(model: HybridCausalLM, num_slots: int) -> None:
    """Give every DeltaNet layer `num_slots` states, on the model's device."""
    cfg = model.config
    weight = model.embed_tokens.weight
    for layer in deltanet_layers(model):
        layer.conv_slots = torch.zeros(
            num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1,
            dtype=weight.dtype, device=weight.device,
        )  # fmt: skip
        layer.recurrent_slots = torch.zeros(
            num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, dtype=torch.float32, device=weight.device,
        )  # fmt: skip


def reset_slots(model: HybridCausalLM, slots: list[int]) -> None:
    """Zero the states of sequences about to start."""
    index = torch.tensor(slots, device=model.embed_tokens.weight.device)
    for layer in deltanet_layers(model):
        layer.conv_slots.index_fill_(0, index, 0)
        layer.recurrent_slots.index_fill_(0, index, 0)


def copy_slot(model: HybridCausalLM, source: int, target: int) -> None:
    """Give slot `target` the state of slot `source`: a sample of n > 1 forks its prompt's."""
    for layer in deltanet_layers(model):
        layer.conv_slots[target] = layer.conv_slots[source]
        layer.recurrent_slots[target] = layer.recurrent_slots[source]
