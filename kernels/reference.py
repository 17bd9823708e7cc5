"""PyTorch reference of the fused kernels: the oracle of the Triton tests and the CPU path.

Weights are dequantized per call, only the experts a step uses, so FP4 weights stay FP4 in
memory; `loadtests/bench_fp4_cpu.py` measures this against the other CPU options.
"""

import torch
import torch.nn.functional as F

from kernels.formats import FP4Tensor, dequantize_blocks


def fp4_linear(x: torch.Tensor, w: FP4Tensor, lookup: bool = True) -> torch.Tensor:
    """x [..., K] @ W.t() for an FP4 weight W [N, K]: the W4A16 dequant-GEMM. The per-row
    tensor scale (NVFP4) is applied to the output, one multiply per output element."""
    y = F.linear(x, dequantize_blocks(w, lookup).to(x.dtype))
    return y if w.row_scale is None else y * w.row_scale.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fp4_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: FP4Tensor,
    down: FP4Tensor,
    lookup: bool = True,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H], with FP4
    expert weights gate_up [E, 2I, H] and down [E, H, I].

    Token slots are sorted by expert; each used expert's weights are dequantized once and
    run over its contiguous slice; results are weighted and summed back per token.
    """
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.packed.shape[0]).tolist()
    token_of = order // top_k
    xs = x.index_select(0, token_of)
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = slice(start, start + n)
            h = silu_and_mul(fp4_linear(xs[seg], gate_up.expert(e), lookup))
            out[seg] = fp4_linear(h, down.expert(e), lookup)
            start += n
    slot_weights = topk_weights.flatten()[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out * slot_weights)
