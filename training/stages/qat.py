"""Quantization-aware training: the model trains through the FP4 weights it will be served with.

Each target weight is seen through `fake_quantize` in every forward pass, a PyTorch
parametrization (`torch.nn.utils.parametrize`) holding the fp32 latent weight; the gradient
passes straight through the rounding (the straight-through estimator), so the latent
weights learn to sit where FP4 rounds them well. The quantizer is the one `tierserve
quantize` applies (`kernels.formats`), with the same NVFP4 tensor scales (one per expert for
its fused gate and up rows, one for its down rows), so post-training quantization of the
latent weights gives exactly the weights the model trained with.

Targets: every expert's gate/up and down (`SparseMoE.gate_up`, `.down`), which hold most of
the parameters and all of a sparse model's decode bandwidth; with `all_linear`, also the
attention and dense MLP projections (`--all-linear` of `tierserve quantize`).
"""

import torch
from torch import nn
from torch.nn.utils import parametrize

from kernels.formats import FP4Format, dequantize, quantize_mxfp4, quantize_nvfp4
from serving.model.causal_lm import CausalLM
from serving.model.moe import SparseMoE


def fake_quantize(w: torch.Tensor, format: FP4Format, per_matrix: bool) -> torch.Tensor:
    """`w` rounded to FP4 and back. `per_matrix`: an NVFP4 tensor scale for each matrix of a
    stacked `[E, N, K]` weight (each expert's), else one for the whole weight."""
    if format == "mxfp4":
        t = quantize_mxfp4(w)
    else:
        amax = w.abs().amax(dim=(-2, -1))[..., None] if per_matrix else None
        t = quantize_nvfp4(w, amax)
    return dequantize(t, w.dtype)


class FakeFP4(nn.Module):
    """The parametrization: FP4 values forward, the identity backward."""

    def __init__(self, format: FP4Format, per_matrix: bool) -> None:
        super().__init__()
        self.format, self.per_matrix = format, per_matrix

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        q = fake_quantize(w.detach(), self.format, self.per_matrix)
        return w + (q - w).detach()


def _targets(model: CausalLM, all_linear: bool) -> list[tuple[nn.Module, str, bool]]:
    """(module, parameter name, per-matrix tensor scale) of every weight to quantize."""
    out: list[tuple[nn.Module, str, bool]] = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            out += [(module, "gate_up", True), (module, "down", True)]
        elif all_linear and isinstance(module, nn.Linear) and _is_projection(name):
            out.append((module, "weight", False))
    return out


def _is_projection(name: str) -> bool:
    """Attention and dense MLP projections: not the router (`mlp.gate`), not the LM head, not
    the MTP layers' input projection."""
    return name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def enable_qat(model: CausalLM, format: FP4Format, all_linear: bool = False) -> int:
    """Put the target weights behind `FakeFP4`; returns how many weights."""
    targets = _targets(model, all_linear)
    for module, name, per_matrix in targets:
        parametrize.register_parametrization(module, name, FakeFP4(format, per_matrix))
    return len(targets)


def served_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with each parametrized weight under its plain name, holding the
    values the forward pass uses (under QAT: the FP4-rounded weights, as served)."""
    state = {k: v for k, v in model.state_dict().items() if ".parametrizations." not in k}
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            for param in module.parametrizations:
                state[f"{name}.{param}" if name else param] = getattr(module, param)
    return state


def disable_qat(model: CausalLM) -> None:
    """Back to plain parameters holding the latent (unrounded) weights, which
    `tierserve quantize` rounds exactly as training saw them."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=False)
