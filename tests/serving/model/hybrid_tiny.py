"""The tiny random Qwen3-Next that the hybrid tests share: transformers builds and saves it,
so every test starts from a checkpoint transformers wrote."""

import shutil
from pathlib import Path

import torch

from tests import REPO

# The shipped tokenizer's files, and the vocabulary a model needs to read every id it encodes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TOKENIZER_VOCAB = 2746

VOCAB = 97
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head: grouped value attention
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def hf_hybrid_model(**over: object) -> torch.nn.Module:
    """transformers' `Qwen3NextForCausalLM` on TINY (`over` replacing fields), seeded."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**(TINY | over)))
    with torch.no_grad():  # norms start at 0 (1 + w) or 1: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_hybrid_checkpoint(path: Path, **over: object) -> torch.nn.Module:
    """Save `hf_hybrid_model(**over)` at `path` and return it."""
    model = hf_hybrid_model(**over)
    model.save_pretrained(path)
    return model


def write_served_hybrid_checkpoint(path: Path) -> None:
    """A hybrid checkpoint with the shipped tokenizer beside it, as `tierserve engine` serves."""
    write_hybrid_checkpoint(path, vocab_size=TOKENIZER_VOCAB)
    for name in TOKENIZER_FILES:
        shutil.copy(REPO / "models" / "demo-full" / name, path / name)
