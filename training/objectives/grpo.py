"""RL on verifier rewards: GRPO's group-relative advantages with DAPO's refinements.

For each prompt a group of G answers is sampled; an answer's advantage is its reward minus
the group's mean, over the group's standard deviation (GRPO, Shao et al., 2024), the same
for every token of the answer. DAPO (Yu et al., 2025) adds, and this module implements:

- clip-higher: the importance ratio is clipped to [1 - eps_low, 1 + eps_high] with
  eps_high > eps_low, so unlikely tokens with positive advantage can still grow;
- a token-level loss: summed over tokens and divided by the batch's token count (the
  trainer's normalisation), so long answers weigh by their tokens, not as one sample;
- dynamic sampling: groups whose verdicts are all equal carry no signal and are dropped,
  whatever their overlong penalties;
- an overlong penalty that grows linearly over the last `cache` tokens of the budget.

Where a domain can point at the first false step of an answer's working (math: the first
line whose identity does not hold), the advantage is placed by it (`located_advantages`).

An optional KL term to the reference uses the k3 estimator (Schulman), as GRPO does.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[groups, G] rewards -> [groups, G] advantages (reward - mean) / (std + eps)."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def informative(rewards: Sequence[float]) -> bool:
    """Dynamic sampling: a group whose answers all scored the same teaches nothing."""
    return max(rewards) - min(rewards) > 1e-9


def overlong_penalty(length: int, budget: int, cache: int) -> float:
    """0 up to `budget - cache` tokens, then falling linearly to -1 at `budget` (and -1 past)."""
    free = budget - cache
    if length <= free:
        return 0.0
    return max(-1.0, (free - length) / cache)


def policy_loss_sum(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate summed over the masked tokens, and the share of tokens clipped.

    logprobs / old_logprobs / mask / advantages [B, L]."""
    ratio = (logprobs - old_logprobs).exp()
    adv = advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    m = mask.float()
    was_clipped = ((ratio * adv) != surrogate).float()
    return -(surrogate * m).sum(), (was_clipped * m).sum() / m.sum().clamp(min=1)


def located_advantages(
    advantage: float, n: int, error: tuple[int, int] | None, penalty: float
) -> list[float]:
    """Each of an answer's `n` tokens' advantage, given the token span of the first false
    step its domain found (None: none found, every token gets `advantage`). The working
    before that step is checked right, so it is never pushed down (an answer's outcome
    standardised against its group's would otherwise blame every line of a long correct
    chain for one slip); nothing from the step on is pushed up; and the step itself costs
    `penalty` more. So a group whose answers all failed, which carries no outcome signal
    (advantage 0), still teaches where each went wrong."""
    if error is None:
        return [advantage] * n
    start, end = error
    before, after = max(advantage, 0.0), min(advantage, 0.0)
    return [before] * start + [after - penalty] * (end - start) + [after] * (n - end)


def ratio_stats(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The importance ratio pi / pi_old over the masked tokens: its mean, spread and largest
    departure from 1. A step's micro-batches all see the policy that sampled them (the
    optimizer steps once, after the last), so the ratio is 1 up to the numerics of the
    rollout engine against the trainer: a departure past ~1e-3 means the two disagree about
    the policy, and the clipped objective then trains on noise."""
    ratio = (logprobs - old_logprobs).exp()[mask]
    if ratio.numel() == 0:
        return {"ratio_mean": 1.0, "ratio_std": 0.0, "ratio_max_dev": 0.0}
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_std": float(ratio.std(unbiased=False)),
        "ratio_max_dev": float((ratio - 1).abs().max()),
    }


def kl_k3_sum(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Summed k3 estimate of KL(policy || reference) over the masked tokens: unbiased,
    always >= 0, and low-variance (exp(d) - d - 1 with d = ref - policy)."""
    d = reference_logprobs - logprobs
    return ((d.exp() - d - 1) * mask.float()).sum()


@dataclass
class DomainWeights:
    """Sampling weights over domains that follow learning progress. Each domain's success is
    tracked by a fast and a slow moving average; a domain weighs by its progress (how far
    the two differ: it is improving or forgetting) plus its learnability p(1 - p) at the
    fast average p, which is highest where GRPO groups mix passes and fails (a solved or a
    hopeless domain gives no informative group, whatever the noise in its rate). A domain
    not yet measured weighs as the best one, so each is tried; a floor keeps any from
    starving. `fixed=True` keeps the initial mix: the baseline to compare against."""

    mix: dict[str, float]
    fixed: bool = False
    floor: float = 0.1
    fast_rate: float = 0.3
    slow_rate: float = 0.05
    fast: dict[str, float] = field(default_factory=dict)
    slow: dict[str, float] = field(default_factory=dict)

    def update(self, domain: str, success_rate: float) -> None:
        if domain not in self.fast:
            self.fast[domain] = self.slow[domain] = success_rate
            return
        self.fast[domain] += self.fast_rate * (success_rate - self.fast[domain])
        self.slow[domain] += self.slow_rate * (success_rate - self.slow[domain])

    def weights(self) -> dict[str, float]:
        if self.fixed or not self.fast:
            total = sum(self.mix.values())
            return {d: w / total for d, w in self.mix.items()}
        score = {
            d: abs(self.fast[d] - self.slow[d]) + self.fast[d] * (1 - self.fast[d])
            for d in self.mix
            if d in self.fast
        }
        top = max(score.values()) or 1.0
        raw = {d: self.floor + (1 - self.floor) * score.get(d, top) / top for d in self.mix}
        total = sum(raw.values())
        return {d: w / total for d, w in raw.items()}
