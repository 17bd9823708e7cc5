"""Load-aware spill: when the chosen tier's queue passes a bound and the other tier's has
room, send the request there, if its score allows. Spilling up (to full) never costs
quality, so it is always allowed; spilling down (to highspeed) only for requests scored
within `margin` of the threshold, which the highspeed tier is likely to answer well."""

from collections.abc import Mapping
from dataclasses import dataclass

from router.policy import Decision, Tier, other_tier


@dataclass(frozen=True)
class SpillPolicy:
    max_queue: int  # requests in flight at one tier before it spills
    margin: float  # how far above the threshold a score may be and still spill down

    def apply(self, decision: Decision, threshold: float, queues: Mapping[Tier, int]) -> Decision:
        target = other_tier(decision.tier)
        if queues[decision.tier] < self.max_queue or queues[target] >= self.max_queue:
            return decision
        if target == "highspeed" and (
            decision.score is None or decision.score >= threshold + self.margin
        ):
            return decision
        return decision.moved(target, "spill")
