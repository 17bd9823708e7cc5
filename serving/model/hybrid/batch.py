"""The layout of one call's batch, worked out once for every layer.

Rows are right-padded: each row's real tokens come first (`padding_mask` True), so a row's
state after the call is its state after its last real token, and its new tokens take the
positions that follow the tokens it has already seen.

The engine's steps are flat token arrays instead (the paged KV cache's layout); its DeltaNet
calls take them in `SlotGroup`s, batches without padding, so a step's decodes share one call.
"""

from dataclasses import dataclass

import torch


@dataclass
class PaddedBatch:
    lengths: torch.Tensor  # [B] long: real tokens of each row in this call
    past: torch.Tensor  # [B] long: tokens each row saw before this call (0 without a state)
    positions: torch.Tensor  # [B, L] long: past + index in the call
    token_mask: torch.Tensor | None  # [B, L] bool, True on real tokens; None when none is padding
    kv_width: int  # key slots a full-attention layer attends over
    attn_mask: torch.Tensor  # [B, 1, L, kv_width] bool: query i of row b sees slots <= past + i

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        past: torch.Tensor | None,
        past_width: int,
    ) -> "PaddedBatch":
        """`past_width`: the slots of the full-attention layers' stored keys (0 without)."""
        b, length = input_ids.shape
        device = input_ids.device
        index = torch.arange(length, device=device)
        if padding_mask is None:
            lengths = torch.full((b,), length, dtype=torch.long, device=device)
            token_mask = None
        else:
            padding_mask = padding_mask.bool()
            lengths = padding_mask.sum(-1)
            if not torch.equal(padding_mask, index[None, :] < lengths[:, None]):
                raise ValueError("padding_mask must be right-padded: each row's tokens first")
            token_mask = None if bool(padding_mask.all()) else padding_mask
        past = torch.zeros(b, dtype=torch.long, device=device) if past is None else past
        positions = past[:, None] + index[None, :]
        kv_width = max(past_width, int(past.max()) + length)
        slots = torch.arange(kv_width, device=device)
        attn_mask = slots[None, None, :] <= positions[:, :, None]
        return cls(lengths, past, positions, token_mask, kv_width, attn_mask[:, None])


@dataclass
class SlotGroup:
    """Tokens one DeltaNet call takes as a [rows, length] batch with no padding: the step's
    single-token spans together, each longer span alone."""

    offset: int  # the group's first token in the step's flat token array
    rows: int
    length: int
    slots: torch.Tensor  # [rows] long: each row's slot
    lengths: torch.Tensor  # [rows] long: `length` in every row
    verify: bool = False  # a span of drafts to verify: the state after each token is kept


def slot_groups(
    lengths: list[int], slots: list[int], verify: list[bool], device: torch.device
) -> list[SlotGroup]:
    """The groups of a step whose spans (`lengths` tokens each, single tokens first, as the
    flat token array lays them out) hold `slots`; `verify` marks the spans that end in
    drafts."""
    singles = 0
    while singles < len(lengths) and lengths[singles] == 1:
        singles += 1
    groups = []
    if singles:
        groups.append(_group(0, singles, 1, slots[:singles], device))
    offset = singles
    for n, slot, drafts in zip(lengths[singles:], slots[singles:], verify[singles:], strict=True):
        groups.append(_group(offset, 1, n, [slot], device, drafts))
        offset += n
    return groups


def _group(
    offset: int,
    rows: int,
    length: int,
    slots: list[int],
    device: torch.device,
    verify: bool = False,
) -> SlotGroup:
    lengths = torch.full((rows,), length, dtype=torch.long, device=device)
    return SlotGroup(offset, rows, length, torch.tensor(slots, device=device), lengths, verify)
