"""The model's projections: `nn.Linear`, except in a compiled fp32 decode step.

There a projection of a few rows is written as a broadcast product summed over the input
dimension, which inductor fuses into one C++ loop that streams the weight from where it lies
(row-major, as checkpoints store it) and never calls a BLAS. On a CPU, MKL's fp32 products of
1-32 rows read a cold weight far below memory speed, worst on AMD CPUs: 8 layers' dense
projections and the LM head of the benchmark model (12.3 MB) took 1.0 / 2.3 / 3.4 / 4.9 ms at
1 / 2 / 4 / 16 rows through `F.linear` on transposed-packed weights, 0.9 / 1.0 / 1.1 / 2.7 ms
as fused reductions (2 vCPU Zen 3; `loadtests/bench_gemm.py`). Half-precision graphs are frozen
and use inductor's own GEMM templates instead (`decode_graphs.inductor_config`).
"""

import torch
from torch import nn

# Compiled decode steps of at most this many rows project by reduction (every graph size).
REDUCTION_MAX_ROWS = 32


def reduces(x: torch.Tensor) -> bool:
    """Whether a projection of x, being traced for a decode graph, is written as a reduction."""
    return (
        torch.compiler.is_compiling()
        and not torch.is_grad_enabled()
        and x.dtype == torch.float32
        and x.numel() <= REDUCTION_MAX_ROWS * x.shape[-1]
    )


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not reduces(x):
            return super().forward(x)
        y = (x.unsqueeze(-2) * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias
