"""A step's token spans, and the inputs a forward pass takes from them.

A span is a sequence's tokens at consecutive positions with its block table: a decode (one
token), a prefill chunk, or a last token and the drafts to verify after it. An eager forward
takes them as flat ids, positions and attention metadata (`prepare_spans`), a compiled decode
step as rows, one a token (`graph_rows`).
"""

from dataclasses import dataclass

import numpy as np
import torch

from serving.model.attention import (
    SHORT_CHUNK,
    AttentionMetadata,
    PrefillChunk,
    ShortChunks,
    padded_tables,
)


@dataclass
class TokenSpan:
    """A sequence's tokens in one forward pass: `token_ids` at positions `start`, `start + 1`..."""

    block_table: list[int]
    start: int
    token_ids: list[int]
    state_slot: int | None = None  # a hybrid model's DeltaNet state slot (`hybrid/slots.py`)
    num_drafts: int = 0  # the last of `token_ids` that are drafts to verify


def prepare_spans(
    spans: list[TokenSpan], block_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flat input ids, positions and attention metadata on the model's device; single
    tokens (decodes) first. Built from host lists, one copy to the device per tensor."""
    bs = block_size
    nd = 0
    while nd < len(spans) and len(spans[nd].token_ids) == 1:
        nd += 1
    ids = [s.token_ids[0] for s in spans[:nd]]
    positions = [s.start for s in spans[:nd]]
    slots = [s.block_table[s.start // bs] * bs + s.start % bs for s in spans[:nd]]
    tables = lens = None
    if nd:
        tables = padded_tables([s.block_table for s in spans[:nd]], device)
        lens = long_tensor(device, [p + 1 for p in positions])
    prefills: list[PrefillChunk] = []
    short: list[tuple[TokenSpan, int]] = []
    for s in spans[nd:]:
        n = len(s.token_ids)
        if n <= SHORT_CHUNK:
            short.append((s, len(ids)))
        else:
            prefills.append(
                PrefillChunk(len(ids), n, s.start + n, long_tensor(device, s.block_table))
            )
        ids.extend(s.token_ids)
        positions.extend(range(s.start, s.start + n))
        slots.extend(s.block_table[p // bs] * bs + p % bs for p in range(s.start, s.start + n))
    meta = AttentionMetadata(
        slot_mapping=long_tensor(device, slots),
        num_decodes=nd,
        decode_block_tables=tables,
        decode_context_lens=lens,
        prefills=prefills,
    )
    if short:
        meta.short = ShortChunks.build(
            [s.start for s, _ in short],
            [len(s.token_ids) for s, _ in short],
            [offset for _, offset in short],
            [s.block_table for s, _ in short],
            bs,
            dtype,
            device,
        )
    meta.prepare(bs, dtype, device)
    return long_tensor(device, ids), long_tensor(device, positions), meta


def long_tensor(device: torch.device, values: list[int]) -> torch.Tensor:
    """Host ints as one long tensor on the device: a step's ids, positions and tables.
    Through numpy, which converts a list of ints several times faster than `torch.tensor`."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def graph_rows(spans: list[TokenSpan]) -> tuple[list[int], list[int], list[list[int]]]:
    """A compiled step's rows, one a token: ids, positions and each row's block table."""
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    for s in spans:
        ids += s.token_ids
        positions += range(s.start, s.start + len(s.token_ids))
        tables += [s.block_table] * len(s.token_ids)
    return ids, positions, tables
