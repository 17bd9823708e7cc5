"""Per-request sampling settings (validated at the API edge), the filters they put on a
model's logits, and the log-probabilities reported for chosen tokens.

They sit with the model, below the engine and the drafters, because both shape the model's
distribution the same way: the engine's sampler and speculative verification share them.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    """What vLLM's SamplingParams holds, minus what nobody asked for.

    `top_k <= 0` and `top_p == 1` disable those filters; `temperature == 0` means greedy.
    `logprobs=None` returns no logprobs, `0` only the chosen token's, `k` also the top k.
    `json_object` constrains the output to a JSON object (`response_format` json_object);
    `tool_names` to exactly one tool call to one of those functions (`tool_choice`
    "required" or a named function), in the chat template's `<tool_call>` form; with
    `tool_call_optional` (`tool_choice` "auto") to text in which each call that starts
    is such a call; `tool_parameters` (name -> parameter schema) holds a call's arguments to
    its function's declared keys.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    json_object: bool = False
    tool_names: list[str] | None = None
    tool_call_optional: bool = False
    tool_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), best first


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

    top_p drops a token when the probability of the tokens ranked above it already
    reaches top_p (vLLM's rule), always keeping the best one.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=order.device)
        ranks = torch.arange(vocab, device=order.device)
        sorted_logits.masked_fill_(ranks >= k.unsqueeze(1), -math.inf)
    if use_p:
        # inf for disabled rows, so float error in the cumsum never trims their tail
        top_p = [p.top_p if p.top_p < 1 else math.inf for p in params]
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        drop = mass_above >= torch.tensor(top_p, device=probs.device).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits.masked_fill_(drop, -math.inf)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
