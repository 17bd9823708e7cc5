"""The target's own multi-token-prediction layer drafts (DeepSeek-V3 style).

The MTP layer at position t combines the target's final hidden state at t with the
embedding of token t + 1 and predicts token t + 2. It is a decoder block with attention,
so it keeps keys and values of its own for every position: they live in the target's
blocks (the paged model gives the MTP block a cache shaped like the target layers'), and
after every step the layer runs over the positions the target just computed ("catch-up"),
with this step's hidden states. Its output at the last computed position predicts the
first draft; further drafts chain the same layer on its own output and the previous draft
(like vLLM with more speculative tokens than MTP layers; deeper MTP layers are not used).
Chained positions lie past the computed ones: where the target rejects their token, the
next catch-up overwrites them; where it accepts it, the chain's entry stays and the
catch-up starts after it (the layer was trained on its own chained outputs, and acceptance
did not drop), so after a verify step it runs on one or two positions, not on k + 1. On a
CPU with compiled decode steps the layer and the head run in graphs of their own
(`serving/model/graphs/mtp.py`).

Drafts are the MTP head's argmax, a sampled request's too, as vLLM's MTP and EAGLE drafters
propose: the verify step's rejection sampler then takes them as proposed deterministically
(q one-hot on the draft: kept with probability p(x)), which keeps the output distributed as
plain decoding's, and no draft pays for a filtered distribution and a draw, on a CPU most of
a sampled draft's cost. The draft model, a sampler of its own, draws from its q instead.

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
from serving.model.graphs.decode import DecodeGraphs
from serving.model.graphs.mtp import DraftRows, MTPDraftStep, MTPGraphs
from serving.model.paged import PagedModel
from serving.model.spans import TokenSpan, graph_rows
from speculative.proposer import BlockAllocator, DraftSequence, TargetStep

# A sequence decoding without drafts keeps its MTP context this many steps (the speculator
# probes again after 8), then gives it up to save the catch-up.
IDLE_STEPS_KEPT = 8


class MTPProposer:
    def __init__(self, paged: PagedModel, blocks: BlockAllocator, vocab: int) -> None:
        """Where the target's steps are compiled on a CPU (`paged.graphs`), so are the
        drafter's (`graphs`, compiled after the target's)."""
        model: CausalLM = paged.model
        if not model.mtp:
            raise ValueError("method 'mtp' needs a checkpoint with MTP weights (tierserve_mtp)")
        self.paged = paged
        self.model = model
        self.step = MTPDraftStep(model)
        target = paged.graphs
        self.graphs = MTPGraphs(self.step, target) if isinstance(target, DecodeGraphs) else None
        self.hidden_size = model.config.hidden_size
        self.blocks = blocks
        self.vocab = vocab
        self.gapped: set[int] = set()  # sequences whose MTP cache missed a step
        self.idle: dict[int, int] = {}  # steps each sequence has decoded without drafts
        # Where the last proposal's chain fed drafts to the MTP layer: (first position, tokens).
        self.chained: dict[int, tuple[int, list[int]]] = {}

    def draft_rows(self, spans: list[TokenSpan], hidden: torch.Tensor) -> DraftRows:
        """The MTP layer over spans of (position, next token), `hidden` the target's (or the
        previous draft's) hidden states of their rows in order: the output and logits at each
        span's last position. In the compiled graphs where the step fits, else eagerly."""
        lengths = [len(s.token_ids) for s in spans]
        graphs = self.graphs
        if graphs is not None and graphs.fits_rows(
            sum(lengths), max(len(s.block_table) for s in spans)
        ):
            out = graphs.draft(hidden, *graph_rows(spans))
            if len(out) > len(spans):  # a catch-up of several positions
                out = out[torch.tensor(lengths).cumsum(0) - 1]
            rows = DraftRows.split(out, self.hidden_size)
        else:
            # Eagerly, single positions first (`PagedModel.prepare`), the head on the last rows.
            order = sorted(range(len(spans)), key=lambda i: lengths[i] != 1)
            ids, positions, meta = self.paged.prepare([spans[i] for i in order])
            parts = hidden.split(lengths)
            out = self.step.hidden(ids, positions, meta, torch.cat([parts[i] for i in order]))
            ends = torch.tensor([lengths[i] for i in order]).cumsum(0) - 1
            last = out[ends[torch.tensor(order).argsort()]]
            rows = DraftRows(last, self.model.compute_logits(last))
        rows.logits = rows.logits[:, : self.vocab]
        return rows

    @torch.inference_mode()
    def propose(self, seqs: list[DraftSequence], ks: list[int], step: TargetStep) -> None:
        spans, hidden, owners = [], [], {}
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
            chained = self.chained.pop(seq.seq_id, None)
            if live:
                skip = self._chained_prefix(seq, start, computed, chained)
                owners[seq.seq_id] = len(spans)
                spans.append(
                    TokenSpan(
                        seq.block_table,
                        start + skip,
                        seq.token_ids[start + skip + 1 : start + computed + 1],
                    )
                )
                hidden.append(step.hidden[offset + skip : offset + computed])
            offset += n
        if not spans:
            return
        # The output at each sequence's last computed position predicts its first draft.
        caught_up = self.draft_rows(spans, torch.cat(hidden))
        drafting = [(s, k) for s, k in zip(seqs, ks, strict=True) if s.seq_id in owners]
        if not drafting:
            return
        pick = torch.tensor([owners[s.seq_id] for s, _ in drafting])
        rows = DraftRows(caught_up.hidden[pick], caught_up.logits[pick])
        for depth in range(max(k for _, k in drafting)):
            if depth:  # chain: position N + depth - 1 needs a block
                keep = [
                    i
                    for i, (s, k) in enumerate(drafting)
                    if k > depth and self.blocks.allocate_slots(s, depth)
                ]
                if not keep:
                    break
                if len(keep) < len(drafting):
                    drafting = [drafting[i] for i in keep]
                    rows.hidden = rows.hidden[keep]
                chained = [
                    TokenSpan(
                        s.block_table, s.num_computed_tokens + depth - 1, [s.draft_token_ids[-1]]
                    )
                    for s, _ in drafting
                ]
                rows = self.draft_rows(chained, rows.hidden)
            tokens = rows.logits.argmax(dim=-1).tolist()
            for (s, _), token in zip(drafting, tokens, strict=True):
                s.draft_token_ids.append(token)
        for s, _ in drafting:
            self.chained[s.seq_id] = (s.num_computed_tokens, s.draft_token_ids[:-1])

    @staticmethod
    def _chained_prefix(
        seq: DraftSequence, start: int, computed: int, chained: tuple[int, list[int]] | None
    ) -> int:
        """How many of the positions just computed the catch-up can skip: those where the
        last proposal's chain already fed the token that was then accepted, so the MTP cache
        holds an entry for it (made from the drafter's own hidden state rather than the
        target's, which can only lower acceptance). The last position always runs: its
        output drafts next."""
        if chained is None or chained[0] != start:
            return 0
        fed = chained[1]
        skip = 0
        while skip < min(len(fed), computed - 1) and seq.token_ids[start + skip + 1] == fed[skip]:
            skip += 1
        return skip

    def ready(self) -> bool:
        """Once a draft step is compiled, where the target's steps are: a cold start compiles
        the drafter's after the target's, and the tier serves by plain decoding meanwhile."""
        return self.graphs is None or bool(self.graphs.ready_sizes)

    def pause(self, step: TargetStep) -> None:
        self.gapped.update(seq.seq_id for seq, _ in step.batch)

    def release(self, seq: DraftSequence) -> None:
        self.gapped.discard(seq.seq_id)
        self.idle.pop(seq.seq_id, None)
        self.chained.pop(seq.seq_id, None)
