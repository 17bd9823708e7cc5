"""What a request's settings do to a model's logits before a token is drawn, in vLLM's order:
penalties, the min_tokens mask, then temperature, min_p, top_k and top_p.

The engine's sampler and speculative verification (`rejection.py`) both shape the target's
distribution with them, so a kept draft is distributed as the sampler would have drawn it.
"""

import math

import torch

from serving.sampling.params import SamplingParams, SamplingRow


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Applies repetition, frequency and presence penalties in place, batched over the rows
    that use any.

    Repetition (HF/vLLM): logits of tokens seen in prompt or output are divided by the
    penalty if positive, multiplied if not. Frequency and presence (OpenAI): subtract
    `frequency * count + presence * (count > 0)` over the output tokens only.
    """
    idx = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not idx:
        return
    picked = [rows[i] for i in idx]
    counts = _count_rows([row.output_token_ids for row in picked], logits)
    in_output = counts > 0
    seen = (_count_rows([row.prompt_token_ids for row in picked], logits) > 0) | in_output
    repetition = per_row([row.params.repetition_penalty for row in picked], logits)
    frequency = per_row([row.params.frequency_penalty for row in picked], logits)
    presence = per_row([row.params.presence_penalty for row in picked], logits)
    x = logits[idx]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    logits[idx] = x - frequency * counts - presence * in_output


def _count_rows(seqs: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """Per-row token counts [len(seqs), V]; pads with V into a spare column that is dropped."""
    vocab = logits.shape[1]
    width = max(1, *map(len, seqs))
    ids = torch.tensor([s + [vocab] * (width - len(s)) for s in seqs], device=logits.device)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=logits.dtype, device=logits.device)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))[:, :vocab]


def mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos: list[int]) -> None:
    """Masks EOS and stop_token_ids, in place, in rows that have not produced min_tokens yet
    (as vLLM, also where ignore_eos is set: that is the engine's not stopping on EOS)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) < row.params.min_tokens:
            banned = [*eos, *row.params.stop_token_ids]
            row_idx += [i] * len(banned)
            col_idx += banned
    if row_idx:
        logits[row_idx, col_idx] = -math.inf


def per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A [n, 1] column of per-row values, to broadcast over [n, V] logits."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Applies min_p, top_k and top_p to temperature-scaled logits (min_p in place)."""
    if any(p.min_p > 0 for p in params):  # p_i < min_p * p_max, in log space; log(0) = -inf
        min_p = per_row([p.min_p for p in params], logits)
        threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()
        logits.masked_fill_(logits < threshold, -math.inf)
    use_k = any(p.top_k > 0 for p in params)
    use_p = any(p.top_p < 1 for p in params)
    if use_k or use_p:
        logits = _top_k_top_p(logits, params, use_k, use_p)
    return logits


def _top_k_top_p(
    logits: torch.Tensor, params: list[SamplingParams], use_k: bool, use_p: bool
) -> torch.Tensor:
    """Masks to -inf what top_k (exactly k ranks) and then top_p remove; one sort for both.
    When every row has a top_k, only the max(top_k) best columns are sorted (a top-k): on a
    CPU a sort of the whole vocabulary costs far more, and speculative decoding filters once
    a verify step.

    top_p drops a token when the probability of the tokens ranked above it already
    reaches top_p (vLLM's rule), always keeping the best one.
    """
    vocab = logits.shape[1]
    cut = use_k and all(p.top_k > 0 for p in params)
    if cut:
        sorted_logits, order = logits.topk(min(max(p.top_k for p in params), vocab), dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=order.device)
        ranks = torch.arange(sorted_logits.shape[1], device=order.device)
        sorted_logits.masked_fill_(ranks >= k.unsqueeze(1), -math.inf)
    if use_p:
        # inf for disabled rows, so float error in the cumsum never trims their tail
        top_p = [p.top_p if p.top_p < 1 else math.inf for p in params]
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop = mass_above >= torch.tensor(top_p, device=probs.device).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, -math.inf)
    out = torch.full_like(logits, -math.inf) if cut else torch.empty_like(logits)
    return out.scatter_(1, order, sorted_logits)
