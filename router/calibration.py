"""Threshold calibration: pick the score threshold that sends a target share of requests to
the full tier (as RouteLLM calibrates its routers on a sample of prompts). Operators think
in cost (the share of expensive calls), not in raw classifier scores."""

from collections.abc import Sequence

import numpy as np


def threshold_for_share(scores: Sequence[float], full_share: float) -> float:
    """The threshold at which `score >= threshold` holds for `full_share` of `scores`
    (ties may push the share a little above it)."""
    if not 0.0 <= full_share <= 1.0:
        raise ValueError(f"full_share must be in [0, 1], got {full_share}")
    ranked = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    if len(ranked) == 0:
        raise ValueError("calibration needs at least one score")
    k = round(full_share * len(ranked))
    if k == 0:
        return float(np.nextafter(ranked[0], np.inf))  # nothing reaches it
    return float(ranked[k - 1])
