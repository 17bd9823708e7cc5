"""A tokenizer's vocabulary as byte tries, so a byte validator
(`serving.engine.json_validator.ByteValidator`) can test every token in one walk."""

import functools
from collections.abc import Callable, Hashable
from typing import Any

import tokenizers
import torch
from tokenizers import decoders

from serving.engine.json_validator import ByteValidator, plain_string_content

# Masks are built on the host, where the vocabulary walk runs; the sampler copies the one a
# row needs to the logits' device.
HOST = torch.device("cpu")


class _Node:
    __slots__ = ("children", "ids")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.ids: list[int] = []  # tokens whose bytes end here

    def insert(self, data: bytes, token_id: int) -> None:
        node = self
        for c in data:
            child = node.children.get(c)
            if child is None:
                child = node.children[c] = _Node()
            node = child
        node.ids.append(token_id)


class Vocabulary:
    """A tokenizer's tokens as the bytes each appends to the output, in byte tries.

    None marks a token that never appears in JSON output (special tokens, tokens of no
    bytes). The tries let `allowed` test the whole vocabulary in one walk that drops every
    token behind a rejected prefix. Inside a string most tokens are plain text, allowed in
    any string whatever surrounds it: they are a precomputed mask there, and only the
    others are walked. Built once per tokenizer (`json_vocabulary`), shared by every
    constrained sequence, and so is its cache of allowed sets, keyed by state: a model
    writing JSON revisits few states, so the exhaustive set is mostly a lookup.
    """

    cache_size = 256  # allowed sets kept: each costs one byte per token

    def __init__(self, token_bytes: list[bytes | None]) -> None:
        self.token_bytes = token_bytes
        self.root = _Node()  # every token
        self.not_plain = _Node()  # every token that is not plain string content
        plain, byteless = [], []
        for i, data in enumerate(token_bytes):
            if not data:
                byteless.append(i)
                continue
            self.root.insert(data, i)
            if plain_string_content(data):
                plain.append(i)
            else:
                self.not_plain.insert(data, i)
        self.plain = torch.zeros(len(token_bytes), dtype=torch.bool, device=HOST)
        self.plain[plain] = True
        # EOS and the other special tokens: never in a validator's language, free in text.
        self.byteless = torch.zeros(len(token_bytes), dtype=torch.bool, device=HOST)
        self.byteless[byteless] = True
        self._allowed: dict[Hashable, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.token_bytes)

    def allowed(self, validator: ByteValidator) -> torch.Tensor:
        """Bool [len(self)]: the tokens `validator` accepts next. Shared: do not modify."""
        key = validator.cache_key
        mask = self._allowed.get(key)
        if mask is None:
            rejected = validator.plain_rejected
            if rejected is not None:
                mask, root = self.plain.clone(), self.not_plain
                if rejected:
                    mask[
                        torch.tensor(self._starting_with(rejected), dtype=torch.long, device=HOST)
                    ] = False
            else:
                mask, root = torch.zeros(len(self), dtype=torch.bool, device=HOST), self.root
            ids = self._walk(root, validator.state, validator.step)
            mask[torch.tensor(ids, dtype=torch.long, device=HOST)] = True
            if len(self._allowed) >= self.cache_size:
                del self._allowed[next(iter(self._allowed))]  # the oldest
            self._allowed[key] = mask
        return mask

    def _starting_with(self, prefix: bytes) -> list[int]:
        node: _Node | None = self.root
        for c in prefix:
            node = node.children.get(c)
            if node is None:
                return []
        ids, todo = [], [node]
        while todo:
            node = todo.pop()
            ids += node.ids
            todo += node.children.values()
        return ids

    @staticmethod
    def _walk(root: _Node, state: Any, step: Callable[[Any, int], Any | None]) -> list[int]:
        ids: list[int] = []
        todo = [(root, state)]
        while todo:
            node, state = todo.pop()
            ids += node.ids
            for c, child in node.children.items():
                nxt = step(state, c)
                if nxt is not None:
                    todo.append((child, nxt))
        return ids


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: the byte each ByteLevel symbol stands for."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


@functools.lru_cache(maxsize=8)
def json_vocabulary(tokenizer: tokenizers.Tokenizer) -> Vocabulary:
    """The Vocabulary of a byte-level BPE tokenizer (Qwen's, ours), cached per tokenizer.

    Bytes are exactly what the ByteLevel decoder makes of a token: its symbols mapped back
    to bytes, or its UTF-8 if any symbol is not a byte symbol (an added token such as
    `<think>`, whose ASCII symbols map to themselves anyway). Special tokens get None.
    Other decoders (SentencePiece's Metaspace) change a token's text with its position, so
    they are refused rather than risking invalid output.
    """
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        raise ValueError("json_object needs a byte-level BPE tokenizer")
    table = _byte_decoder()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    token_bytes: list[bytes | None] = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            token_bytes.append(None)
        elif all(ch in table for ch in token):
            token_bytes.append(bytes(table[ch] for ch in token))
        else:
            token_bytes.append(token.encode())
    return Vocabulary(token_bytes)
