"""Loading a Qwen3-Next checkpoint directory written by transformers into `HybridCausalLM`.

Tensor names are transformers' (`model.layers.{i}.linear_attn.in_proj_qkvz.weight`, per-expert
`mlp.experts.{e}.gate_proj.weight`, ...). The mapping onto our fused layout is the one Qwen3-MoE
checkpoints use (`serving.model.hf_state_dict.from_hf_state_dict`: q/k/v into `qkv_proj`,
gate and up into `gate_up_proj`, experts stacked), which our parameter names drive; the
shared expert's gate and up projections are fused here first, as that mapping knows only the
layer's own MLP. Every tensor is checked for presence and shape.
"""

from pathlib import Path

import torch

from serving.model.checkpoint import read_safetensors
from serving.model.config import CheckpointError
from serving.model.dtype import resolve_dtype
from serving.model.hf_state_dict import from_hf_state_dict
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
