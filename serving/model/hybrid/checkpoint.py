"""Qwen3-Next checkpoint directories in and out of `HybridCausalLM`: one transformers wrote,
loaded onto our fused layout, and ours written so that transformers loads it.

Tensor names are transformers' (`model.layers.{i}.linear_attn.in_proj_qkvz.weight`, per-expert
`mlp.experts.{e}.gate_proj.weight`, ...). The mapping onto our fused layout is the one Qwen3-MoE
checkpoints use (`serving.model.hf_state_dict.from_hf_state_dict`: q/k/v into `qkv_proj`,
gate and up into `gate_up_proj`, experts stacked), which our parameter names drive; the
shared expert's gate and up projections are fused here first, as that mapping knows only the
layer's own MLP. Every tensor is checked for presence and shape. Writing undoes each fusion
and gives the experts one tensor each, as transformers writes them.
"""

from pathlib import Path

import torch

from serving.model.checkpoint import read_safetensors, write_directory
from serving.model.config import CheckpointError
from serving.model.dtype import resolve_dtype
from serving.model.hf_state_dict import from_hf_state_dict, hf_name
from serving.model.hybrid.config import HybridConfig
from serving.model.hybrid.model import HybridCausalLM

CPU = torch.device("cpu")


def load_hybrid_checkpoint(
    path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device = CPU
) -> HybridCausalLM:
    """The model of a Qwen3-Next checkpoint directory, in `dtype` on `device`: a torch dtype,
    or a `--dtype` name (`auto`: the checkpoint's, `serving/model/dtype.py`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    config = HybridConfig.from_file(path / "config.json")
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, config.dtype, device)
    with torch.device("meta"):
        model = HybridCausalLM(config)
    hf = _fuse_shared_experts(read_safetensors(path, device), config)
    state = from_hf_state_dict(hf, model)  # type: ignore[arg-type]
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Built on meta with the model: the RoPE tables are rebuilt where the weights are.
    model.rotary = type(model.rotary)(
        config.rotary_dim, config.max_position_embeddings, config.rope_theta
    ).to(device)
    return model.eval()


def _fuse_shared_experts(
    hf: dict[str, torch.Tensor], config: HybridConfig
) -> dict[str, torch.Tensor]:
    for i in range(config.num_hidden_layers):
        if not config.layer_is_sparse(i):
            continue
        base = f"model.layers.{i}.mlp.shared_expert"
        names = [f"{base}.{p}_proj.weight" for p in ("gate", "up")]
        missing = [n for n in names if n not in hf]
        if missing:
            raise CheckpointError(f"model.safetensors is missing tensor {missing[0]!r}")
        gate, up = (hf.pop(n) for n in names)
        if gate.shape != up.shape:
            raise CheckpointError(
                f"{base}: gate_proj {tuple(gate.shape)} and up_proj {tuple(up.shape)} differ"
            )
        hf[f"{base}.gate_up_proj.weight"] = torch.cat([gate, up])
    return hf


def save_hybrid_checkpoint(
    model: HybridCausalLM,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict | None = None,
) -> None:
    """Write a directory that transformers' `Qwen3NextForCausalLM` and our loader both read."""
    tensors = to_hf_hybrid_state_dict(model)
    write_directory(model, path, model.config.to_dict(), tensors, tokenizer_dir, generation_config)


def to_hf_hybrid_state_dict(model: HybridCausalLM) -> dict[str, torch.Tensor]:
    """Our tensors under the names transformers writes: the fused projections split again
    (`q_proj` holds each head's queries and output gate, as stored), experts one by one."""
    cfg, out = model.config, {}
    kv = cfg.num_key_value_heads * cfg.head_dim
    qkv_split = [2 * cfg.num_attention_heads * cfg.head_dim, kv, kv]
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        hf = hf_name(name)
        base, _, leaf = hf.rpartition(".")
        if base.endswith("qkv_proj"):
            prefix = base.removesuffix("qkv_proj")
            for p, part in zip("qkv", t.split(qkv_split), strict=True):
                out[f"{prefix}{p}_proj.{leaf}"] = part
        elif base.endswith("gate_up_proj"):  # a dense MLP or the shared expert
            prefix = base.removesuffix("gate_up_proj")
            out[f"{prefix}gate_proj.weight"], out[f"{prefix}up_proj.weight"] = t.chunk(2)
        elif hf.endswith("mlp.gate_up") or hf.endswith("mlp.down"):
            for e, expert in enumerate(t):
                parts = expert.chunk(2) if leaf == "gate_up" else (expert,)
                names = ("gate", "up") if leaf == "gate_up" else ("down",)
                for p, part in zip(names, parts, strict=True):
                    out[f"{base}.experts.{e}.{p}_proj.weight"] = part
        else:
            out[hf] = t
    return {k: v.contiguous() for k, v in out.items()}
