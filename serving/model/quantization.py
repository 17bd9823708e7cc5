"""FP4 checkpoints in compressed-tensors' pack-quantized layout, out of and into our model.

`tierserve quantize` writes, for every quantized projection `X` (each expert's
`gate_proj`/`up_proj`/`down_proj`, and with `--all-linear` the attention and dense MLP
projections too), the tensors vLLM's compressed-tensors loader reads for Qwen3-MoE:

- `X.weight_packed`: uint8 `[N, K/2]`, two E2M1 codes per byte, low nibble first;
- `X.weight_scale`: `[N, K/block]`, FP8 E4M3 (NVFP4) or E8M0 exponent bytes (MXFP4);
- `X.weight_global_scale` (NVFP4 only): fp32 `[1]`, `448 * 6 / amax`, shared by the
  projections an engine fuses (gate with up, q with k and v), as llm-compressor does;

and `config.json` gains a `quantization_config` naming the format. The router (`mlp.gate`),
embeddings, norms and the LM head stay in full precision.
"""

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from kernels.formats import (
    BLOCK_SIZE,
    FP4Format,
    FP4Tensor,
    dequantize,
    nvfp4_global_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)
from kernels.modules import FP4Linear, QuantizedWeight
from serving.model.causal_lm import CausalLM
from serving.model.config import CheckpointError, ModelConfig
from serving.model.hf_state_dict import FP4_PARTS, hf_name
from serving.model.moe import SparseMoE

FORMAT_NAMES: dict[str, FP4Format] = {
    "nvfp4-pack-quantized": "nvfp4",
    "mxfp4-pack-quantized": "mxfp4",
}
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# Projections an engine fuses share one NVFP4 global scale: the key of their group.
_FUSED_GROUP = (
    (re.compile(r"\.(gate|up)_proj\.weight$"), ".gate_up"),
    (re.compile(r"\.[qkv]_proj\.weight$"), ".qkv"),
)


def quantization_config(format: FP4Format, all_linear: bool) -> dict:
    """The `quantization_config` block of config.json (weight-only, W4A16)."""
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "dynamic": False,
        "group_size": BLOCK_SIZE[format],
        "strategy": "tensor_group" if format == "nvfp4" else "group",
        "scale_dtype": "torch.float8_e4m3fn" if format == "nvfp4" else "torch.uint8",
    }
    group = {
        "targets": ["Linear"] if all_linear else [EXPERT_TARGET],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": f"{format}-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head", r"re:.*mlp\.gate$"],
    }


def _fused_group(key: str) -> str:
    for pattern, name in _FUSED_GROUP:
        if pattern.search(key):
            return pattern.sub(name, key)
    return key


