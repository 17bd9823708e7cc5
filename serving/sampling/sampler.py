"""Turns a batch of logits into next tokens, with vLLM's sampling semantics."""

import math
from dataclasses import dataclass

import torch

from serving.sampling.filters import apply_penalties, filter_logits, mask_min_tokens, per_row
from serving.sampling.logprobs import token_logprobs
from serving.sampling.params import SamplingParams, SamplingRow, TokenLogprob

# Greedy rows in a mixed batch go through the sampling ops with filters off; their
# sampled token is then replaced by the argmax.
_NEUTRAL = SamplingParams()
# Tokens a constrained row tries, best first, before it masks the whole vocabulary.
_REJECTION_TRIES = 8


@dataclass
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


class Sampler:
    """Samples one token per row of a [B, V] logits batch.

    Order, as in vLLM: penalties, min_tokens, then greedy rows take the argmax and the
    others go through temperature, min_p, top_k, top_p (on the top-k renormalised
    distribution) and a draw. min_p comes before top_k/top_p as in vLLM V1; since it
    thresholds a ratio to the top probability, only its interplay with top_p depends on it.
    `ignore_eos` is the engine's business (it just doesn't stop on EOS): like vLLM,
    min_tokens still masks EOS. Logprobs are those of the raw model distribution, vLLM V1's
    default. Columns past `vocab_size` (padded embeddings) are never sampled.

    The draw is one batched inverse transform sampling (see `_draw`). A seeded row draws from
    its own generator (on the logits' device), so its tokens do not depend on what else is in
    the batch. When every sampled row has a top_k, sampling runs on the top max(top_k) columns
    only: a CPU full-vocabulary sort costs far more than a top-k.

    A row with a constraint draws from its distribution restricted to the tokens the
    constraint allows, as if they had been masked before sampling (vLLM's structured
    outputs): see `_constrained_draw`. Rows without one cost an attribute check.
    """

    def __init__(self, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        n = len(rows)
        constrained = [i for i, row in enumerate(rows) if row.constraint is not None]
        if all(_plain_greedy(row) for row in rows):  # the hot path: one argmax, one sync
            token_ids = logits.argmax(dim=-1).tolist()
            rejected = [i for i in constrained if not rows[i].constraint.allows(token_ids[i])]
            if rejected:
                raw = logits[rejected].float()
                _apply_constraints(token_ids, raw, raw, rows, rejected)
            return SampleResult(token_ids, [None] * n)
        raw = logits.float()
        processed = raw.clone()
        apply_penalties(processed, rows)
        mask_min_tokens(processed, rows, self.eos_token_ids)
        if not constrained:
            return _result(raw, _sample(processed, rows), rows)
        kept = processed[constrained]  # a copy: _sample works in place
        token_ids = _sample(processed, rows).tolist()
        _apply_constraints(token_ids, kept, raw[constrained], rows, constrained)
        return _result(raw, torch.tensor(token_ids, device=raw.device), rows)


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.uses_penalties
        and len(row.output_token_ids) >= p.min_tokens
    )


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Token ids [B] from processed logits (modified in place)."""
    greedy = [row.params.greedy for row in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    greedy_ids = logits.argmax(dim=-1) if any(greedy) else None
    vocab = logits.shape[1]
    params = [_NEUTRAL if g else row.params for g, row in zip(greedy, rows, strict=True)]
    logits.div_(per_row([p.temperature for p in params], logits))
    candidates = None
    top_ks = [row.params.top_k for row, g in zip(rows, greedy, strict=True) if not g]
    if min(top_ks) > 0:  # no sampled row looks past the max(top_k) best: drop the other columns
        logits, candidates = logits.topk(min(max(top_ks), vocab), dim=-1)
    logits = filter_logits(logits, params)
    sampled = _draw(logits, rows, greedy, candidates)
    if greedy_ids is None:
        return sampled
    return torch.where(torch.tensor(greedy, device=logits.device), greedy_ids, sampled)


def _apply_constraints(
    token_ids: list[int],
    processed: torch.Tensor,
    raw: torch.Tensor,
    rows: list[SamplingRow],
    constrained: list[int],
) -> None:
    """Replaces, in place, the drawn tokens of constrained rows their constraint rejects.

    `raw` and `processed` hold the constrained rows' logits before and after penalties and
    min_tokens (before temperature), in the order of `constrained`.
    """
    for j, i in enumerate(constrained):
        row = rows[i]
        if not (_rejection_exact(row.params) and row.constraint.allows(token_ids[i])):
            token_ids[i] = _constrained_draw(processed[j], raw[j], row)


def _rejection_exact(params: SamplingParams) -> bool:
    """Whether rejecting disallowed draws samples exactly what masking them first would:
    true for greedy rows and plain temperature sampling. top_k, top_p and min_p would pick
    their tokens from the whole distribution where vLLM filters the masked one, so rows that
    use them are masked at once.
    """
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1 and params.min_p <= 0)


def _constrained_draw(processed: torch.Tensor, raw: torch.Tensor, row: SamplingRow) -> int:
    """A token drawn from the row's distribution restricted to what its constraint allows.

    Where rejection is exact, the row draws again by an exponential race (fresh noise; a
    seeded row draws it from its generator) and its best-scoring allowed token wins: the
    argmax over a subset of a race is a draw from the distribution restricted to that subset,
    so a rejected first draw followed by this is exact rejection sampling. The _REJECTION_TRIES
    best scores are checked one by one (greedy: the next best logits); a model that writes
    JSON rarely needs more. Only then, or for rows with filters, does one walk of the
    vocabulary find every allowed token. If min_tokens masked all of them (EOS, once the
    object has closed) the constraint wins: they are drawn from the raw logits.
    """
    constraint = row.constraint
    exact = _rejection_exact(row.params)
    if exact:
        scores = _race_scores(processed, row)
        for token in scores.topk(_REJECTION_TRIES).indices.tolist():
            if constraint.allows(token):
                return token
    allowed = constraint.allowed_mask(processed.shape[0]).to(processed.device)
    masked = processed.masked_fill(~allowed, -math.inf)
    if not masked.isfinite().any():
        masked, exact = raw.masked_fill(~allowed, -math.inf), False
    if exact:
        return int(scores.masked_fill(~allowed, -math.inf).argmax())
    return int(_sample(masked.unsqueeze(0), [row])[0])


def _race_scores(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row's scores in an exponential race, logits / T - log q, q ~ Exp(1) (as -log u:
    uniform_ is faster than exponential_ on a CPU): their argmax is a draw from the
    softmax, and over any subset of tokens a draw from the softmax restricted to it. Greedy
    rows race on the logits alone."""
    if row.params.greedy:
        return logits
    u = torch.empty_like(logits).uniform_(generator=row.generator)
    return logits / row.params.temperature - u.log_().neg_().log_()


