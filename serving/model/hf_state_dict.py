"""Our fused model's tensors under the names transformers writes, and back.

On disk the tensors carry the names transformers writes for Qwen3-MoE / Qwen3 (per-expert
`mlp.experts.{e}.gate_proj.weight`, separate q/k/v projections); in memory they are fused
(`qkv_proj`, `gate_up_proj`, experts stacked as `[E, 2I, H]` and `[E, H, I]`). MTP layers are
stored as extra tensors `mtp.layers.{d}.*` that transformers ignores.
"""

import torch

from serving.model.causal_lm import CausalLM
from serving.model.config import CheckpointError, ModelConfig


def _attn_to_hf(ours: str, hf: str, sd: dict, cfg: ModelConfig, out: dict) -> None:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    for kind in ("weight", "bias"):
        t = sd.get(f"{ours}.self_attn.qkv_proj.{kind}")
        if t is not None:
            for name, part in zip("qkv", t.split([q, kv, kv]), strict=True):
                out[f"{hf}.self_attn.{name}_proj.{kind}"] = part
    for name in ("o_proj.weight", "o_proj.bias", "q_norm.weight", "k_norm.weight"):
        if f"{ours}.self_attn.{name}" in sd:
            out[f"{hf}.self_attn.{name}"] = sd[f"{ours}.self_attn.{name}"]
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[f"{hf}.{name}"] = sd[f"{ours}.{name}"]


def _layer_to_hf(ours: str, hf: str, sd: dict, cfg: ModelConfig, out: dict) -> None:
    _attn_to_hf(ours, hf, sd, cfg, out)
    if f"{ours}.mlp.gate_up" in sd:  # sparse
        out[f"{hf}.mlp.gate.weight"] = sd[f"{ours}.mlp.gate.weight"]
        for e, (gu, down) in enumerate(
            zip(sd[f"{ours}.mlp.gate_up"], sd[f"{ours}.mlp.down"], strict=True)
        ):
            gate, up = gu.chunk(2)
            out[f"{hf}.mlp.experts.{e}.gate_proj.weight"] = gate
            out[f"{hf}.mlp.experts.{e}.up_proj.weight"] = up
            out[f"{hf}.mlp.experts.{e}.down_proj.weight"] = down
    else:
        gate, up = sd[f"{ours}.mlp.gate_up_proj.weight"].chunk(2)
        out[f"{hf}.mlp.gate_proj.weight"] = gate
        out[f"{hf}.mlp.up_proj.weight"] = up
        out[f"{hf}.mlp.down_proj.weight"] = sd[f"{ours}.mlp.down_proj.weight"]


def to_hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our fused state dict under transformers' on-disk names."""
    cfg, sd = model.config, model.state_dict()
    out = {
        "model.embed_tokens.weight": sd["embed_tokens.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        _layer_to_hf(f"layers.{i}", f"model.layers.{i}", sd, cfg, out)
    for d in range(len(model.mtp)):
        ours, hf = f"mtp.{d}", f"mtp.layers.{d}"
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight"):
            out[f"{hf}.{name}"] = sd[f"{ours}.{name}"]
        _layer_to_hf(f"{ours}.block", f"{hf}.block", sd, cfg, out)
    return {k: v.contiguous() for k, v in out.items()}


# The arrays of an FP4 weight (`kernels.modules.QuantizedWeight`).
FP4_PARTS = ("packed", "scales", "row_scale")


def from_hf_state_dict(hf: dict[str, torch.Tensor], model: CausalLM) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_state_dict`, driven by our model's own parameter names.

    An FP4 weight's arrays (`X.packed`, `X.scales`, `X.row_scale`) are split by rows like
    the plain weight `X` they stand for, so they fuse the same way (`serving/model/quantization.py`
    gives the checkpoint's FP4 tensors these names).
    """
    cfg = model.config
    out = {}
    for full_name, param in model.state_dict().items():
        name, dot, part = full_name.rpartition(".")
        if part not in FP4_PARTS:
            name, dot, part = full_name, "", ""
        src, part = hf_name(name), dot + part
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            kind = name.rsplit(".", 1)[1]
            base = src.rsplit(".qkv_proj", 1)[0]
            t = torch.cat([_take(hf, f"{base}.{p}_proj.{kind}{part}") for p in "qkv"])
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = src.rsplit(".gate_up_proj", 1)[0]
            t = torch.cat([_take(hf, f"{base}.{p}_proj.weight{part}") for p in ("gate", "up")])
        elif name.endswith("mlp.gate_up") or name.endswith("mlp.down"):
            t = _experts(hf, src, name.endswith("gate_up"), cfg.num_experts, part)
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            t = _take(hf, src + part)
        if t.shape != param.shape:
            raise CheckpointError(
                f"{src}{part}: shape {tuple(t.shape)}, expected {tuple(param.shape)}"
            )
        out[full_name] = t
    return out


def hf_name(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp.layers." + name[len("mtp.") :]
    if name == "lm_head.weight":
        return name
    return "model." + name


def _take(hf: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return hf[key]
    except KeyError:
        raise CheckpointError(f"model.safetensors is missing tensor {key!r}") from None


def _experts(hf: dict, src: str, gate_up: bool, num_experts: int, part: str) -> torch.Tensor:
    base = src.rsplit(".", 1)[0]  # "...mlp"
    fused = f"{base}.experts.{'gate_up_proj' if gate_up else 'down_proj'}{part}"
    if fused in hf:  # already stacked, as transformers holds it in memory
        return hf[fused]
    projections = ("gate", "up") if gate_up else ("down",)
    return torch.stack(
        [
            torch.cat([_take(hf, f"{base}.experts.{e}.{p}_proj.weight{part}") for p in projections])
            for e in range(num_experts)
        ]
    )
