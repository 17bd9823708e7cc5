"""Verification of draft tokens against the target model: what speculation keeps.

The target scores the last sampled token and the k drafts in one forward pass, which gives
its distribution at k + 1 positions. Greedy requests keep drafts while they equal the
target's argmax, then take the argmax where they stopped: exactly the tokens of plain
greedy decoding. Sampled requests use the rejection sampling of Leviathan et al. (2023)
and Chen et al. (2023): draft x drawn from q is kept with probability min(1, p(x) / q(x));
at the first rejection a token is drawn from norm(max(0, p - q)); if all k are kept, one
bonus token is drawn from p at the last position. Every emitted token is then distributed
exactly as the target's own sampler would draw it. p and q are the distributions after
temperature, min_p, top_k and top_p, applied alike to both (`processed_probs`). A drafter
without a distribution (n-gram lookup, greedy drafting) proposes deterministically: q is
one-hot on its draft, so a draft is kept with probability p(x) and a rejection draws from
p without x.
"""

import torch

from serving.sampling.filters import filter_logits
from serving.sampling.params import SamplingParams
from serving.sampling.sampler import inverse_transform


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] logits -> the distributions the sampler draws from, one per row."""
    scaled = logits.float() / params.temperature
    return filter_logits(scaled, [params] * scaled.shape[0]).softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [n, V] probabilities, from the request's generator if seeded,
    as the sampler draws (`inverse_transform`)."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    return inverse_transform(probs, u)


def verify_drafts(
    logits: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens to append: the accepted drafts, then the recovered or bonus token.

    `logits` [k + 1, V] are the target's at the last sampled token and each draft;
    `draft_probs` [k, V] the drafter's processed distributions (None: deterministic drafts).
    """
    k = len(draft_ids)
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and target[n] == draft_ids[n]:
            n += 1
        return [*draft_ids[:n], target[n]]
    p = processed_probs(logits, params)
    device = logits.device
    drafts = torch.tensor(draft_ids, device=device)
    rows = torch.arange(k, device=device)
    p_draft = p[rows, drafts]
    q_draft = draft_probs[rows, drafts] if draft_probs is not None else torch.ones(k, device=device)
    u = torch.rand(k, generator=generator, device=device)
    rejected = (u * q_draft >= p_draft).nonzero()  # keep x when u < p(x) / q(x)
    if len(rejected) == 0:
        return [*draft_ids, int(draw(p[k : k + 1], generator))]
    n = int(rejected[0])
    if draft_probs is not None:
        residual = (p[n] - draft_probs[n]).clamp_min_(0.0)
    else:
        residual = p[n].clone()
        residual[draft_ids[n]] = 0.0
    if residual.sum() <= 0:  # p == q up to rounding: then x was kept with probability 1
        residual = p[n]
    return [*draft_ids[:n], int(draw(residual[None], generator))]
