"""Which implementation runs each kernel op, decided in one place by the device of the
tensors: Triton on CUDA, the PyTorch paths (`kernels/reference.py`, SDPA, BLAS) elsewhere.

- FP4 linears: `w4a16_linear` (Triton) or `reference.fp4_linear`;
- experts (FP4 or plain): `fused_moe` (Triton) or the reference / grouped PyTorch experts;
- decode attention over the paged KV cache: `paged_decode_attention` (Triton) or SDPA on the
  gathered cache.

Callers branch on `use_triton` and call the Triton ops through here, so a test can force the
Triton side on a CPU under `TRITON_INTERPRET=1` by patching `use_triton`. Nothing falls back
quietly: a Triton op that cannot run raises.
"""

import torch

from kernels import reference
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
    """The Triton paged decode attention: `kernels.triton_attention.paged_decode_attention`."""
    from kernels.triton_attention import paged_decode_attention

    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
