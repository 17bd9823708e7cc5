"""Which implementation runs the FP4 operations: Triton kernels on CUDA, the PyTorch
reference (`kernels/reference.py`, the CPU path) elsewhere. Both share one signature."""

from collections.abc import Callable

import torch

from kernels import reference


def fp4_linear_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """`(x [..., K], w: FP4Tensor [N, K]) -> x @ W.t()`."""
    if device.type == "cuda":
        from kernels.triton_gemm import w4a16_linear

        return w4a16_linear
    return reference.fp4_linear


def fp4_moe_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """`(x [T, H], topk_weights, topk_ids, gate_up, down) -> [T, H]`: the routed experts'
    SwiGLU MLPs over FP4 weights, weighted and summed per token."""
    if device.type == "cuda":
        from kernels.triton_moe import fused_moe

        return fused_moe
    return reference.fp4_moe
