"""FP4 weights kept FP4 on a CPU: the C++ ops of `csrc/fp4_gemm.cpp` for FP4 linear layers
and FP4 experts, which read the packed codes and block scales where they lie and decode each
block in registers inside the dot product, so an FP4 model holds a quarter of a bf16 model's
expert bytes and reads no more than that a step. `loadtests/bench_kernels.py` measures them
against the dense products, `loadtests/bench_fp4_engine.py` the engine decoding with them.

Activations are fp32 or bf16 inside the ops (fp16 is widened on the way in), as the dense
ops take them (`cpu_dense.activations`, `cpu_dense.bf16_pairs`); the decoded weights are the
dequantized weights exactly, so results match `kernels/reference.py` up to the order of the
sums (and, for bf16 pairs, the experts' inner activations rounded to bf16). The ops are
built on first use (`kernels/cpu_extension.py`) and registered with fake kernels, so the
compiled decode steps call them.
"""

import torch

from kernels import cpu_extension
from kernels.cpu_dense import activations
from kernels.formats import FP4Tensor


def _register_fakes() -> None:
    torch.library.register_fake("tierserve_fp4::linear")(
        lambda x, block, packed, scales, row_scale: x.new_empty(
            x.shape[0], packed.shape[0], dtype=torch.float32
        )
    )
    torch.library.register_fake("tierserve_fp4::moe")(
        lambda x, *args: torch.empty_like(x, dtype=torch.float32)
    )


LIBRARY = cpu_extension.Library(
    _register_fakes,
    "FP4 checkpoints are dequantized at load on this CPU instead (the memory of a bf16 "
    "or fp32 checkpoint)",
)
# Builds or loads the ops once a process; False, with one warning, where they cannot be built.
available = cpu_extension.built_once(LIBRARY)


def padded(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """x [..., k] as the ops take it (`cpu_dense.activations`), rows [rows, Kp] zero padded
    to the weight's whole blocks (the padded codes are zeros too)."""
    x = x.reshape(-1, x.shape[-1])
    pad = w.packed.shape[-1] * 2 - x.shape[-1]
    return activations(torch.nn.functional.pad(x, (0, pad)) if pad else x)


def fp4_linear(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """`x [..., K] @ W.t()` for an FP4 weight `W [N, K]`, in x's dtype."""
    y = torch.ops.tierserve_fp4.linear(padded(x, w), w.block_size, w.packed, w.scales, w.row_scale)
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def fp4_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: FP4Tensor,
    down: FP4Tensor,
) -> torch.Tensor:
    """`sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])` for x [T, H] and FP4
    experts gate_up [E, 2I, H], down [E, H, I] (whole blocks: checkpoints hold them so)."""
    y = torch.ops.tierserve_fp4.moe(
        activations(x),
        topk_weights.float().contiguous(),
        topk_ids.long().contiguous(),
        gate_up.block_size,
        gate_up.packed,
        gate_up.scales,
        gate_up.row_scale,
        down.packed,
        down.scales,
        down.row_scale,
    )
    return y.to(x.dtype)
