"""A randomly initialised checkpoint with a freshly trained tokenizer: step 0 of pretraining.

Until the training recipes ship trained models, this is what `tierserve` serves out of the
box, and the benchmark shape is built the same way. The tokenizer is trained on Python's
own standard-library sources, which every machine has, so nothing is downloaded.
"""

import json
import sysconfig
import tomllib
from collections.abc import Iterator
from pathlib import Path

import torch

from serving.model.families import new_model, save_model
from training.data.tokenizer import EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

# A ~5M-parameter Qwen3-MoE: small enough to answer instantly on a laptop CPU.
DEFAULT_SHAPE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


def stdlib_corpus(limit_bytes: int = 4 << 20) -> Iterator[str]:
    """Up to `limit_bytes` of text from the standard library's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        yield text
        total += len(text)
        if total >= limit_bytes:
            return


def read_shape(path: str | Path) -> dict:
    """A shape file: a config.json, a benchmark card holding one under "config", or a stage
    file (`.toml`) whose `[shape]` a pretraining builds its model from."""
    path = Path(path)
    if path.suffix == ".toml":
        raw = tomllib.loads(path.read_text())["shape"]
    else:
        raw = json.loads(path.read_text())
    shape = raw.get("config", raw)
    shape.setdefault("architectures", raw.get("architectures", ["Qwen3MoeForCausalLM"]))
    return shape


def init_checkpoint(out_dir: str | Path, shape: dict | None = None, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    shape = dict(shape or DEFAULT_SHAPE)
    tok = train_tokenizer(stdlib_corpus(), shape["vocab_size"])
    shape["vocab_size"] = max(shape["vocab_size"], tok.get_vocab_size())
    shape["eos_token_id"] = tok.token_to_id(EOS_TOKEN)
    shape["pad_token_id"] = tok.token_to_id(PAD_TOKEN)
    torch.manual_seed(seed)
    model = new_model(shape)  # either family, by the shape's architectures
    save_tokenizer(tok, out_dir)
    save_model(model, out_dir, generation_config={"eos_token_id": shape["eos_token_id"]})
    return out_dir