def _draw(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    greedy: list[bool],
    candidates: torch.Tensor | None,
) -> torch.Tensor:
    """One batched draw by inverse transform sampling: row r takes the first token whose
    cumulative weight exp(logit - max) reaches (1 - u_r) of the row's total, u_r ~ U[0, 1), so
    filtered tokens (weight 0) are never drawn and no softmax is needed.

    One uniform a row: a seeded row draws its own from its generator, so its tokens depend on
    its seed and logits alone, not on the batch. Columns cut to the batch's top-k are sorted
    back into token-id order first, so a row draws the same token over all the columns or the
    cut (the cut only drops zero weights, which leave the sums as they are). An exponential
    race, what `_race_scores` runs for constrained rows, draws a vocabulary of noise a row: for
    rollouts' seeded rows a visible share of a CPU decode step (`loadtests/bench_rollouts.py`).
    """
    if candidates is not None:
        order = candidates.argsort(dim=-1)
        candidates, logits = candidates.gather(1, order), logits.gather(1, order)
    u = torch.empty(len(rows), 1, device=logits.device)
    seeded = [row.generator is not None and not greedy[i] for i, row in enumerate(rows)]
    if not all(seeded):
        u.uniform_()
    for i, row in enumerate(rows):
        if seeded[i]:
            u[i].uniform_(generator=row.generator)
    sampled = inverse_transform(logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_(), u)
    if candidates is None:
        return sampled
    return candidates.gather(1, sampled.unsqueeze(1)).squeeze(1)


def inverse_transform(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [n]: row r of non-negative `weights` [n, V] draws the first token whose
    cumulative weight reaches (1 - u_r) of the row's total, for u [n, 1] ~ U[0, 1). One
    uniform and one pass over the row: `torch.multinomial` and an exponential race draw
    far slower on a CPU (noise for the whole vocabulary)."""
    cumulative = weights.cumsum(dim=-1)
    target = (1 - u) * cumulative[:, -1:]  # in (0, total]: never past the last token
    return torch.searchsorted(cumulative, target).squeeze(1)


def _result(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
    """Packs token ids with the requested logprobs of the raw distribution."""
    tokens = token_ids.tolist()
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if wanted:
        ks = [rows[i].params.logprobs or 0 for i in wanted]
        packed = token_logprobs(raw[wanted], [tokens[i] for i in wanted], ks)
        for i, lp in zip(wanted, packed, strict=True):
            logprobs[i] = lp
    return SampleResult(tokens, logprobs)
