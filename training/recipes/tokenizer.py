"""The recipe's first stage: a byte-level BPE tokenizer trained on every kind of text the
models will see, so no domain's words fall apart into bytes."""

import json
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from training.config import DataConfig
from training.data.datasets import chat_examples
from training.data.tokenizer import save_tokenizer, train_tokenizer


def tokenizer_corpus(data: DataConfig) -> Iterator[str]:
    """Every kind of text the models see: turns of both styles, observations, tool schemas."""
    for style in ("think", "short"):
        for example in chat_examples(data, style):
            for message in example["messages"]:
                if message.get("content") and message["role"] != "assistant":
                    yield message["content"]
            for _, turn in example["turns"]:
                yield turn
            for tool in example.get("tools") or []:
                yield json.dumps(tool, ensure_ascii=False)


def build_tokenizer(out: Path, vocab_size: int, examples: int) -> Path:
    """Train it into `out` once; a finished one is kept."""
    if (out / "tokenizer.json").exists():
        return out
    corpus = tqdm(tokenizer_corpus(DataConfig(examples=examples)), desc="tokenizer corpus")
    save_tokenizer(train_tokenizer(corpus, vocab_size), out)
    return out
