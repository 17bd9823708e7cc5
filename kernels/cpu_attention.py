"""Decode attention over the paged KV cache on a CPU: a C++ op (`csrc/paged_attention.cpp`)
that reads each sequence's keys and values through its block table where they lie, as the
Triton kernel does on a GPU and vLLM's CPU backend does in its own C++.

It replaced SDPA's flash kernel on a gathered copy of the cache (`index_select` of every
block, then one batched call) with cascade attention for decodes sharing prompt blocks: at the
rollouts' shape (many decodes of a few hundred keys) the copies cost nearly as much as the
attention itself (`python loadtests/bench_rollouts.py` measures the rollouts).

The op is built on first use by `kernels/cpu_extension.py`, for the machine's instruction set.
"""

import torch

from kernels import cpu_extension


def _register_fake() -> None:
    """What the op returns, for the compiled decode steps that call it (`torch.compile`)."""
    torch.library.register_fake("tierserve_cpu::paged_decode_attention")(
        lambda q, k_cache, v_cache, block_tables, context_lens, scale: torch.empty_like(q)
    )


LIBRARY = cpu_extension.Library(
    _register_fake,
    "decode attention runs as SDPA over gathered blocks instead, slower",
)
# Builds or loads the op once a process; False, with one warning, where it cannot be built
# (then `serving/model/attention.py` gathers the blocks for SDPA).
available = cpu_extension.built_once(LIBRARY)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, d] (one token per sequence), caches [blocks, block_size, kv_heads, d] in
    fp32, bf16 or fp16, block_tables [B, max_blocks] (padding never read), context_lens [B]
    (each >= 1) -> [B, heads, d] in q's dtype; scores and sums in fp32."""
    out = torch.ops.tierserve_cpu.paged_decode_attention(
        q.float().contiguous(), k_cache, v_cache, block_tables, context_lens, scale
    )
    return out.to(q.dtype)
