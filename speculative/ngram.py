"""Prompt lookup decoding (Saxena, 2023; vLLM's `ngram`): no model at all.

The last n tokens of a sequence are looked up in its earlier tokens, prompt and output;
at the latest earlier match, the tokens that followed it become the drafts. Outputs that
copy from their context (code edits, quoting, step-by-step arithmetic that restates its
operands) get long drafts for free; elsewhere it proposes nothing and costs a lookup.
"""

import torch

from serving.model.spans import long_tensor
from speculative.proposer import DraftSequence, TargetStep


def ngram_lookup(tokens: torch.Tensor, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (n from max_n down to min_n) of `tokens` [L]; [] if none occurs."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # every n-gram that has a successor
        hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[DraftSequence], ks: list[int], step: TargetStep) -> None:
        for seq, k in zip(seqs, ks, strict=True):
            # On the host whatever the engine's device: the ids are a host list, and the
            # lookup costs less than copying them to a GPU.
            tokens = long_tensor(torch.device("cpu"), seq.token_ids)
            seq.draft_token_ids = ngram_lookup(tokens, k, self.min_n, self.max_n)
            seq.draft_probs = None

    def ready(self) -> bool:
        return True

    def pause(self, step: TargetStep) -> None:
        pass

    def release(self, seq: DraftSequence) -> None:
        pass
