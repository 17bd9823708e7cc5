"""The log-probabilities reported for tokens: of the raw model distribution (vLLM V1's
default), the token's own and the row's top k, best first. One packing for sampled tokens,
verified drafts and prompt tokens."""

import torch

from serving.sampling.params import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], k: int | list[int]
) -> list[TokenLogprob]:
    """`tokens[i]`'s logprob at row i of [n, V] raw logits, with the top `k` of each row (a
    list: each row's own k; 0: no top list)."""
    ks = [k] * len(tokens) if isinstance(k, int) else k
    logprobs = logits.float().log_softmax(dim=-1)
    rows = torch.arange(len(tokens), device=logits.device)
    chosen = logprobs[rows, torch.tensor(tokens, device=logits.device)].tolist()
    most = min(max(ks, default=0), logprobs.shape[1])
    ids: list[list[int]] = []
    values: list[list[float]] = []
    if most:
        top = logprobs.topk(most, dim=-1)  # sorted, best first
        ids, values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(token, lp, list(zip(ids[i][:n], values[i][:n], strict=True)) if n else None)
        for i, (token, lp, n) in enumerate(zip(tokens, chosen, ks, strict=True))
    ]
