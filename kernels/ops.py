"""Which implementation runs each kernel op, decided in one place by the device of the
tensors: Triton on CUDA, the PyTorch paths (`kernels/reference.py`, SDPA, BLAS) elsewhere.

- FP4 linears: `w4a16_linear` (Triton) or `reference.fp4_linear`;
- experts (FP4 or plain): `fused_moe` (Triton) or the reference / grouped PyTorch experts;
- decode attention over the paged KV cache: `paged_decode_attention`, Triton on CUDA and the
  C++ op of `kernels/cpu_attention.py` on a CPU, or SDPA on the gathered cache where that op
  cannot be built (no C++ compiler; a warning says so).

Callers branch on `use_triton` and call the Triton ops through here, so a test can force the
Triton side on a CPU under `TRITON_INTERPRET=1` by patching `use_triton`. Nothing else falls
back: a Triton op that cannot run raises.
"""

import torch

from kernels import cpu_attention, reference
from kernels.formats import FP4Tensor


def use_triton(device: torch.device) -> bool:
    """The Triton kernels run on CUDA; any other device runs the PyTorch paths."""
    return device.type == "cuda"


def fp4_linear(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """`x [..., K] @ W.t()` for an FP4 weight `W [N, K]`."""
    if use_triton(x.device):
        from kernels.triton_gemm import w4a16_linear  # Triton is imported only where it runs

        return w4a16_linear(x, w)
    return reference.fp4_linear(x, w)


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: FP4Tensor | torch.Tensor,
    down: FP4Tensor | torch.Tensor,
) -> torch.Tensor:
    """The Triton fused MoE (FP4 or plain expert weights): `kernels.triton_moe.fused_moe`."""
    from kernels.triton_moe import fused_moe

    return fused_moe(x, topk_weights, topk_ids, gate_up, down)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its cache blocks, read in place: Triton
    (`kernels.triton_attention`) on CUDA, the C++ op (`kernels.cpu_attention`) on a CPU."""
    if use_triton(q.device):
        from kernels.triton_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return cpu_attention.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale
    )


def has_paged_decode_attention(device: torch.device) -> bool:
    """Whether `paged_decode_attention` runs on `device`: always on CUDA; on a CPU once its C++
    op is built (the first call builds it)."""
    return use_triton(device) or (device.type == "cpu" and cpu_attention.available())
