"""Fused W4A16 dequant-GEMM in Triton: `y = x @ W.t()` with x bf16/fp16/fp32 `[M, K]` and W
an FP4 weight `[N, K]` (MXFP4 or NVFP4), dequantized tile by tile in registers, so only the
4-bit codes and their scales cross memory.

Decode (M <= 16) is bound by reading W: small M tiles, wide K tiles. Prefill is bound by
compute: square tiles. Tested against `kernels/reference.py` under `TRITON_INTERPRET=1`.
"""

import torch
import triton
import triton.language as tl

from kernels.formats import FP4Tensor
from kernels.triton_fp4 import activation_pair, fp4_weight_tile

# (BLOCK_M, BLOCK_N, BLOCK_KP = packed bytes per K step, num_warps)
DECODE_CONFIG = (16, 64, 64, 4)
PREFILL_CONFIG = (64, 64, 32, 4)


@triton.jit
def _w4a16_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    rs_ptr,
    c_ptr,
    M,
    N,
    K,
    KP,
    stride_am,
    stride_wn,
    stride_sn,
    stride_cm,
    BLOCK: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, KP, BLOCK_KP):
        offs_kp = start + tl.arange(0, BLOCK_KP)
        even, odd = activation_pair(a_ptr, offs_m, offs_m < M, offs_kp, K, stride_am)
        w_even, w_odd = fp4_weight_tile(
            w_ptr, s_ptr, offs_n, offs_kp, N, KP, stride_wn, stride_sn, BLOCK, IS_NVFP4
        )
        acc += tl.dot(even, w_even.to(even.dtype), input_precision=PRECISION)
        acc += tl.dot(odd, w_odd.to(odd.dtype), input_precision=PRECISION)
    if IS_NVFP4:
        acc *= tl.load(rs_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs multiply in full precision (not TF32), to match the reference; 16-bit
    inputs take Triton's default."""
    return "ieee" if dtype == torch.float32 else None


def w4a16_gemm(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """x [M, K] @ W.t() -> [M, N] in x's dtype."""
    m, k = x.shape
    if k != w.k or w.packed.dim() != 2:
        raise ValueError(f"x [{m}, {k}] does not match an FP4 weight of shape {tuple(w.shape)}")
    x = x.contiguous()
    n, kp = w.packed.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_kp, warps = DECODE_CONFIG if m <= 16 else PREFILL_CONFIG
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    row_scale = w.row_scale if w.row_scale is not None else w.packed  # unread for MXFP4
    _w4a16_kernel[grid](
        x, w.packed, w.scales, row_scale, out,
        m, n, k, kp,
        x.stride(0), w.packed.stride(0), w.scales.stride(0), out.stride(0),
        BLOCK=w.block_size, IS_NVFP4=w.format == "nvfp4",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
        PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    return out


def w4a16_linear(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """`F.linear` over any leading dimensions."""
    return w4a16_gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)
