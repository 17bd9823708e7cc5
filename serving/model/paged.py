"""The model over a paged KV cache: one forward pass for a mixed batch of token spans.

Owns the KV cache tensors (one [blocks, block_size, kv_heads, head_dim] pair per layer, MTP
layers included) and attaches them to the model's attention modules. A span is a sequence's
tokens at consecutive positions with its block table; decodes (one token) go first and share
one batched attention call, prefill chunks of different sequences and speculative chunks
(the last token and its drafts) share the same forward pass. The engine's model runner
samples from it; a draft model runs on one of its own, and the MTP drafter reuses the
target's.
"""

import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import ops
from kernels.modules import FP4Linear, QuantizedWeight
from serving.model.attention import (
    SHORT_CHUNK,
    AttentionMetadata,
    PrefillChunk,
    ShortChunks,
    padded_tables,
)
from serving.model.causal_lm import CausalLM, pack_for_inference
from serving.model.config import ModelConfig
from serving.model.decode_graphs import DecodeGraphs
from serving.model.hybrid.config import HybridConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block in every layer, MTP layers included."""
    layers = config.num_hidden_layers + (config.mtp.num_layers if config.mtp else 0)
    return layer_kv_bytes_per_block(config, block_size, dtype) * layers


def layer_kv_bytes_per_block(
    config: ModelConfig | HybridConfig, block_size: int, dtype: torch.dtype
) -> int:
    """Keys and values of one block in one attention layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize * block_size


@dataclass
class TokenSpan:
    """A sequence's tokens in one forward pass: `token_ids` at positions `start`, `start + 1`..."""

    block_table: list[int]
    start: int
    token_ids: list[int]
    state_slot: int | None = None  # a hybrid model's DeltaNet state slot (`hybrid/slots.py`)
    num_drafts: int = 0  # the last of `token_ids` that are drafts to verify


def prepare_spans(
    spans: list[TokenSpan], block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat input ids, positions and attention metadata on the model's device; single
    tokens (decodes) first. Built from host lists, one copy to the device per tensor."""
    bs = block_size
    nd = 0
    while nd < len(spans) and len(spans[nd].token_ids) == 1:
        nd += 1
    ids = [s.token_ids[0] for s in spans[:nd]]
    positions = [s.start for s in spans[:nd]]
    slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in spans[:nd]]
    tables = lens = None
    if nd:
        tables = padded_tables([s.block_table for s in spans[:nd]], device)
        lens = long_tensor(device, [p + 1 for p in positions])
    prefills: list[PrefillChunk] = []
    short: list[tuple[TokenSpan, int]] = []
    for s in spans[nd:]:
        n = len(s.token_ids)
        if n <= SHORT_CHUNK:
            short.append((s, len(ids)))
        else:
            prefills.append(
                PrefillChunk(len(ids), n, s.start + n, long_tensor(device, s.block_table))
            )
        ids.extend(s.token_ids)
        positions.extend(range(s.start, s.start + n))
        slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(s.start, s.start + n))
    meta = AttentionMetadata(
        slot_mapping=long_tensor(device, slots),
        num_decodes=nd,
        decode_block_tables=tables,
        decode_context_lens=lens,
        prefills=prefills,
    )
    if short:
        meta.short = ShortChunks.build(
            [s.start for s, _ in short],
            [len(s.token_ids) for s, _ in short],
            [offset for _, offset in short],
            [s.block_table for s, _ in short],
            bs,
            dtype,
            device,
        )
    meta.prepare(bs, dtype, device)
    return long_tensor(device, ids), long_tensor(device, positions), meta


def long_tensor(device: torch.device, values: list) -> torch.Tensor:
    """Host ints as one long tensor on the device: a step's ids, positions and tables."""
    return torch.tensor(values, dtype=torch.long, device=device)


def graph_rows(spans: list[TokenSpan]) -> tuple[list[int], list[int], list[list[int]]]:
    """A compiled step's rows, one a token: ids, positions and each row's block table."""
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    for s in spans:
        ids += s.token_ids
        positions += range(s.start, s.start + len(s.token_ids))
        tables += [s.block_table] * len(s.token_ids)
    return ids, positions, tables


class PagedModel:
    """Takes the model over for inference: its weights are packed (`pack_for_inference`; the
    decoder layers' only where no compiled decode step reads them) and frozen, and KV cache
    tensors are attached to its attention modules (MTP layers too)."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        graph_sizes: list[int] | None = None,
        compile_apart: Callable[[], subprocess.Popen] | None = None,
    ) -> None:
        """`kv_cache_dtype`: default, the model's. `graph_sizes`: compile decode steps at
        these padded batch sizes (`DecodeGraphs`, in the background, the larger ones in the
        process `compile_apart` starts where it is given); None runs every step
        eagerly, and so does a model with FP4 linear layers (its CPU path dequantizes in
        Python, which a graph would trace into a slow fused loop); FP4 experts are an opaque
        op there."""
        self.model = model
        self.block_size = block_size
        cfg = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device  # the cache and inputs go there too
        dtype = kv_cache_dtype or self.dtype
        if any(isinstance(m, FP4Linear) for m in model.modules()):
            graph_sizes = None
        # Compiled steps pad their batch with rows that write to one extra, unowned block.
        shape = (num_blocks + bool(graph_sizes), block_size, cfg.num_key_value_heads, cfg.head_dim)
        pack_for_inference(model, decoder_layers=not graph_sizes)
        blocks = [*model.layers, *(mtp.block for mtp in model.mtp)]
        for layer in blocks:
            attn = layer.self_attn
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.qk_norm_weight = torch.cat(
                (
                    attn.q_norm.weight.detach().expand(attn.num_heads, -1),
                    attn.k_norm.weight.detach().expand(attn.num_kv_heads, -1),
                )
            )
        # The CPU's C++ ops are compiled on their first use (about 10 s on a machine that
        # never built them): at the start, not in the first request's step, nor inside a
        # graph's trace, which cannot follow the lock that guards the build.
        ops.has_paged_decode_attention(self.device)
        if any(isinstance(m, QuantizedWeight) for m in model.modules()):
            ops.has_fp4_kernels(self.device)
        self.graphs = None
        if graph_sizes:
            max_blocks = min(num_blocks, -(-cfg.max_position_embeddings // block_size))
            self.graphs = DecodeGraphs(
                model, block_size, max_blocks, num_blocks, graph_sizes, compile_apart
            )

    def prepare(
        self, spans: list[TokenSpan]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`prepare_spans` on this model's cache."""
        return prepare_spans(spans, self.block_size, self.dtype, self.device)

    def _tensor(self, values: list) -> torch.Tensor:
        return long_tensor(self.device, values)

    @torch.inference_mode()
    def forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        """Final hidden states of every token of the spans (decodes must come first).

        A step of few tokens (decodes, drafts to verify, a short chunk) runs in a compiled
        decode graph, one row per token: every row's key and value are written before any
        row attends, and each row attends up to its own position, so the tokens of one span
        see each other causally, as in a prefill."""
        graphs = self.graphs
        if graphs is not None and graphs.fits(
            sum(len(s.token_ids) for s in spans), max(len(s.block_table) for s in spans)
        ):
            return graphs.run(*graph_rows(spans))
        input_ids, positions, meta = self.prepare(spans)
        return self.model(input_ids, positions, meta)
