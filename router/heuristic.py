"""The heuristic policy: a hand-weighted sum of complexity features through a sigmoid.

The default policy until a learned router is trained. The weights encode what the task
domains teach: long arithmetic, code, multi-step instructions and deep conversations are
where a short-answer model fails first.
"""

from dataclasses import dataclass, field

from router.features import RouteRequest, features
from router.policy import sigmoid

WEIGHTS = {
    "log_tokens": 0.8,
    "log_digits": 0.9,
    "operations": 1.2,
    "code": 1.0,
    "tools": 0.4,
    "json_output": 0.2,
    "multi_step": 0.8,
    "depth": 0.9,
    "domain_math": 0.3,
    "domain_code": 0.5,
    "domain_terminal": 0.8,
    "domain_tools": 0.0,
    "domain_chat": -0.5,
}
BIAS = -4.0


@dataclass
class HeuristicPolicy:
    threshold: float = 0.5
    weights: dict[str, float] = field(default_factory=lambda: dict(WEIGHTS))
    bias: float = BIAS
    name: str = "heuristic"

    def score(self, request: RouteRequest) -> float:
        values = features(request)
        return sigmoid(self.bias + sum(self.weights[k] * v for k, v in values.items()))


@dataclass
class LengthPolicy:
    """The length-only baseline of `tierserve eval router`: longer prompts are harder."""

    threshold: float = 0.5
    name: str = "length"

    def score(self, request: RouteRequest) -> float:
        return features(request)["log_tokens"]