def quantize_state_dict(
    hf: dict[str, torch.Tensor], format: FP4Format, all_linear: bool
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (per-projection names) with the target weights in FP4."""
    targets = [k for k in hf if _EXPERT.search(k) or (all_linear and _LINEAR.search(k))]
    block = BLOCK_SIZE[format]
    for k in targets:
        if hf[k].shape[-1] % block:
            raise CheckpointError(f"{k}: {hf[k].shape[-1]} columns, not a multiple of {block}")
    amax: dict[str, torch.Tensor] = defaultdict(lambda: torch.tensor(0.0))
    for k in targets:
        group = _fused_group(k)
        amax[group] = torch.maximum(amax[group], hf[k].float().abs().amax())
    out = {k: v for k, v in hf.items() if k not in targets}
    for k in targets:
        base = k.removesuffix(".weight")
        if format == "nvfp4":
            t = quantize_nvfp4(hf[k], amax[_fused_group(k)])
            out[f"{base}.weight_scale"] = t.scales.view(torch.float8_e4m3fn)
            out[f"{base}.weight_global_scale"] = nvfp4_global_scale(amax[_fused_group(k)]).view(1)
        else:
            t = quantize_mxfp4(hf[k])
            out[f"{base}.weight_scale"] = t.scales
        out[f"{base}.weight_packed"] = t.packed
    return out


def unpack_state_dict(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors names to ours: `X.weight.packed`, `.scales` (uint8), `.row_scale`
    (`[N]`, the inverse global scale per row), which fuse like plain weights do."""
    out = {}
    for k, v in hf.items():
        if k.endswith(".weight_packed"):
            base = k.removesuffix("_packed")
            out[f"{base}.packed"] = v
            out[f"{base}.scales"] = hf[f"{base}_scale"].view(torch.uint8)
            if f"{base}_global_scale" in hf:
                gs = hf[f"{base}_global_scale"].float().reshape(())
                out[f"{base}.row_scale"] = (1.0 / gs).expand(v.shape[0]).clone()
        elif not re.search(r"\.weight_(scale|global_scale)$", k):
            out[k] = v
    return out


def dequantize_state_dict(
    hf: dict[str, torch.Tensor], format: FP4Format, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """An unpacked FP4 state dict (`unpack_state_dict`) with every FP4 weight replaced by its
    plain `dtype` weight: the checkpoint's values exactly (the lookup-table dequantization is
    exact in fp32), loaded as an unquantized model."""
    out = {k: v for k, v in hf.items() if k.rpartition(".")[2] not in FP4_PARTS}
    for k in hf:
        if k.endswith(".weight.packed"):
            base = k.removesuffix(".packed")
            k_in = hf[k].shape[-1] * 2  # checkpoints hold whole blocks
            t = FP4Tensor(format, hf[k], hf[f"{base}.scales"], hf.get(f"{base}.row_scale"), k_in)
            out[base] = dequantize(t, dtype)
    return out


def checkpoint_format(raw_quantization: dict) -> FP4Format:
    fmt = raw_quantization.get("format")
    if raw_quantization.get("quant_method") != "compressed-tensors" or fmt not in FORMAT_NAMES:
        raise CheckpointError(
            f"unsupported quantization {raw_quantization.get('quant_method')!r} / {fmt!r}; "
            f"tierserve reads compressed-tensors {', '.join(FORMAT_NAMES)}"
        )
    return FORMAT_NAMES[fmt]


def checkpoint_all_linear(raw_quantization: dict) -> bool:
    """Whether `quantization_config` wrote this block for every linear layer, not experts only."""
    groups = raw_quantization.get("config_groups", {}).values()
    return any("Linear" in group.get("targets", []) for group in groups)


_PROJECTION = re.compile(
    r"\.(?:self_attn\.(?P<attn>[qkvo])_proj|mlp\.(?:experts\.(?P<expert>\d+)\.)?"
    r"(?P<mlp>gate|up|down)_proj)$"
)


def _projection_shape(base: str, config: ModelConfig) -> tuple[int, int] | None:
    """The `[out, in]` shape config.json gives the projection `base` (a checkpoint name less
    `.weight`); None if the name is not a projection an FP4 checkpoint may quantize."""
    m = _PROJECTION.search(base)
    if m is None:
        return None
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    if m["attn"]:
        kv = config.num_key_value_heads * config.head_dim
        return {"q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q)}[m["attn"]]
    if m["expert"] is not None:
        if int(m["expert"]) >= config.num_experts:
            return None
        inner = config.moe_intermediate_size
    else:
        inner = config.intermediate_size
    return (h, inner) if m["mlp"] == "down" else (inner, h)


def check_fp4_layout(
    shapes: Mapping[str, Sequence[int]], config: ModelConfig, format: FP4Format
) -> None:
    """Refuse, naming the first tensor, an FP4 checkpoint whose packed codes or scales do not
    have the shapes its config.json implies: `shapes` maps each tensor name of
    model.safetensors to its shape (read from the file's header or from loaded tensors).
    Served, such a checkpoint would compute with misplaced blocks or fail mid-request."""
    block = BLOCK_SIZE[format]
    for name in shapes:
        if not name.endswith(".weight_packed"):
            continue
        base = name.removesuffix(".weight_packed")
        expected = _projection_shape(base, config)
        if expected is None:
            raise CheckpointError(f"{name}: no projection of this name in config.json's model")
        n, k = expected
        if k % block:
            raise CheckpointError(
                f"{name}: config.json gives it {k} inputs, not whole {format} blocks of {block}"
            )
        wanted = {
            name: (n, k // 2),
            f"{base}.weight_scale": (n, k // block),
        }
        if format == "nvfp4":
            wanted[f"{base}.weight_global_scale"] = (1,)
        for key, shape in wanted.items():
            if key not in shapes:
                raise CheckpointError(f"{format} checkpoint: {name} has no {key}")
            got = tuple(shapes[key])
            if got != shape and not (shape == (1,) and got == ()):
                raise CheckpointError(
                    f"{key}: shape {got}, but config.json's {n} x {k} {format} weight needs {shape}"
                )


def check_fp4_values(hf: Mapping[str, torch.Tensor], format: FP4Format) -> None:
    """Refuse FP4 arrays of the wrong dtypes, scales that are NaN (E8M0 255, E4M3 S.1111.111)
    or a tensor scale that is not a positive finite number: the weights would be NaN,
    infinite or other bytes than the format's."""
    for name, t in hf.items():
        if name.endswith((".weight_packed", ".weight_scale")) and t.element_size() != 1:
            raise CheckpointError(f"{name}: {t.dtype}, not one byte an element")
        if name.endswith(".weight_scale"):
            bits = t.view(torch.uint8)
            nan = bits == 255 if format == "mxfp4" else (bits & 0x7F) == 0x7F
            if bool(nan.any()):
                raise CheckpointError(f"{name}: NaN block scales")
        elif name.endswith(".weight_global_scale"):
            gs = t.float()
            if not bool((torch.isfinite(gs) & (gs > 0)).all()):
                raise CheckpointError(f"{name}: {gs.tolist()} is not a positive finite scale")


def use_quantized_modules(model: CausalLM, hf: dict[str, torch.Tensor], format: FP4Format) -> None:
    """Swap in FP4 placeholders wherever the (unpacked) checkpoint holds FP4 tensors."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE):
            if f"{hf_name(name)}.experts.0.gate_proj.weight.packed" in hf:
                for attr in ("gate_up", "down"):
                    shape = getattr(module, attr).shape
                    delattr(module, attr)
                    setattr(module, attr, QuantizedWeight.empty(tuple(shape), format))
        elif isinstance(module, nn.Linear) and name != "lm_head":
            first = hf_name(name).replace("qkv_proj", "q_proj").replace("gate_up_", "gate_")
            if f"{first}.weight.packed" in hf:
                parent, _, attr = name.rpartition(".")
                fp4 = FP4Linear(
                    QuantizedWeight.empty(tuple(module.weight.shape), format), module.bias
                )
                setattr(model.get_submodule(parent), attr, fp4)
