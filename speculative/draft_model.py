"""A small draft model sharing the target's tokenizer proposes tokens one by one.

It has its own paged KV cache and block manager. Each sequence being drafted has a shadow
sequence there: the tokens whose keys and values the draft model holds. Before drafting,
the shadow is cut back to its common prefix with the real sequence (drafts the target
rejected are dropped, their blocks freed), the new tokens are fed as one chunk (the whole
prompt the first time), then k - 1 decode steps give the rest; every step batches all
sequences being drafted.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from serving.model.checkpoint import load_checkpoint
from serving.model.paged import PagedModel
from serving.model.spans import TokenSpan
from serving.sampling.rejection import draw, processed_probs
from speculative.proposer import BlockAllocator, DraftSequence, TargetStep


def propose_tokens(
    logits: torch.Tensor, seqs: list[DraftSequence]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft token per row, greedy or drawn from the row's processed distribution
    (whose row is returned, the q of rejection sampling). One argmax and one copy to the
    host serve every greedy row: per row they were most of a compiled draft step's time."""
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            q = processed_probs(logits[i : i + 1], seq.params)
            tokens[i] = int(draw(q, seq.generator))
            probs[i] = q[0]
    return tokens, probs


@dataclass
class _Shadow:
    """The draft model's copy of a sequence: its tokens, computed prefix and blocks."""

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    synced: int = 0  # its first `synced` tokens are known to equal the real sequence's


class DraftModelProposer:
    def __init__(
        self,
        path: Path,
        blocks: BlockAllocator,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`blocks`: the draft model's own, as many as the target's (a shadow never holds
        more tokens than its sequence), without prefix caching; `dtype` and `device`: the
        target's."""
        model = load_checkpoint(path, dtype, device)
        if model.config.vocab_size > vocab or model.config.num_experts:
            raise ValueError(f"{path}: a draft model must be dense and share the tokenizer")
        self.paged = PagedModel(model, blocks.num_blocks, blocks.block_size)
        self.blocks = blocks
        self.vocab = vocab
        self.max_len = model.config.max_position_embeddings
        self.shadows: dict[int, _Shadow] = {}

    def _sync(self, seq: DraftSequence) -> _Shadow:
        """The shadow cut back to its common prefix with `seq`: only tokens fed since the
        last sync (drafts) can differ."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = _Shadow(seq.seq_id)
        tokens = shadow.token_ids
        match = shadow.synced
        end = min(shadow.num_computed_tokens, len(seq))
        while match < end and tokens[match] == seq.token_ids[match]:
            match += 1
        # At least the last token is fed again: its logits give the first draft. (A budget
        # cut can leave the verified sequence no longer than what the shadow computed.)
        match = min(match, len(seq) - 1)
        shadow.num_computed_tokens = match
        del tokens[match:]  # only the new tail is copied, not the whole sequence
        tokens += seq.token_ids[match:]
        shadow.synced = len(seq)
        self.blocks.free_unused(shadow, match)
        return shadow

    def propose(self, seqs: list[DraftSequence], ks: list[int], step: TargetStep) -> None:
        shadows, live, todo = [], [], []
        for seq, k in zip(seqs, ks, strict=True):
            shadow = self._sync(seq)
            # Room for the new tokens and k - 1 drafts fed back (the k-th is never fed).
            new = len(seq) - shadow.num_computed_tokens + k - 1
            if len(seq) + k <= self.max_len and self.blocks.allocate_slots(shadow, new):
                shadows.append(shadow)
                live.append(seq)
                todo.append(k)
        if not live:
            return
        spans = [
            TokenSpan(s.block_table, s.num_computed_tokens, s.token_ids[s.num_computed_tokens :])
            for s in shadows
        ]
        order = sorted(range(len(spans)), key=lambda i: len(spans[i].token_ids) != 1)
        probs: list[list[torch.Tensor | None]] = [[] for _ in live]
        for depth in range(max(todo)):
            active = [i for i in order if todo[i] > depth]
            hidden = self.paged.forward([spans[i] for i in active])
            lengths = [len(spans[i].token_ids) for i in active]
            ends = torch.tensor(lengths, device=self.paged.device).cumsum(0) - 1
            logits = self.paged.model.compute_logits(hidden[ends])[:, : self.vocab]
            tokens, qs = propose_tokens(logits, [live[i] for i in active])
            for i, token, q in zip(active, tokens, qs, strict=True):
                shadow, seq = shadows[i], live[i]
                shadow.num_computed_tokens += len(spans[i].token_ids)
                shadow.token_ids.append(token)
                seq.draft_token_ids.append(token)
                probs[i].append(q)
                spans[i] = TokenSpan(shadow.block_table, shadow.num_computed_tokens, [token])
        for seq, qs in zip(live, probs, strict=True):
            if qs[0] is not None:
                seq.draft_probs = torch.stack(qs)

    def ready(self) -> bool:
        return True

    def pause(self, step: TargetStep) -> None:
        pass

    def release(self, seq: DraftSequence) -> None:
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.blocks.free_sequence(shadow)
