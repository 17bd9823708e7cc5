"""Triton building blocks shared by the FP4 kernels: decoding E2M1 codes and block scales,
and loading one dequantized weight tile.

Weights are `[N, K]` row-major FP4 (`packed [N, K/2]` uint8, `scales [N, K/block]` uint8),
the layout of `kernels/formats.py`. A tile is returned as its even and odd K elements
separately, each `[BLOCK_KP, BLOCK_N]`, so the product needs no nibble interleave:
`x @ W.t() = x[:, 0::2] @ even + x[:, 1::2] @ odd`.
"""

import triton
import triton.language as tl


@triton.jit
def e2m1_value(code):
    """fp32 value of E2M1 codes (int32, 0..15): sign, 2-bit exponent (bias 1), 1 mantissa bit."""
    exp = (code >> 1) & 3
    mant = (code & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mant) * tl.exp2((exp - 1).to(tl.float32))
    mag = tl.where(exp == 0, 0.5 * mant, normal)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def block_scale_value(bits, IS_NVFP4: tl.constexpr):
    """fp32 value of scale bytes (int32): FP8 E4M3 (NVFP4) or E8M0 (MXFP4); NaN codes give NaN."""
    if IS_NVFP4:
        exp = (bits >> 3) & 15
        mant = (bits & 7).to(tl.float32)
        mag = tl.where(
            exp == 0,
            mant * 0.001953125,  # subnormal: mant / 8 * 2^-6
            (1.0 + mant * 0.125) * tl.exp2((exp - 7).to(tl.float32)),
        )
        mag = tl.where((bits & 0x7F) == 0x7F, float("nan"), mag)
        return tl.where((bits & 0x80) != 0, -mag, mag)
    else:
        value = tl.exp2((bits - 127).to(tl.float32))
        return tl.where(bits == 255, float("nan"), value)


@triton.jit
def fp4_weight_tile(
    w_ptr,
    s_ptr,
    offs_n,
    offs_kp,
    n_rows,
    kp,
    stride_wn,
    stride_sn,
    BLOCK: tl.constexpr,
    IS_NVFP4: tl.constexpr,
):
    """Even and odd K elements of rows `offs_n`, packed columns `offs_kp`, dequantized with
    their block scales (not the row scale), each `[BLOCK_KP, BLOCK_N]`; zero out of bounds."""
    mask = (offs_n[None, :] < n_rows) & (offs_kp[:, None] < kp)
    packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_kp[:, None], mask=mask, other=0)
    packed = packed.to(tl.int32)
    scale_ptrs = s_ptr + offs_n[None, :] * stride_sn + (offs_kp[:, None] * 2) // BLOCK
    scale = block_scale_value(tl.load(scale_ptrs, mask=mask, other=0).to(tl.int32), IS_NVFP4)
    scale = tl.where(mask, scale, 0.0)
    return e2m1_value(packed & 15) * scale, e2m1_value(packed >> 4) * scale


@triton.jit
def activation_pair(a_ptr, rows, row_mask, offs_kp, k, stride_am):
    """Even and odd columns `2 * offs_kp (+1)` of rows `rows`, each `[BLOCK_M, BLOCK_KP]`."""
    base = a_ptr + rows[:, None] * stride_am + 2 * offs_kp[None, :]
    even = tl.load(base, mask=row_mask[:, None] & (2 * offs_kp[None, :] < k), other=0.0)
    odd = tl.load(base + 1, mask=row_mask[:, None] & (2 * offs_kp[None, :] + 1 < k), other=0.0)
    return even, odd
