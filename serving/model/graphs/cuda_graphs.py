"""Decode steps replayed from CUDA graphs, as vLLM and nano-vllm do: a decode step of a small
model is dozens of kernel launches per layer, and on a GPU launching them costs more than
running them. Each graph is the model's forward over B decodes (one token per sequence),
captured once at padded batch sizes (vLLM's: 1, 2, 4, 8, then multiples of 8) into static
input buffers; a step of n decodes replays the smallest graph with B >= n.

Padded rows are real rows of the graph: they read and write one spare KV cache block that the
block manager never hands out, with context length 1, so they touch no sequence's cache.
Steps with prefill or speculative chunks, or more decodes than the largest graph, run eagerly.
`--enforce-eager` turns capture off. The paged model (`serving/model/paged.py`) builds these
on a GPU and `DecodeGraphs` on a CPU, and asks either whether a step fits.

Capture needs CUDA, and the forward it captures must not read back to the host: on CUDA the
experts run in the Triton fused MoE and attention in the Triton paged kernel (both sync-free);
`loadtests/gpu_check.py` runs the captured engine against the eager one and transformers.
"""

import torch

from serving.model.attention import AttentionMetadata
from serving.model.causal_lm import CausalLM
from serving.model.spans import TokenSpan, prepare_spans

# vLLM's largest capture size: bigger decode batches run eagerly (launches matter less there).
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's padded batch sizes up to `max_batch` (which is always one of them), capped at
    MAX_CAPTURE_SIZE."""
    top = min(max_batch, MAX_CAPTURE_SIZE)
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return [*sizes, top]


class CUDAGraphs:
    """Captured decode forwards of one model over its KV cache, one per padded batch size:
    the GPU's side of the interface `DecodeGraphs` offers a CPU (`fits`, `run`)."""

    def __init__(
        self, model: CausalLM, block_size: int, max_blocks: int, spare_block: int, sizes: list[int]
    ) -> None:
        """Captures the decode forward of `model` (on CUDA) at `sizes` (`capture_sizes`);
        `max_blocks` is the most blocks a sequence can hold, `spare_block` the cache block
        padded rows write to."""
        self.model = model
        self.block_size = block_size
        self.sizes = sizes
        self.spare_block = spare_block
        self.spare_slot = spare_block * block_size
        weight = model.embed_tokens.weight
        rows, device, long = sizes[-1], weight.device, torch.long
        self.input_ids = torch.zeros(rows, dtype=long, device=device)
        self.positions = torch.zeros(rows, dtype=long, device=device)
        self.slots = torch.full((rows,), self.spare_slot, dtype=long, device=device)
        self.tables = torch.full((rows, max_blocks), spare_block, dtype=long, device=device)
        self.context_lens = torch.ones(rows, dtype=long, device=device)
        hidden = model.config.hidden_size
        self.hidden = torch.zeros(rows, hidden, dtype=weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for size in reversed(sizes):  # the largest first, so the others share its pool
            graph = torch.cuda.CUDAGraph()
            self._forward(size)  # warm-up: compiles the Triton kernels for this size
            with torch.cuda.graph(graph, pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    @torch.inference_mode()
    def _forward(self, size: int) -> None:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decodes=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.context_lens[:size],
        )
        self.hidden[:size] = self.model(self.input_ids[:size], self.positions[:size], meta)

    def fits(self, spans: list[TokenSpan]) -> bool:
        """Decodes only, no more than the largest graph holds, block tables that fit."""
        width = self.tables.shape[1]
        return len(spans) <= self.sizes[-1] and all(
            len(s.token_ids) == 1 and len(s.block_table) <= width for s in spans
        )

    @torch.inference_mode()
    def run(self, spans: list[TokenSpan]) -> torch.Tensor:
        """The final hidden states of the spans' tokens, as an eager forward gives them."""
        n = len(spans)
        size = next(b for b in self.sizes if b >= n)
        weight = self.model.embed_tokens.weight
        input_ids, positions, meta = prepare_spans(
            spans, self.block_size, weight.dtype, weight.device
        )
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slots[:n] = meta.slot_mapping
        self.tables[:n, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
        self.context_lens[:n] = meta.decode_context_lens
        # Rows a previous, larger step filled must not write to its sequences' slots again.
        self.slots[n:size] = self.spare_slot
        self.tables[n:size, 0] = self.spare_block
        self.context_lens[n:size] = 1
        self.graphs[size].replay()
        return self.hidden[:n].clone()  # the next replay overwrites the static output


def captured_on(device: torch.device) -> bool:
    """Whether a paged model on `device` replays CUDA graphs (or, elsewhere, compiles
    `DecodeGraphs`) where it compiles decode steps at all."""
    return device.type == "cuda"
