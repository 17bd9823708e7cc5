"""Attention over a paged KV cache, for a batch mixing decodes and prefill chunks.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A sequence owns a list of blocks (its block table); token `i` of the sequence lives in
block `table[i // block_size]` at offset `i % block_size`. New keys and values are written
at `slot_mapping` (flat slot = block * block_size + offset) before attention reads them.

Tokens of a step are laid out decodes first (one token per sequence, batched into one
attention call), then chunks. Short chunks (at most `SHORT_CHUNK` tokens: a last token and
its speculative drafts, the tail of a prompt) are batched into one more call, padded to
the longest; longer prefill chunks get one call each. Chunks see the cached prefix and
themselves, causally.

Decodes read their blocks in place (`kernels.ops.paged_decode_attention`: Triton on a GPU,
a C++ op on a CPU); chunks, and decodes where the C++ op cannot be built, gather their blocks
into one tensor for SDPA.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kernels import ops

SHORT_CHUNK = 16


def padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one [B, longest] long tensor, padded with block 0 (masked off).

    Built through numpy, which converts a list of ints several times faster than
    `torch.tensor` does: a long context's table is hundreds of blocks a sequence, every step."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return torch.from_numpy(out).to(device)


def length_mask(lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, width] additive mask hiding key slots at and past each of `lens` [B].
    Additive rather than boolean: SDPA's CPU kernel takes it faster."""
    valid = torch.arange(width, device=lens.device) < lens[:, None]
    mask = torch.zeros(valid.shape, dtype=dtype, device=lens.device)
    return mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]


