"""The routing interface: a request in, (tier, score, reason) out.

Every policy scores a request with its estimate of how likely the highspeed tier is to fail
it (higher = harder) and sends it to the full tier when the score reaches the policy's
threshold. Overrides, spill and cascade adjust that decision; each says why in `reason`, a
short code that is also a metric label.
"""

import math
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from router.features import RouteRequest

Tier = Literal["full", "highspeed"]
TIERS: tuple[Tier, Tier] = ("full", "highspeed")


def other_tier(tier: Tier) -> Tier:
    return "highspeed" if tier == "full" else "full"


@dataclass(frozen=True)
class Decision:
    tier: Tier
    policy: str  # the policy that decided: learned, heuristic, override, ...
    reason: str  # a short code: score_above_threshold, header, spill, fallback, ...
    score: float | None = None  # the router's score, when a scoring policy ran

    def moved(self, tier: Tier, reason: str) -> "Decision":
        """The same decision sent to another tier, for another reason (spill, fallback)."""
        return replace(self, tier=tier, reason=reason)


class ScoringPolicy(Protocol):
    name: str
    threshold: float

    def score(self, request: RouteRequest) -> float:
        """Higher means harder: the estimated probability that the highspeed tier fails."""
        ...


def decide(policy: ScoringPolicy, request: RouteRequest) -> Decision:
    score = policy.score(request)
    if score >= policy.threshold:
        return Decision("full", policy.name, "score_above_threshold", score)
    return Decision("highspeed", policy.name, "score_below_threshold", score)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, x))))
