"""The target's own multi-token-prediction layer drafts (DeepSeek-V3 style).

The MTP layer at position t combines the target's final hidden state at t with the
embedding of token t + 1 and predicts token t + 2. It is a decoder block with attention,
so it keeps keys and values of its own for every position: they live in the target's
blocks (the model runner gives the MTP block a cache shaped like the target layers'), and
after every step the layer runs over the positions the target just computed ("catch-up"),
with this step's hidden states. Its output at the last computed position predicts the
first draft; further drafts chain the same layer on its own output and the previous draft
(like vLLM with more speculative tokens than MTP layers; deeper MTP layers are not used).
Chained positions lie past the computed ones, so the target's verification step and the
next catch-up overwrite them.

Steps without speculation (a busy engine) skip the catch-up to save its cost, and so does a
sequence that has decoded `IDLE_STEPS_KEPT` steps in a row without drafts (its lookahead
fell to 0 and a probe did not revive it, or it cannot speculate): such sequences lose
their MTP context and are not drafted again. A prefix-cache
hit reuses MTP entries written by the sequence that cached the blocks; at the last
position of the last shared block that entry saw that sequence's next token, which can
only lower acceptance, never change outputs.
"""

import torch

from serving.model.causal_lm import CausalLM
from serving.model.paged import PagedModel, TokenSpan
from speculative.draft_model import propose_tokens
from speculative.proposer import BlockAllocator, DraftSequence, TargetStep

# A sequence decoding without drafts keeps its MTP context this many steps (the speculator
# probes again after 8), then gives it up to save the catch-up.
IDLE_STEPS_KEPT = 8


class MTPProposer:
    def __init__(self, runner: PagedModel, blocks: BlockAllocator, vocab: int) -> None:
        model: CausalLM = runner.model
        if not model.mtp:
            raise ValueError("method 'mtp' needs a checkpoint with MTP weights (tierserve_mtp)")
        self.runner = runner
        self.model = model
        self.layer = model.mtp[0]
        self.blocks = blocks
        self.vocab = vocab
        self.gapped: set[int] = set()  # sequences whose MTP cache missed a step
        self.idle: dict[int, int] = {}  # steps each sequence has decoded without drafts

    def _forward(self, items: list[tuple[TokenSpan, torch.Tensor]]) -> list[torch.Tensor]:
        """The MTP layer's outputs over spans of (position, next token) with the target's
        hidden states at those positions; one tensor per item, in the given order."""
        order = sorted(range(len(items)), key=lambda i: len(items[i][0].token_ids) != 1)
        ids, positions, meta = self.runner.prepare([items[i][0] for i in order])
        hidden = torch.cat([items[i][1] for i in order])
        rope = self.model.rotary(positions, hidden.dtype)
        out = self.layer(hidden, self.model.embed_tokens(ids), rope, meta, None)
        parts = out.split([len(items[i][0].token_ids) for i in order])
        result: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for i, part in zip(order, parts, strict=True):
            result[i] = part
        return result

    @torch.inference_mode()
    def propose(self, seqs: list[DraftSequence], ks: list[int], step: TargetStep) -> None:
        items, owners = [], []
        wanted = {s.seq_id for s in seqs}
        offset = 0
        for (seq, n), start in zip(step.batch, step.starts, strict=True):
            computed = seq.num_computed_tokens - start  # fed and kept (drafts may be rejected)
            live = not seq.is_finished and seq.block_table and seq.seq_id not in self.gapped
            if live and seq.num_computed_tokens == len(seq) - 1:
                idle = 0 if seq.seq_id in wanted else self.idle.get(seq.seq_id, 0) + 1
                self.idle[seq.seq_id] = idle
                if idle > IDLE_STEPS_KEPT:  # decoding without drafts: no catch-up from now on
                    self.gapped.add(seq.seq_id)
                    live = False
            if live:
                span = TokenSpan(
                    seq.block_table, start, seq.token_ids[start + 1 : start + computed + 1]
                )
                items.append((span, step.hidden[offset : offset + computed]))
                owners.append(seq)
            offset += n
        if not items:
            return
        outputs = self._forward(items)
        # The output at each sequence's last computed position predicts its first draft.
        hidden = {seq.seq_id: out[-1:] for seq, out in zip(owners, outputs, strict=True)}
        drafting = [(s, k) for s, k in zip(seqs, ks, strict=True) if s.seq_id in hidden]
        probs: dict[int, list[torch.Tensor | None]] = {s.seq_id: [] for s, _ in drafting}
        for depth in range(max((k for _, k in drafting), default=0)):
            if depth:  # chain: position N + depth - 1 needs a block
                drafting = [
                    (s, k)
                    for s, k in drafting
                    if k > depth and self.blocks.allocate_slots(s, depth)
                ]
                if not drafting:
                    break
                outs = self._forward(
                    [
                        (
                            TokenSpan(
                                s.block_table,
                                s.num_computed_tokens + depth - 1,
                                [s.draft_token_ids[-1]],
                            ),
                            hidden[s.seq_id],
                        )
                        for s, _ in drafting
                    ]
                )
                hidden = {s.seq_id: out for (s, _), out in zip(drafting, outs, strict=True)}
            rows = torch.cat([hidden[s.seq_id] for s, _ in drafting])
            logits = self.model.compute_logits(rows)[:, : self.vocab]
            tokens, qs = propose_tokens(logits, [s for s, _ in drafting])
            for (s, _), token, q in zip(drafting, tokens, qs, strict=True):
                s.draft_token_ids.append(token)
                probs[s.seq_id].append(q)
        for s in seqs:
            qs = probs.get(s.seq_id)
            if qs and qs[0] is not None:
                s.draft_probs = torch.stack(qs)

    def pause(self, step: TargetStep) -> None:
        self.gapped.update(seq.seq_id for seq, _ in step.batch)

    def release(self, seq: DraftSequence) -> None:
        self.gapped.discard(seq.seq_id)
        self.idle.pop(seq.seq_id, None)
