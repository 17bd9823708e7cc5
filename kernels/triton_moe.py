"""Fused MoE in Triton, over FP4 expert weights or plain (bf16/fp16/fp32) ones.

1. `align_by_expert`: token slots (token, k) sorted by expert, each expert's run padded to
   a multiple of BLOCK_M, so every row block of the grouped GEMM belongs to one expert.
   Buffers are sized for the worst case, so nothing is read back to the host.
2. Grouped GEMM 1, gate/up with SwiGLU fused: `h[slot] = silu(x[token] @ G_e.t()) *
   (x[token] @ U_e.t())`, both halves accumulated in the same program from the FP4
   `gate_up [E, 2I, H]`.
3. Grouped GEMM 2: `out[slot] = topk_weight[slot] * (h[slot] @ D_e.t())` with `down [E, H, I]`.
4. Scatter back: each token sums its k slots.

Plain weights take the same kernels with the dequantization left out, so a bf16 model and
its FP4 copy run one code path on CUDA, and neither reads anything back to the host (CUDA
graphs can capture both). Tested against `kernels/reference.fp4_moe` and the PyTorch grouped
experts under `TRITON_INTERPRET=1`.
"""

import torch
import triton
import triton.language as tl

from kernels.formats import FP4Tensor
from kernels.triton_fp4 import activation_pair, fp4_weight_tile
from kernels.triton_gemm import dot_precision

