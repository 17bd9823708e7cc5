"""FP4 weights as modules, so a quantized model keeps its module tree and state dict names.

`QuantizedWeight` holds an `FP4Tensor`'s arrays as buffers (`packed`, `scales`, `row_scale`);
`FP4Linear` replaces an `nn.Linear` and holds one under the name `weight`, so its state dict
keys are `....weight.packed` and the like, next to where the plain weight would be.
"""

import torch
from torch import nn

from kernels import ops
from kernels.formats import BLOCK_SIZE, FP4Format, FP4Tensor


class QuantizedWeight(nn.Module):
    """An FP4 weight of logical shape `[..., N, K]` (no gradient: inference only)."""

    def __init__(self, t: FP4Tensor) -> None:
        super().__init__()
        self.format: FP4Format = t.format
        self.k = t.k
        self.register_buffer("packed", t.packed)
        self.register_buffer("scales", t.scales)
        self.register_buffer("row_scale", t.row_scale)

    @classmethod
    def empty(cls, shape: tuple[int, ...], format: FP4Format) -> "QuantizedWeight":
        """Placeholders of the right shapes (on the current default device, e.g. meta)."""
        *rows, k = shape
        kp = -(-k // BLOCK_SIZE[format]) * BLOCK_SIZE[format]
        packed = torch.empty(*rows, kp // 2, dtype=torch.uint8)
        scales = torch.empty(*rows, kp // BLOCK_SIZE[format], dtype=torch.uint8)
        row_scale = torch.empty(*rows) if format == "nvfp4" else None
        return cls(FP4Tensor(format, packed, scales, row_scale, k))

    @property
    def tensor(self) -> FP4Tensor:
        return FP4Tensor(self.format, self.packed, self.scales, self.row_scale, self.k)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def extra_repr(self) -> str:
        return f"{self.format}, shape={tuple(self.shape)}"


class FP4Linear(nn.Module):
    """`y = x @ W.t() (+ b)` with W in FP4 (the W4A16 dequant-GEMM)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.fp4_linear(x, self.weight.tensor)
        return y if self.bias is None else y + self.bias
