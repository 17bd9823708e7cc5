"""The model's projections: `nn.Linear`, except in a compiled decode step.

There a projection of 2-32 rows is the C++ op of `kernels/cpu_dense.py`, which reads the
weight (fp32, or bf16 held narrower) once for all the step's rows, where it lies (row-major,
as checkpoints store it), so a verify step of a few rows costs little more in weight reads
than a decode step of one. On a CPU, MKL's fp32 products of 1-32 rows read a cold weight far
below memory speed, worst on AMD CPUs (`loadtests/bench_gemm.py`). One row (but against a
wide bf16 weight, such as the MTP drafter's copy of the head), or where the op cannot be built
(a warning says so), the projection is written as a broadcast product summed over the input
dimension, which inductor fuses into one C++ loop that streams the weight once per row.
Half-precision steps take the same paths, the op summing in fp32 (bf16 activations as bf16
pairs where the CPU multiplies them, `cpu_dense.bf16_pairs`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_dense
from serving.model.dtype import is_supported

# Compiled decode steps of at most this many rows project by the op or reduction (every
# graph size).
REDUCTION_MAX_ROWS = 32


def reduces(x: torch.Tensor) -> bool:
    """Whether a projection of x, being traced for a decode graph, is the op or a reduction."""
    return (
        torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and x.numel() <= REDUCTION_MAX_ROWS * x.shape[-1]
    )


class Linear(nn.Linear):
    # oneDNN's blocked layout of the weight on a CPU (`pack_onednn`), read by eager calls. One
    # row against an fp32 weight (a lone stream's logits) goes through the dense op over the
    # plain weight instead: faster for a small head, about even for a large one; against a
    # bf16 weight oneDNN's blocked product is the faster (`loadtests/bench_projections.py`,
    # eager section).
    onednn_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn_weight is not None and not torch.compiler.is_compiling():
            if (
                x.numel() == x.shape[-1]
                and self.weight.dtype == torch.float32
                and self.weight.is_contiguous()
                and cpu_dense.available()
            ):
                y = cpu_dense.dense_linear(x, self.weight)
                return y if self.bias is None else y + self.bias
            return torch.ops.mkldnn._linear_pointwise(
                x, self.onednn_weight, self.bias, "none", [], ""
            )
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`Linear`'s product without the oneDNN copy: also for a weight whose module a graph
    must not see (a oneDNN tensor cannot be pickled with a stored graph's guards)."""
    if not reduces(x):  # a weight held narrower than x (`load_checkpoint`) is widened per call
        return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype), bias)
    # The op reads the weight once for all rows; the fallback's fused loop, once a row
    # (a narrower weight widens inside it).
    y = cpu_dense.dense_linear(x, w) if cpu_dense.runs(x, w) else (x.unsqueeze(-2) * w).sum(-1)
    return y if bias is None else y + bias


def pack_onednn(linear: Linear) -> None:
    """Give a CPU projection in fp32, or in bf16 where the CPU computes it natively, a copy of
    its weight in oneDNN's blocked layout, which oneDNN's product reads at decode sizes faster
    than MKL reads an fp32 weight as stored (`loadtests/bench_gemm.py`), and than oneDNN reads
    a bf16 one as stored. It is what inductor's freezing does to linears; eager code gets it
    here. Inference only: the copy is opaque to autograd and to every other op, so a weight
    shared with another module (a tied embedding) stays and the copy is extra."""
    w = linear.weight
    if (
        w.device.type == "cpu"
        and w.dtype in (torch.float32, torch.bfloat16)
        and is_supported(w.dtype)
        and torch.backends.mkldnn.is_available()
    ):
        linear.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach())