@dataclass
class ShortChunks:
    """Chunks of a few tokens attended as one padded batch of B chunks of up to L tokens."""

    token_index: torch.Tensor  # [B, L] long: each query row's token in the step, padded with 0
    valid: torch.Tensor  # [B, L] bool: the rows that are real tokens
    block_tables: torch.Tensor  # [B, max_blocks] long, padded
    mask: torch.Tensor  # [B, 1, L, max_blocks * block_size] additive, causal per chunk
    grouped: dict[int, torch.Tensor] = field(default_factory=dict)  # the mask per GQA group

    @classmethod
    def build(
        cls, starts: list[int], lengths: list[int], offsets: list[int], tables: list[list[int]],
        block_size: int, dtype: torch.dtype, device: torch.device,
    ) -> "ShortChunks":  # fmt: skip
        width = max(map(len, tables))
        rows = max(lengths)
        pos = torch.arange(rows, device=device)
        lens = torch.tensor(lengths, device=device)
        valid = pos[None, :] < lens[:, None]
        token_index = (torch.tensor(offsets, device=device)[:, None] + pos[None, :]) * valid
        # Query i of a chunk starting at s sees keys 0..s+i; padded rows see a prefix, harmlessly.
        last_key = torch.tensor(starts, device=device)[:, None] + pos[None, :]
        keys = torch.arange(width * block_size, device=device)
        mask = torch.zeros(len(starts), rows, len(keys), dtype=dtype, device=device)
        mask.masked_fill_(keys[None, None, :] > last_key[:, :, None], float("-inf"))
        return cls(token_index, valid, padded_tables(tables, device), mask[:, None])

    def mask_for(self, group: int) -> torch.Tensor:
        """[B, 1, L * group, keys]: each query row repeated for the heads sharing a kv head."""
        if group not in self.grouped:
            self.grouped[group] = self.mask.repeat_interleave(group, dim=2)
        return self.grouped[group]


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the step's flat token array
    length: int  # tokens in the chunk
    context_len: int  # tokens of the sequence in the cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_sequence] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long, padded
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long
    prefills: list[PrefillChunk] = field(default_factory=list)
    short: ShortChunks | None = None
    # Built once per step for SDPA's decode attention: additive mask hiding padded cache slots.
    decode_mask: torch.Tensor | None = None
    # A compiled decode step (`graph_decode_attention`), the block tables as wide as the
    # longest context needs; attention there is the paged decode op where it is built
    # (`paged_kernel`), else written out in the graph.
    in_graph: bool = False
    paged_kernel: bool = False

    def prepare(self, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Precompute what every layer would otherwise rebuild; masks in the queries' dtype.
        The decode mask is for SDPA only: the paged kernels read the context lengths."""
        if self.num_decodes and not ops.has_paged_decode_attention(device):
            width = self.decode_block_tables.shape[1] * block_size
            self.decode_mask = length_mask(self.decode_context_lens, width, dtype)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's keys and values ([T, kv_heads, head_dim]) at their slots, in the
    cache's dtype (`--kv-cache-dtype`)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, max_blocks] block ids -> keys or values [B, kv_heads, max_blocks * block_size, d]
    in the queries' `dtype`.

    index_select on the flattened table: several times faster on CPU than advanced indexing.
    """
    b = block_tables.shape[0]
    g = cache.index_select(0, block_tables.flatten())  # [B * max_blocks, block_size, kv, d]
    return g.view(b, -1, *cache.shape[2:]).transpose(1, 2).to(dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim], reading keys and values from the cache."""
    nd = meta.num_decodes
    out = torch.empty_like(q) if meta.prefills or meta.short else None
    if nd:
        o = decode_attention(
            q[:nd],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_mask,
            scale,
        )
        if out is None:  # a decode-only step, the common case
            return o
        out[:nd] = o
    if meta.short is not None:
        _short_attention(q, k_cache, v_cache, meta.short, scale, out)
    for chunk in meta.prefills:
        ctx = chunk.context_len
        k = _gather(k_cache, chunk.block_table[None], q.dtype)[:, :, :ctx]  # [1, kv, ctx, d]
        v = _gather(v_cache, chunk.block_table[None], q.dtype)[:, :, :ctx]
        qc = q[None, chunk.start : chunk.start + chunk.length].transpose(1, 2)  # [1, heads, L, d]
        q_pos = torch.arange(ctx - chunk.length, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]  # causal
        # Batched (4-D) inputs: unbatched ones take SDPA's math path on a CPU, several times
        # slower than its flash kernel at prefill chunk sizes.
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.start + chunk.length] = o[0].transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, q [B, heads, d] -> [B, heads, d]: the paged kernel of
    `kernels/ops.py` (Triton on CUDA, C++ on a CPU), else SDPA on the gathered cache.

    SDPA reads only the blocks the longest context needs: `block_tables` ([B, width]) and `mask`
    ([B, 1, 1, width * block_size], additive) may be wider (block tables padded to the longest
    one in the batch).
    """
    if ops.has_paged_decode_attention(q.device):
        return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    block_size = k_cache.shape[1]
    blocks = -(-int(context_lens.max()) // block_size)
    tables = block_tables[:, :blocks]
    k = _gather(k_cache, tables, q.dtype)  # [B, kv, ctx, d]
    v = _gather(v_cache, tables, q.dtype)
    # Put each kv head's query group where a query length goes, so SDPA needs no GQA
    # expansion of the keys.
    b, kv_heads = q.shape[0], k.shape[1]
    qd = q.view(b, kv_heads, -1, q.shape[-1])  # [B, kv, group, d]
    m = mask[..., : blocks * block_size]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=m, scale=scale)
    return o.view(b, -1, q.shape[-1])


def graph_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A compiled decode step's cache write and attention, q [B, heads, d], k and v
    [B, kv_heads, d] -> [B, heads, d]. The block tables' width is a dynamic dimension of the
    graph, so one graph serves every context length.

    Attention is the paged decode op where it is built (`meta.paged_kernel`): an opaque call
    in the graph that reads keys and values in place. Otherwise it is written out here, and
    inductor fuses the scores, softmax and weighted values into a few loops that read each key
    and value through the block table, with no gathered copy of the cache. The op is the
    faster of the two at every batch size (`loadtests/bench_engine.py --dtypes float32`)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    if meta.paged_kernel:
        return ops.paged_decode_attention(q, k_cache, v_cache, tables.contiguous(), lens, scale)
    b, width = tables.shape
    block_size, kv_heads, d = k_cache.shape[1:]
    offsets = torch.arange(block_size, device=q.device)
    keys = (tables[:, :, None] * block_size + offsets).view(b, width * block_size)
    kk = k_cache.view(-1, kv_heads, d)[keys][:, :, :, None, :].float()  # [B, S, kv, 1, d]
    vv = v_cache.view(-1, kv_heads, d)[keys][:, :, :, None, :].float()
    qd = q.view(b, 1, kv_heads, -1, d).float()  # [B, 1, kv, group, d]
    scores = (qd * kk).sum(-1) * scale  # [B, S, kv, group], fp32 as SDPA's CPU kernel
    hidden = torch.arange(width * block_size, device=q.device) >= lens[:, None]
    probs = scores.masked_fill(hidden[:, :, None, None], float("-inf")).softmax(dim=1)
    o = (probs[..., None] * vv).sum(1)  # [B, kv, group, d]
    return o.to(q.dtype).view(b, -1, d)


def _short_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    short: ShortChunks,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One SDPA call for all short chunks; as for decodes, each kv head's query group goes
    where a query length goes (rows ordered by token, then head), so no GQA expansion."""
    k = _gather(k_cache, short.block_tables, q.dtype)  # [B, kv, ctx, d]
    v = _gather(v_cache, short.block_tables, q.dtype)
    b, rows = short.token_index.shape
    kv_heads, d = k.shape[1], q.shape[-1]
    group = q.shape[1] // kv_heads
    qs = q.index_select(0, short.token_index.flatten()).view(b, rows, kv_heads, group, d)
    qs = qs.transpose(1, 2).reshape(b, kv_heads, rows * group, d)
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=short.mask_for(group), scale=scale)
    o = o.view(b, kv_heads, rows, group, d).transpose(1, 2).reshape(b * rows, -1, d)
    valid = short.valid.flatten()
    out[short.token_index.flatten()[valid]] = o[valid]
