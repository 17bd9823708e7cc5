"""The gateway's router: overrides first, then the scoring policy, then load-aware spill."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from router.features import route_request
from router.heuristic import HeuristicPolicy
from router.learned import LearnedPolicy
from router.override import override
from router.policy import Decision, ScoringPolicy, Tier, decide
from router.spill import SpillPolicy

log = logging.getLogger(__name__)
PolicyName = Literal["auto", "learned", "heuristic"]


def load_policy(
    name: PolicyName, learned_path: Path, heuristic_threshold: float, threshold: float | None
) -> ScoringPolicy:
    """`auto` is the learned router when its file exists, else the heuristic (logged, and
    reported by the gateway's /health). `threshold` overrides the calibrated one."""
    policy: ScoringPolicy
    if name == "learned" or (name == "auto" and learned_path.exists()):
        policy = LearnedPolicy.load(learned_path)
    else:
        if name == "auto":
            log.warning("no learned router at %s: routing with the heuristic", learned_path)
        policy = HeuristicPolicy(threshold=heuristic_threshold)
    if threshold is not None:
        policy.threshold = threshold
    return policy


@dataclass
class Router:
    policy: ScoringPolicy
    spill: SpillPolicy | None
    model_tiers: Mapping[str, Tier]  # model names clients may ask for, to their tier

    def route(
        self, body: Mapping[str, Any], header: str | None, queues: Mapping[Tier, int]
    ) -> Decision:
        forced = override(header, body.get("model"), body.get("reasoning_effort"), self.model_tiers)
        if forced is not None:
            return forced
        decision = decide(self.policy, route_request(dict(body)))
        if self.spill is not None:
            decision = self.spill.apply(decision, self.policy.threshold, queues)
        return decision
