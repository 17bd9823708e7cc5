"""PyTorch reference of the fused kernels: the oracle of the Triton and C++ kernels' tests,
and the CPU path for FP4 weights kept FP4 where the C++ ops (`kernels/cpu_fp4.py`) cannot be
built.

Weights are dequantized per call, only the experts a step uses, so FP4 weights stay FP4 in
memory; `loadtests/bench_kernels.py` measures this against the other CPU options.
"""

import torch
import torch.nn.functional as F

from kernels.formats import FP4Tensor, dequantize_blocks


def _scaled_matmul(
    x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor | None
) -> torch.Tensor:
    """x @ w^T (batched over leading dims), times the per-row tensor scale (NVFP4) on the
    output: one multiply per output element instead of one per weight."""
    y = torch.matmul(x, w.to(x.dtype).transpose(-1, -2))
    return y if row_scale is None else y * row_scale.to(x.dtype)[..., None, :]


def fp4_linear(x: torch.Tensor, w: FP4Tensor, lookup: bool = True) -> torch.Tensor:
    """x [..., K] @ W.t() for an FP4 weight W [N, K]: the W4A16 dequant-GEMM."""
    return _scaled_matmul(x, dequantize_blocks(w, lookup), w.row_scale)


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

    The used experts' weights are dequantized together (one gather each for gate_up and
    down: a layer's worth at most, freed after the call). A single token (decoding one
    sequence) runs its k experts as one batched product; otherwise token slots are sorted by
    expert, each expert runs over its contiguous slice, and results are summed per token.
    """
    if x.shape[0] == 1:
        gate_up, down = gate_up.select(topk_ids[0]), down.select(topk_ids[0])
        xs = x.expand(topk_ids.shape[1], 1, -1)
        h = silu_and_mul(_scaled_matmul(xs, dequantize_blocks(gate_up, lookup), gate_up.row_scale))
        out = _scaled_matmul(h, dequantize_blocks(down, lookup), down.row_scale)  # [k, 1, H]
        return (out.squeeze(1) * topk_weights[0, :, None].to(x.dtype)).sum(0, keepdim=True)
    top_k = topk_ids.shape[1]
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.packed.shape[0])
    used = counts.nonzero().squeeze(1)
    gate_up, down = gate_up.select(used), down.select(used)
    gate_up_w = dequantize_blocks(gate_up, lookup)
    down_w = dequantize_blocks(down, lookup)
    token_of = order // top_k
    xs = x.index_select(0, token_of)
    out = torch.empty_like(xs)
    start = 0
    for i, n in enumerate(counts[used].tolist()):
        seg = slice(start, start + n)
        rs = (
            (None, None) if gate_up.row_scale is None else (gate_up.row_scale[i], down.row_scale[i])
        )
        h = silu_and_mul(_scaled_matmul(xs[seg], gate_up_w[i], rs[0]))
        out[seg] = _scaled_matmul(h, down_w[i], rs[1])
        start += n
    slot_weights = topk_weights.flatten()[order].unsqueeze(-1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out * slot_weights)
