"""Which implementation runs each kernel op, decided in one place by the device of the
tensors: Triton on CUDA, the PyTorch paths (`kernels/reference.py`, SDPA, BLAS) elsewhere.

- FP4 linears: `w4a16_linear` (Triton), the C++ op of `kernels/cpu_fp4.py` on a CPU, or
  `reference.fp4_linear` where that op cannot be built;
- experts (FP4 or plain): `fused_moe` (Triton); FP4 experts on a CPU `fp4_experts` (the C++
  op, or the reference's per-step dequantization where it cannot be built); plain experts on
  a CPU run as `serving/model/moe.py`'s grouped PyTorch experts, and in a compiled decode
  step as the C++ op of `kernels/cpu_dense.py` (chosen there, in `SparseMoE`);
- decode attention over the paged KV cache: `paged_decode_attention`, Triton on CUDA and the
  C++ op of `kernels/cpu_attention.py` on a CPU, or SDPA on the gathered cache where that op
  cannot be built (no C++ compiler; a warning says so);
- the gated delta rule's sequential parts (Gated DeltaNet layers): Triton on CUDA
  (`kernels/triton_delta_rule.py`), the PyTorch forms of `serving/model/hybrid/delta_rule.py`
  elsewhere.

Callers branch on `use_triton` and call the Triton ops through here, so a test can force the
Triton side on a CPU under `TRITON_INTERPRET=1` by patching `use_triton`. Nothing else falls
back: a Triton op that cannot run raises. Where a C++ CPU op cannot be built, a warning says so
and what runs instead (`kernels/cpu_extension.py`); the checkpoint loader then dequantizes FP4
weights at load unless told to keep them.
"""

from typing import Any

import torch

from kernels import cpu_attention, cpu_fp4, reference
from kernels.formats import FP4Format, FP4Tensor


def use_triton(device: torch.device) -> bool:
    """The Triton kernels run on CUDA; any other device runs the PyTorch paths."""
    return device.type == "cuda"


def has_fp4_kernels(device: torch.device) -> bool:
    """Whether FP4 weights on `device` run as they are stored: always on CUDA (Triton); on a
    CPU once the C++ ops are built (the first call builds them)."""
    return use_triton(device) or (device.type == "cpu" and cpu_fp4.available())


def fp4_linear(x: torch.Tensor, w: FP4Tensor) -> torch.Tensor:
    """`x [..., K] @ W.t()` for an FP4 weight `W [N, K]`."""
    if use_triton(x.device):
        from kernels.triton_gemm import w4a16_linear  # Triton is imported only where it runs

        return w4a16_linear(x, w)
    if cpu_fp4.available():
        return cpu_fp4.fp4_linear(x, w)
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


# The reference's FP4 experts (`reference.fp4_moe`, the lookup-table dequantization of the used
# experts per call) as an op that a compiled decode step calls as opaque eager code: which
# experts it dequantizes depends on what the tokens picked, which a graph cannot know. Each
# weight is passed as its parts: an op's arguments are tensors and scalars.
torch.library.define(
    "tierserve::fp4_moe_experts",
    "(Tensor x, Tensor weights, Tensor experts, str format, Tensor gate_up_packed, "
    "Tensor gate_up_scales, Tensor? gate_up_row_scale, int gate_up_k, Tensor down_packed, "
    "Tensor down_scales, Tensor? down_row_scale, int down_k) -> Tensor",
)


def _reference_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, format: FP4Format, *parts: Any
) -> torch.Tensor:
    gate_up, down = FP4Tensor(format, *parts[:4]), FP4Tensor(format, *parts[4:])
    return reference.fp4_moe(x, weights, experts, gate_up, down)


torch.library.impl(
    "tierserve::fp4_moe_experts", "CompositeExplicitAutograd", func=_reference_experts
)
torch.library.register_fake("tierserve::fp4_moe_experts")(lambda x, *args: torch.empty_like(x))


def _parts(t: FP4Tensor) -> tuple[Any, ...]:
    return t.packed, t.scales, t.row_scale, t.k


def fp4_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: FP4Tensor,
    down: FP4Tensor,
) -> torch.Tensor:
    """FP4 experts off CUDA: the C++ op (`kernels.cpu_fp4`), which decodes the weights inside
    its products, where it is built; else the reference, which dequantizes the used experts
    per call (compiled graphs call either as an op)."""
    if cpu_fp4.available():
        return cpu_fp4.fp4_moe(x, topk_weights, topk_ids, gate_up, down)
    return torch.ops.tierserve.fp4_moe_experts(
        x, topk_weights, topk_ids, gate_up.format, *_parts(gate_up), *_parts(down)
    )


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


def recurrent_gated_delta_rule(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token gated delta rule in Triton
    (`kernels.triton_delta_rule.recurrent_gated_delta_rule`: q, k, v, g, beta, state)."""
    from kernels.triton_delta_rule import recurrent_gated_delta_rule

    return recurrent_gated_delta_rule(*tensors)


def delta_rule_chunk_recurrence(*terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule's chunk-to-chunk recurrence in Triton
    (`kernels.triton_delta_rule.chunk_recurrence`)."""
    from kernels.triton_delta_rule import chunk_recurrence

    return chunk_recurrence(*terms)
