"""What a drafter sees of the engine, as protocols: speculative/ sits below the engine and
never imports it. The engine's `Sequence`, `BlockManager` and `StepOutput` fit them."""

from typing import Protocol

import torch

from serving.sampling.params import SamplingParams


class DraftSequence(Protocol):
    """A running sequence: drafters read its tokens and cache place, and write its drafts."""

    seq_id: int
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    # Tokens proposed for the next step, and the drafter's distributions [k, V] they were
    # drawn from (None when proposed deterministically).
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None

    @property
    def is_finished(self) -> bool: ...

    def __len__(self) -> int: ...


class CachedTokens(Protocol):
    """Whatever holds blocks: a sequence, or a draft model's shadow of one."""

    seq_id: int
    num_computed_tokens: int
    block_table: list[int]


class BlockAllocator(Protocol):
    """The engine's block manager, as drafters use it: room for chained drafts in the target's
    blocks (MTP), or a draft model's own blocks."""

    num_blocks: int
    block_size: int

    def allocate_slots(self, seq: CachedTokens, num_new_tokens: int) -> bool: ...

    def free_unused(self, seq: CachedTokens, num_tokens: int) -> None: ...

    def free_sequence(self, seq: CachedTokens) -> None: ...


class TargetStep(Protocol):
    """The target's last step: final hidden states of every token fed, in batch order."""

    hidden: torch.Tensor  # [tokens, hidden]
    batch: list[tuple[DraftSequence, int]]  # (sequence, tokens fed), decodes first
    starts: list[int]  # position of each sequence's first token fed


class Proposer(Protocol):
    """A drafter. `propose` sets `draft_token_ids` (and `draft_probs` when it samples) of
    each sequence for up to its k tokens, after a step whose output it may read; `pause`
    replaces it in steps without speculation; `release` forgets a finished sequence;
    `ready` says whether it drafts at its speed yet (a drafter whose compiled steps are
    still being built would draft eagerly, at a cost above what its drafts save)."""

    def ready(self) -> bool: ...

    def propose(self, seqs: list[DraftSequence], ks: list[int], step: TargetStep) -> None: ...

    def pause(self, step: TargetStep) -> None: ...

    def release(self, seq: DraftSequence) -> None: ...
