"""An engine's cache and paged model for a hybrid model, and what the family does not do yet.

Its memory budget goes to DeltaNet state slots first, one per sequence that may run
(`max_num_seqs`), and the rest to KV blocks for the full-attention layers alone, so a hybrid
model holds several times the context of a full-attention one in the same budget. It runs
eagerly and without prefix caching (a cached block would need the DeltaNet state at its
boundary, which is not kept). Speculative decoding keeps, in a verify step, the DeltaNet
state after every draft, and the sequence keeps the one after its last accepted token (a
DeltaNet state cannot drop rejected drafts as a KV cache does); n-gram and draft-model
drafters, not MTP, whose layers the family's checkpoints do not carry here.
"""

import logging

import torch

from serving.engine.block_manager import BlockManager
from serving.engine.engine_config import EngineConfig
from serving.engine.state_slots import StateSlots
from serving.model.hybrid.model import HybridCausalLM
from serving.model.hybrid.paged import PagedHybridModel, hybrid_kv_bytes_per_block
from serving.model.hybrid.slots import state_bytes_per_slot

log = logging.getLogger(__name__)


def check_num_blocks(num_blocks: int, budget: int) -> int:
    if num_blocks < 1:
        raise ValueError(f"a KV cache budget of {budget} bytes is too small for one block")
    return num_blocks


def hybrid_parts(
    model: HybridCausalLM,
    config: EngineConfig,
    budget: int,
    kv_dtype: torch.dtype,
) -> tuple[PagedHybridModel, BlockManager, StateSlots]:
    """The paged model, block manager and state slots of an engine serving `model` in
    `budget` bytes of cache."""
    if config.speculative is not None and config.speculative.method == "mtp":
        raise ValueError(
            "MTP speculative decoding is not supported for hybrid (Qwen3-Next) models: their "
            "MTP layers are not loaded; use method ngram or draft"
        )
    if not config.enforce_eager:
        log.info("hybrid (Qwen3-Next) model: every step runs eagerly (no compiled decode steps)")
    if config.enable_prefix_caching:
        log.info("hybrid (Qwen3-Next) model: prefix caching is off")
    num_slots = config.max_num_seqs
    slot_bytes = num_slots * state_bytes_per_slot(model.config, model.embed_tokens.weight.dtype)
    per_block = hybrid_kv_bytes_per_block(model.config, config.block_size, kv_dtype)
    num_blocks = check_num_blocks((budget - slot_bytes) // per_block, budget)
    paged = PagedHybridModel(model, num_blocks, config.block_size, num_slots, kv_dtype)
    blocks = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
    return paged, blocks, StateSlots(num_slots)
