"""A hybrid model over the engine's caches: one forward pass for a mixed batch of token spans.

Its full-attention layers keep keys and values in the paged KV cache, attended exactly as the
MoE family's (`serving/model/attention.py`); its DeltaNet layers keep each running sequence's
fixed-size state in a slot (`slots.py`). A span carries both its block table and its slot.

Every step runs eagerly: no compiled decode steps or CUDA graphs are built for this family, so
an engine serving it behaves as with `--enforce-eager`.
"""

import torch

from kernels import ops
from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import pack_for_inference
from serving.model.hybrid.batch import slot_groups
from serving.model.hybrid.config import FULL, HybridConfig
from serving.model.hybrid.model import HybridCausalLM
from serving.model.hybrid.slots import attach_slots, copy_slot, deltanet_layers, reset_slots
from serving.model.paged import layer_kv_bytes_per_block
from serving.model.spans import TokenSpan, long_tensor, prepare_spans


def hybrid_kv_bytes_per_block(config: HybridConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block in every full-attention layer (DeltaNet layers have none)."""
    layers = sum(1 for kind in config.layer_types if kind == FULL)
    return layer_kv_bytes_per_block(config, block_size, dtype) * layers


class PagedHybridModel:
    """Takes a `HybridCausalLM` over for inference: its weights are packed and frozen
    (`pack_for_inference`), KV cache tensors go on its full-attention layers and `num_slots`
    state slots on its DeltaNet layers."""

    graphs = None  # no compiled decode steps: the engine's warm-up has nothing to wait for

    def __init__(
        self,
        model: HybridCausalLM,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        cfg = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        for layer in model.layers:
            if not layer.is_linear:
                dtype = kv_cache_dtype or self.dtype
                layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
                layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        attach_slots(model, num_slots)
        pack_for_inference(model)  # as the MoE family's eager steps read their weights
        # Built at the start rather than in the first request's step (`PagedModel` does too).
        ops.has_paged_decode_attention(self.device)

    def fork(self, parent_slot: int, child_slot: int, block_copies: list[tuple[int, int]]) -> None:
        """Give a sample forking its request's prompt (n > 1) the parent's state and the parent's
        partly filled KV blocks ((source, destination) pairs); the full ones it shares."""
        copy_slot(self.model, parent_slot, child_slot)
        if block_copies:
            source, target = (
                self._tensor(list(blocks)) for blocks in zip(*block_copies, strict=True)
            )
            for layer in self.model.layers:
                if not layer.is_linear:
                    for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                        cache.index_copy_(0, target, cache.index_select(0, source))

    def prepare(
        self, spans: list[TokenSpan]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return prepare_spans(spans, self.block_size, self.dtype, self.device)

    def _tensor(self, values: list) -> torch.Tensor:
        return long_tensor(self.device, values)

    @torch.inference_mode()
    def forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        """Final hidden states of every token of the spans (single tokens first). A span at
        position 0 starts its sequence, from a zeroed slot."""
        slots = [s.state_slot for s in spans]
        if None in slots:
            raise ValueError("every span of a hybrid model needs a state slot")
        fresh = [s.state_slot for s in spans if s.start == 0]
        if fresh:
            reset_slots(self.model, fresh)
        ids, positions, meta = self.prepare(spans)
        lengths = [len(s.token_ids) for s in spans]
        groups = slot_groups(lengths, slots, [s.num_drafts > 0 for s in spans], self.device)
        return self.model.forward_paged(ids, positions, meta, groups)

    def keep_verified(self, slot: int, tokens: int) -> None:
        """After a verify step, the sequence in `slot` keeps its state after the step's first
        `tokens` tokens (its last token and the drafts accepted), not after every draft."""
        for layer in deltanet_layers(self.model):
            layer.keep_verified(slot, tokens)
