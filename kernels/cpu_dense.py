"""Dense projections and experts of a compiled decode step on a CPU: the C++ ops of
`csrc/dense_gemm.cpp`, which read each weight once a step for all of the step's rows.

A decode step's products are a few rows against weights that do not fit in cache, so they cost
what reading the weights costs. Inductor's fused reduction over each row (`linear.py`'s
fallback) and each token's own experts gathered in place (`moe.gathered_experts`) read every
weight once per row, so a step of five rows (a verified speculation of four drafts) cost
nearly five one-row steps. These ops share the FP4 ops' tile loops (`csrc/row_products.h`):
each loaded weight vector goes into every row's sums, and experts run grouped by expert.

The ops sum in fp32 and return fp32, which the graph rounds back to its dtype, as a bf16
product accumulates in fp32 anyway. Weights are fp32 or bf16 (a bf16 checkpoint keeps its
weights bf16 whatever it computes in, `load_checkpoint`). bf16 activations go in as they are:
against bf16 weights, where the CPU multiplies bf16 pairs (AVX512_BF16), the op multiplies
them so, twice the products an instruction of an fp32 product and nothing widened
(`bf16_pairs()`); elsewhere it widens them exactly, as it does fp16 ones here. The ops are
built on first use (`kernels/cpu_extension.py`) and registered with fake kernels, so
compiled graphs call them.
"""

import torch

from kernels import cpu_extension

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _register_fakes() -> None:
    torch.library.register_fake("tierserve_dense::linear")(
        lambda x, weight: x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    )
    torch.library.register_fake("tierserve_dense::moe")(
        lambda x, *args: torch.empty_like(x, dtype=torch.float32)
    )


LIBRARY = cpu_extension.Library(
    _register_fakes,
    "compiled decode steps project by inductor's fused reductions and read each token's "
    "experts in place instead, reading every weight once per row",
)
# Builds or loads the ops once a process; False, with one warning, where they cannot be
# built. Called before a trace reads it (`cpu_extension.once`): only traced code asks
# `runs`, and `DecodeGraphs` calls it first.
available = cpu_extension.built_once(LIBRARY)


# A bf16 weight at least this wide (an LM head) projects one row of fp32 activations faster
# by the op: the fused reduction widens each element inside its loop, the op a vector at a
# time in its tiles; narrower weights gain nothing from the call. With bf16 activations the
# reduction is slower still, and the op the faster at every width
# (`loadtests/bench_projections.py`).
WIDE_WEIGHT_ROWS = 2048


def runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the ops take these activations and weights: activations of a float dtype and
    contiguous weights of a dtype they read, all on the CPU, the ops built; and more than one
    row, or one row against bf16 weights (projections or experts) computed in half precision,
    or a wide bf16 projection (`WIDE_WEIGHT_ROWS`). Otherwise a single row reads each weight
    once however it is written, and inductor's fused reduction spares the op's call and fuses
    with its neighbours. One bf16 row's experts ran faster in the op than the fused reduction
    over its gathered experts (`moe.gathered_experts`), in a one-stream step too
    (`loadtests/profile_decode.py`)."""
    one_row = all(
        w.dtype == torch.bfloat16
        and (x.dtype != torch.float32 or (w.dim() == 2 and w.shape[0] >= WIDE_WEIGHT_ROWS))
        for w in weights
    )
    return (
        (x.numel() > x.shape[-1] or one_row)
        and x.device.type == "cpu"
        and x.dtype in ACTIVATION_DTYPES
        and all(
            w.device.type == "cpu" and w.dtype in WEIGHT_DTYPES and w.is_contiguous()
            for w in weights
        )
        and available()
    )


def bf16_pairs() -> bool:
    """Whether the ops multiply bf16 activations with bf16 weights (and decoded FP4 ones) as
    bf16 pairs on this CPU; they then round the experts' inner activations to bf16 too, as a
    bf16 model does."""
    return available() and torch.ops.tierserve_dense.bf16_pairs()


def activations(x: torch.Tensor) -> torch.Tensor:
    """x as the ops take it: contiguous rows of fp32, or bf16 as they are."""
    return (x if x.dtype == torch.bfloat16 else x.float()).contiguous()


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x [..., K] @ W.t()` for an fp32 or bf16 weight `W [N, K]`, in x's dtype."""
    y = torch.ops.tierserve_dense.linear(activations(x.reshape(-1, x.shape[-1])), weight)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def dense_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])` for x [T, H] and experts
    gate_up [E, 2I, H], down [E, H, I] (fp32 or bf16, both alike), in x's dtype."""
    return torch.ops.tierserve_dense.moe(
        activations(x),
        topk_weights.float().contiguous(),
        topk_ids.long().contiguous(),
        gate_up,
        down,
    ).to(x.dtype)
