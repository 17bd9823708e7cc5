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

import torch

from kernels import ops
from kernels.modules import FP4Linear, QuantizedWeight
from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import CausalLM, pack_for_inference
from serving.model.config import ModelConfig
from serving.model.graphs import cuda_graphs
from serving.model.graphs.cuda_graphs import CUDAGraphs
from serving.model.graphs.decode import DecodeGraphs
from serving.model.hybrid.config import HybridConfig
from serving.model.spans import TokenSpan, prepare_spans


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block in every layer, MTP layers included."""
    layers = config.num_hidden_layers + (config.mtp.num_layers if config.mtp else 0)
    return layer_kv_bytes_per_block(config, block_size, dtype) * layers


def layer_kv_bytes_per_block(
    config: ModelConfig | HybridConfig, block_size: int, dtype: torch.dtype
) -> int:
    """Keys and values of one block in one attention layer."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize * block_size


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
        these padded batch sizes: on a GPU as CUDA graphs (`CUDAGraphs`, captured here), on a
        CPU with inductor (`DecodeGraphs`, in the background, the larger ones in the process
        `compile_apart` starts where it is given). None runs every step eagerly, and so does
        a CPU model with FP4 linear layers (its CPU path dequantizes in Python, which a graph
        would trace into a slow fused loop); FP4 experts are an opaque op there."""
        self.model = model
        self.block_size = block_size
        cfg = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device  # the cache and inputs go there too
        dtype = kv_cache_dtype or self.dtype
        captured = cuda_graphs.captured_on(self.device)
        if not captured and any(isinstance(m, FP4Linear) for m in model.modules()):
            graph_sizes = None
        # Compiled steps pad their batch with rows that write to one extra, unowned block.
        shape = (num_blocks + bool(graph_sizes), block_size, cfg.num_key_value_heads, cfg.head_dim)
        pack_for_inference(model, decoder_layers=not graph_sizes or captured)
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
        self.graphs: DecodeGraphs | CUDAGraphs | None = None
        if graph_sizes:
            max_blocks = min(num_blocks, -(-cfg.max_position_embeddings // block_size))
            if captured:
                self.graphs = CUDAGraphs(model, block_size, max_blocks, num_blocks, graph_sizes)
            else:
                self.graphs = DecodeGraphs(
                    model, block_size, max_blocks, num_blocks, graph_sizes, compile_apart
                )

    def prepare(
        self, spans: list[TokenSpan]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`prepare_spans` on this model's cache."""
        return prepare_spans(spans, self.block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, spans: list[TokenSpan]) -> torch.Tensor:
        """Final hidden states of every token of the spans (decodes must come first): in
        the compiled graphs where the step fits them, else eagerly."""
        if self.graphs is not None and self.graphs.fits(spans):
            return self.graphs.run(spans)
        input_ids, positions, meta = self.prepare(spans)
        return self.model(input_ids, positions, meta)
