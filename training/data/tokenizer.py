"""Train and save a Qwen3-style byte-level BPE tokenizer.

The pipeline (NFC, Qwen2's split regex, byte-level with no prefix space, ByteLevel decoder) is
the one transformers' `Qwen2Tokenizer` builds, so transformers, vLLM and our own
`serving.model.tokenizer.Tokenizer` all tokenize a saved checkpoint identically.
"""

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from tasks.answers import MARKUP

# Qwen2/Qwen3's pre-tokenizer regex: digits split one by one, which helps arithmetic.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Control tokens: skipped by `decode(skip_special_tokens=True)`.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Markup the parsers read back from decoded text, so (as in Qwen3) not special.
MARKUP_TOKENS = list(MARKUP)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 32768
CHAT_TEMPLATE = resources.files("serving.model") / "chat_template.jinja"


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on `texts`; ids 0..8 are the control and markup tokens.

    `vocab_size` counts them and the 256 byte symbols; a small corpus may give fewer.
    """
    reserved = SPECIAL_TOKENS + MARKUP_TOKENS
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + len(reserved)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum}, got {vocab_size}")
    tok = _empty_tokenizer()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=reserved,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer marks every reserved token special; unmark the markup ones.
    spec = json.loads(tok.to_str())
    for added in spec["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(spec))


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict]:
    """The `added_tokens_decoder` entries transformers writes into tokenizer_config.json."""
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {
        str(added["id"]): {key: added[key] for key in keys}
        for added in json.loads(tok.to_str())["added_tokens"]
    }


def save_tokenizer(
    tok: Tokenizer, out_dir: str | Path, model_max_length: int = MODEL_MAX_LENGTH
) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # Qwen3's layout; added_tokens_decoder is what transformers 4 writes (5 reads tokenizer.json).
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(tok),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        # The legacy key: transformers 4 (vLLM) reads it, 5 maps it to extra_special_tokens.
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    template = CHAT_TEMPLATE.read_text(encoding="utf-8")
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
