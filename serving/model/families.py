"""The two model families behind one interface: the MoE family (`CausalLM`, Qwen3-MoE and
Qwen3) and the hybrid one (`HybridCausalLM`, Qwen3-Next), told apart by config.json, so that
what takes either (the engine, the trainer, a training stage's export) builds, loads and
saves a model without asking which it is.
"""

from pathlib import Path
from typing import Any

import torch

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint, save_checkpoint
from serving.model.config import ModelConfig
from serving.model.device import CPU
from serving.model.hybrid.checkpoint import load_hybrid_checkpoint, save_hybrid_checkpoint
from serving.model.hybrid.config import HybridConfig, is_hybrid_checkpoint, is_hybrid_config
from serving.model.hybrid.model import HybridCausalLM

LanguageModel = CausalLM | HybridCausalLM


def new_model(raw: dict[str, Any]) -> LanguageModel:
    """A model of config.json fields `raw`, with transformers' random initialisation."""
    if is_hybrid_config(raw):
        model: LanguageModel = HybridCausalLM(HybridConfig.from_dict(raw))
    else:
        model = CausalLM(ModelConfig.from_dict(raw))
    model.init_weights()
    return model


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device = CPU,
    keep_fp4: bool | None = None,
) -> LanguageModel:
    """The model of a checkpoint directory of either family (`keep_fp4`: `load_checkpoint`'s,
    for the MoE family; the hybrid family has no FP4 checkpoints)."""
    if is_hybrid_checkpoint(path):
        return load_hybrid_checkpoint(path, dtype, device)
    return load_checkpoint(path, dtype, device, keep_fp4)


def save_model(
    model: LanguageModel,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    generation_config: dict | None = None,
) -> None:
    """A checkpoint directory that transformers and `load_model` both read."""
    if isinstance(model, HybridCausalLM):
        save_hybrid_checkpoint(model, path, tokenizer_dir, generation_config)
    else:
        save_checkpoint(model, path, tokenizer_dir, generation_config)
