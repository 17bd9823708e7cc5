"""Decode attention over the paged KV cache in Triton: one query token per sequence reads its
keys and values block by block through its block table, never gathering them into a
contiguous copy (what the PyTorch path does before SDPA).

One program per (sequence, kv head) handles the kv head's whole query group (GQA), so each
key and value block is read once for all the heads that share it. Softmax is online (running
max and sum, as in FlashAttention), in fp32 whatever the cache dtype. Scores are formed by
broadcasting rather than `tl.dot`, because a group holds 1-8 heads, below the tensor cores'
smallest tile, and decode is bound by reading the cache anyway.

Tested against SDPA on the gathered cache (tests/kernels/test_paged_attention.py), under
`TRITON_INTERPRET=1` on a CPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_tb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)  # the query heads of this kv head
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    context_len = tl.load(lens_ptr + seq)
    m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), dtype=tl.float32)
    for index in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_tb + index).to(tl.int64)
        offsets = (
            block * stride_cb + slots[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        )
        slot_ok = index * BLOCK_SIZE + slots < context_len
        tile_ok = slot_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK]
        scores = tl.where(slot_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(
        out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, d] (one token per sequence), caches [blocks, block_size, kv_heads, d],
    block_tables [B, max_blocks] (padding past a sequence's blocks is never read),
    context_lens [B] (each >= 1) -> [B, heads, d] in q's dtype."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or block_size & (block_size - 1):
        raise ValueError("heads must be a multiple of kv_heads and block_size a power of two")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the key and value caches must share one layout, head_dim innermost")
    q = q.contiguous()
    out = torch.empty_like(q)
    group = heads // kv_heads
    _paged_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_PAD=triton.next_power_of_2(group),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out