# (BLOCK_M, BLOCK_N, BLOCK_KP, num_warps): few slots per expert (decode) or many (prefill).
DECODE_CONFIG = (16, 64, 64, 4)
PREFILL_CONFIG = (64, 64, 32, 4)


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots, block_expert): slot ids grouped by expert, each group padded to a
    multiple of `block_m` with the sentinel `T * k`; the expert of each row block, -1 for
    blocks past the used ones (their programs exit at once)."""
    flat = topk_ids.flatten()
    num_slots = flat.numel()
    order = flat.argsort(stable=True)
    # Not bincount: on CUDA it reads the largest id back to the host.
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    expert_of_sorted = flat[order]
    rank = (
        torch.arange(num_slots, device=flat.device) - (counts.cumsum(0) - counts)[expert_of_sorted]
    )
    position = (padded.cumsum(0) - padded)[expert_of_sorted] + rank
    capacity = num_slots + num_experts * (block_m - 1)  # the most padding can ever add
    num_blocks = triton.cdiv(capacity, block_m)
    device = flat.device
    sorted_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=device)
    sorted_slots[position] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded.cumsum(0), block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


@triton.jit
def plain_weight_tile(w_ptr, offs_n, offs_kp, n_rows, k, stride_wn, stride_wk):
    """Even and odd K elements of rows `offs_n` of a plain weight, each `[BLOCK_KP, BLOCK_N]`
    (the shape `fp4_weight_tile` returns); zero out of bounds."""
    base = w_ptr + offs_n[None, :] * stride_wn + (2 * offs_kp[:, None]) * stride_wk
    rows = offs_n[None, :] < n_rows
    even = tl.load(base, mask=rows & (2 * offs_kp[:, None] < k), other=0.0)
    odd = tl.load(base + stride_wk, mask=rows & (2 * offs_kp[:, None] + 1 < k), other=0.0)
    return even, odd


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, offs_n, offs_kp, n_rows, k, kp, stride_wn, stride_wk, stride_sn,
    FP4: tl.constexpr, BLOCK: tl.constexpr, IS_NVFP4: tl.constexpr,
):  # fmt: skip
    if FP4:
        return fp4_weight_tile(
            w_ptr, s_ptr, offs_n, offs_kp, n_rows, kp, stride_wn, stride_sn, BLOCK, IS_NVFP4
        )
    else:
        return plain_weight_tile(w_ptr, offs_n, offs_kp, n_rows, k, stride_wn, stride_wk)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    rs_ptr,
    c_ptr,
    sorted_slots_ptr,
    block_expert_ptr,
    topk_weights_ptr,
    num_slots,
    N,
    K,
    KP,
    a_row_div,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_rse,
    stride_cm,
    FP4: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_NVFP4: tl.constexpr,
    SWIGLU: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KP: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """c[slot, n] for the slots of one row block, all of one expert. A row of `a` is
    `slot // a_row_div` (the token for GEMM 1, the slot itself for GEMM 2). With SWIGLU the
    weight has 2N rows, gate then up, and c = silu(gate) * up. K counts packed byte
    columns (KP) for FP4 weights and column pairs for plain ones."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    slots = tl.load(sorted_slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = slots // a_row_div
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptr += expert.to(tl.int64) * stride_we
    s_ptr += expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, KP, BLOCK_KP):
        offs_kp = start + tl.arange(0, BLOCK_KP)
        even, odd = activation_pair(a_ptr, rows, valid, offs_kp, K, stride_am)
        w_even, w_odd = _weight_tile(
            w_ptr, s_ptr, offs_n, offs_kp, N, K, KP, stride_wn, stride_wk, stride_sn,
            FP4, BLOCK, IS_NVFP4,
        )  # fmt: skip
        acc += tl.dot(even, w_even.to(even.dtype), input_precision=PRECISION)
        acc += tl.dot(odd, w_odd.to(odd.dtype), input_precision=PRECISION)
        if SWIGLU:
            u_even, u_odd = _weight_tile(
                w_ptr + N * stride_wn, s_ptr + N * stride_sn, offs_n, offs_kp, N, K, KP,
                stride_wn, stride_wk, stride_sn, FP4, BLOCK, IS_NVFP4,
            )  # fmt: skip
            acc_up += tl.dot(even, u_even.to(even.dtype), input_precision=PRECISION)
            acc_up += tl.dot(odd, u_odd.to(odd.dtype), input_precision=PRECISION)
    n_mask = offs_n < N
    if FP4 and IS_NVFP4:
        rs_ptr += expert.to(tl.int64) * stride_rse
        acc *= tl.load(rs_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if SWIGLU:
            acc_up *= tl.load(rs_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if WEIGHTED:
        acc *= tl.load(topk_weights_ptr + slots, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    w: FP4Tensor | torch.Tensor,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    swiglu: bool,
    config: tuple[int, int, int, int],
) -> None:
    sorted_slots, block_expert, topk_weights = routing
    block_m, block_n, block_kp, warps = config
    n = out.shape[1]
    fp4 = isinstance(w, FP4Tensor)
    if fp4:
        weight, scales, k, kp = w.packed, w.scales, w.k, w.packed.shape[-1]
        row_scale = w.row_scale if w.row_scale is not None else w.packed  # unread for MXFP4
        stride_wk, block, nvfp4 = 1, w.block_size, w.format == "nvfp4"
    else:  # scales and row scales are never read
        weight = scales = row_scale = w
        k, stride_wk, block, nvfp4 = w.shape[-1], w.stride(2), 1, False
        kp = triton.cdiv(k, 2)  # the loop walks column pairs, as it walks packed bytes
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, weight, scales, row_scale, out, sorted_slots, block_expert, topk_weights,
        out.shape[0], n, k, kp, a_row_div,
        a.stride(0), weight.stride(0), weight.stride(1), stride_wk, scales.stride(0),
        scales.stride(1), row_scale.stride(0), out.stride(0),
        FP4=fp4, BLOCK=block, IS_NVFP4=nvfp4, SWIGLU=swiglu,
        WEIGHTED=not swiglu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_kp,
        PRECISION=dot_precision(a.dtype), num_warps=warps,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: FP4Tensor | torch.Tensor,
    down: FP4Tensor | torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H]; the same
    contract as `kernels.reference.fp4_moe` (and, for plain weights, the grouped experts of
    `serving/model/moe.py`): gate_up [E, 2I, H], down [E, H, I]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = gate_up.shape
    num_slots = num_tokens * top_k
    config = DECODE_CONFIG if num_slots <= 16 * num_experts else PREFILL_CONFIG
    sorted_slots, block_expert = align_by_expert(topk_ids, num_experts, config[0])
    routing = (sorted_slots, block_expert, topk_weights.flatten().to(torch.float32).contiguous())
    x = x.contiguous()
    h = torch.empty(num_slots, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, routing, top_k, swiglu=True, config=config)
    out = torch.empty(num_slots, down.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(h, down, out, routing, 1, swiglu=False, config=config)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
