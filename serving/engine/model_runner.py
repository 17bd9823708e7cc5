"""Runs one scheduled step: the sequences' spans through the paged model, then a token
for each sequence that reaches its end (sampled, or drafts verified), and prompt logprobs.
"""

from dataclasses import dataclass

import torch

from serving.engine.sequence import Sequence
from serving.model.hybrid.paged import PagedHybridModel
from serving.model.paged import PagedModel
from serving.model.spans import TokenSpan, long_tensor
from serving.sampling.logprobs import token_logprobs
from serving.sampling.params import SamplingRow, TokenLogprob
from serving.sampling.rejection import verify_drafts
from serving.sampling.sampler import Sampler


@dataclass
class SampledTokens:
    """What a sequence got this step: one token, or accepted drafts and one more."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # empty unless the request asked for them
    num_draft_tokens: int = 0  # drafts verified this step (0: a plain decode or prefill)


@dataclass
class StepOutput:
    sampled: list[SampledTokens]
    hidden: torch.Tensor  # [tokens, hidden] final hidden states, in `batch` order
    batch: list[tuple[Sequence, int]]  # (sequence, tokens fed), decodes first
    starts: list[int]  # position of each sequence's first token fed


class ModelRunner:
    """What an engine does with a step once its paged model (`PagedModel`, or
    `PagedHybridModel` for the hybrid family) computed the hidden states, compiled or eager:
    sampling, draft verification and prompt logprobs for each sequence that reaches its end."""

    def __init__(self, paged: PagedModel | PagedHybridModel, eos_token_ids: list[int]) -> None:
        self.paged = paged
        self.model = paged.model
        self.sampler = Sampler(self.model.config.vocab_size, eos_token_ids)

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> StepOutput:
        """One forward over the batch; samples (or verifies drafts) for each sequence that
        reaches its end. A sequence with drafts feeds its last token and the drafts."""
        batch = sorted(batch, key=lambda item: item[1] != 1)  # stable: decodes first
        spans = [_span(seq, n) for seq, n in batch]
        hidden = self.paged.forward(spans)
        rows, last, verify = [], [], []
        offset = 0
        for seq, n in batch:
            if (
                seq.params.prompt_logprobs is not None
                and seq.num_computed_tokens < seq.num_prompt_tokens
            ):
                self._prompt_logprobs(seq, hidden[offset : offset + n], n)
            if seq.num_computed_tokens + n == len(seq) + len(seq.draft_token_ids):
                if seq.draft_token_ids:
                    verify.append((seq, hidden[offset : offset + n]))
                else:
                    rows.append(seq)
                    last.append(offset + n - 1)
            offset += n
        sampled = self._sample(rows, _rows(hidden, last)) if rows else []
        sampled += [self._verify(seq, h) for seq, h in verify]
        return StepOutput(sampled, hidden, batch, [s.start for s in spans])

    def _sample(self, rows: list[Sequence], hidden: torch.Tensor) -> list[SampledTokens]:
        logits = self.model.compute_logits(hidden)
        result = self.sampler(
            logits,
            [
                SamplingRow(
                    s.params, s.prompt_token_ids, s.output_token_ids, s.generator, s.constraint
                )
                for s in rows
            ],
        )
        return [
            SampledTokens(seq, [token], [lp] if lp is not None else [])
            for seq, token, lp in zip(rows, result.token_ids, result.logprobs, strict=True)
        ]

    def _verify(self, seq: Sequence, hidden: torch.Tensor) -> SampledTokens:
        """The target's logits at the last token and every draft decide what is kept."""
        logits = self.model.compute_logits(hidden)[:, : self.sampler.vocab_size]
        drafts = seq.draft_token_ids
        tokens = verify_drafts(logits, drafts, seq.draft_probs, seq.params, seq.generator)
        lps = []
        if seq.params.logprobs is not None:
            lps = token_logprobs(logits[: len(tokens)], tokens, seq.params.logprobs)
        return SampledTokens(seq, tokens, lps, num_draft_tokens=len(drafts))

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, n: int) -> None:
        """Logprob of each prompt token given the ones before it (first token: None).

        Position p predicts token p + 1; tokens already scored (before a preemption) are skipped.
        """
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        start = seq.num_computed_tokens
        lo = max(start + 1, len(seq.prompt_logprobs))
        hi = min(start + n + 1, seq.num_prompt_tokens)
        if hi <= lo:
            return
        logits = self.model.compute_logits(hidden[lo - 1 - start : hi - 1 - start])
        targets = seq.token_ids[lo:hi]
        seq.prompt_logprobs += token_logprobs(logits, targets, seq.params.prompt_logprobs or 0)


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]: a view where the rows are consecutive, as a step of decodes only has
    them, else a gather."""
    if rows[-1] - rows[0] == len(rows) - 1:
        return hidden[rows[0] : rows[-1] + 1]
    return hidden[long_tensor(hidden.device, rows)]


def _span(seq: Sequence, n: int) -> TokenSpan:
    """The next n tokens a sequence feeds: the rest of its tokens, then its drafts."""
    p = seq.num_computed_tokens
    tokens = seq.token_ids[p : p + n]
    drafts = seq.draft_token_ids[: n - len(tokens)]
    return TokenSpan(seq.block_table, p, tokens + drafts, seq.state_slot, len(drafts))
