"""Dense projections and experts of a compiled decode step on a CPU: the C++ ops of
`csrc/dense_gemm.cpp`, which read each weight once a step for all of the step's rows.

A decode step's products are a few rows against weights that do not fit in cache, so they cost
what reading the weights costs. Inductor's fused reduction over each row (`linear.py`'s
fallback) and each token's own experts gathered in place (`moe.gathered_experts`) read every
weight once per row, so a step of five rows (a verified speculation of four drafts) cost
nearly five one-row steps. These ops share the FP4 ops' tile loops (`csrc/row_products.h`):
each loaded weight vector goes into every row's sums, and experts run grouped by expert.

Activations are fp32 (the graphs that call them compute in fp32); weights fp32 or bf16 (a
bf16 checkpoint computed in fp32 on a CPU without native bf16 products keeps its weights
bf16, `load_checkpoint`), widened exactly in registers. The ops are built on first use
(`kernels/cpu_extension.py`) and registered with fake kernels, so compiled graphs call them;
"""

import torch

from kernels import cpu_extension

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _register_fakes() -> None:
    torch.library.register_fake("tierserve_dense::linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0])
    )
    torch.library.register_fake("tierserve_dense::moe")(lambda x, *args: torch.empty_like(x))


LIBRARY = cpu_extension.Library(
    _register_fakes,
    "compiled decode steps project by inductor's fused reductions and read each token's "
    "experts in place instead, reading every weight once per row",
)
# Builds or loads the ops once a process; False, with one warning, where they cannot be
# built. Called before a trace reads it (`cpu_extension.once`): only traced code asks
# `runs`, and `DecodeGraphs` calls it first.
available = cpu_extension.built_once(LIBRARY)


# A bf16 weight at least this wide (an LM head) projects one row faster by the op: the fused
# reduction widens each element inside its loop, the op a vector at a time in its tiles
# (`loadtests/bench_projections.py`); narrower weights gain nothing from the call.
WIDE_WEIGHT_ROWS = 2048


def runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the ops take these activations and weights: fp32 activations and contiguous
    weights of a dtype they read, all on the CPU, the ops built; and more than one row, or one
    row against a wide bf16 weight (`WIDE_WEIGHT_ROWS`). Otherwise a single row reads each
    weight once however it is written, and inductor's fused reduction spares the op's call
    and fuses with its neighbours (`loadtests/bench_projections.py` times the two)."""
    wide = all(
        w.dim() == 2 and w.dtype == torch.bfloat16 and w.shape[0] >= WIDE_WEIGHT_ROWS
        for w in weights
    )
    return (
        (x.numel() > x.shape[-1] or wide)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and all(
            w.device.type == "cpu" and w.dtype in WEIGHT_DTYPES and w.is_contiguous()
            for w in weights
        )
        and available()
    )


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x [..., K] @ W.t()` for fp32 x and an fp32 or bf16 weight `W [N, K]`, in fp32."""
    y = torch.ops.tierserve_dense.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight)
    return y.view(*x.shape[:-1], -1)


def dense_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])` for fp32 x [T, H] and
    experts gate_up [E, 2I, H], down [E, H, I] (fp32 or bf16, both alike), in fp32."""
    return torch.ops.tierserve_dense.moe(
        x.contiguous(),
        topk_weights.float().contiguous(),
        topk_ids.long().contiguous(),
        gate_up,
        down,
    )
