"""Quality against cost, as RouteLLM measures routers.

Sending the top `share` of prompts by score to the full tier and the rest to highspeed gives
a quality (pass rate). PGR, the performance gap recovered, puts it on the scale from
all-highspeed (0) to all-full (1). APGR is the area under PGR over shares in [0, 1]; CPT(x)
is the smallest share of full-tier calls that recovers x of the gap. Random routing recovers
the gap linearly in expectation (APGR 0.5, CPT(x) = x).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.outcomes import Outcome, OutcomeError

REPORT_SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class RouterCurve:
    name: str
    shares: np.ndarray  # k / n for k = 0..n full-tier calls
    pgr: np.ndarray  # the gap recovered at each share

    @property
    def apgr(self) -> float:
        return float(np.trapezoid(self.pgr, self.shares))

    def cpt(self, recovered: float) -> float:
        """The smallest share of full-tier calls that recovers `recovered` of the gap."""
        return float(self.shares[np.argmax(self.pgr >= recovered - 1e-12)])

    def pgr_at(self, share: float) -> float:
        return float(np.interp(share, self.shares, self.pgr))


def gap(outcomes: Sequence[Outcome]) -> tuple[float, float]:
    """The pass rates of all-highspeed and all-full routing."""
    highspeed = float(np.mean([o.highspeed_passed for o in outcomes]))
    return highspeed, float(np.mean([o.full_passed for o in outcomes]))


def curve(name: str, scores: Sequence[float], outcomes: Sequence[Outcome]) -> RouterCurve:
    """The PGR curve of routing by `scores` (higher goes to full first). Equal scores are
    indistinguishable to the router, so a tie group counts at its expected (mean) gain."""
    n = len(outcomes)
    low, high = gap(outcomes)
    if high <= low:
        raise OutcomeError(
            f"the full tier does not beat highspeed on these prompts ({high:.3f} vs {low:.3f}); "
            "PGR is undefined"
        )
    score = np.asarray(scores, dtype=np.float64)
    gain = np.array([float(o.full_passed) - float(o.highspeed_passed) for o in outcomes])
    order = np.argsort(-score, kind="stable")
    score, gain = score[order], gain[order]
    _, starts, counts = np.unique(-score, return_index=True, return_counts=True)
    for start, count in zip(starts, counts, strict=True):
        gain[start : start + count] = gain[start : start + count].mean()
    quality = low + np.concatenate([[0.0], np.cumsum(gain)]) / n
    return RouterCurve(name, np.arange(n + 1) / n, (quality - low) / (high - low))


def random_curve(n: int) -> RouterCurve:
    shares = np.arange(n + 1) / n
    return RouterCurve("random", shares, shares.copy())


def format_report(curves: Sequence[RouterCurve], outcomes: Sequence[Outcome]) -> str:
    low, high = gap(outcomes)
    head = (
        f"{len(outcomes)} held-out prompts; pass rate all-highspeed {100 * low:.1f}%, "
        f"all-full {100 * high:.1f}%"
    )
    shares = " | ".join(f"{100 * s:.0f}%" for s in REPORT_SHARES)
    lines = [
        head,
        "",
        f"| router | APGR | CPT(50%) | CPT(80%) | PGR at full share {shares} |",
        "|---|---|---|---|" + "---|" * len(REPORT_SHARES),
    ]
    for c in curves:
        pgr = " | ".join(f"{c.pgr_at(s):.2f}" for s in REPORT_SHARES)
        lines.append(
            f"| {c.name} | {c.apgr:.3f} | {100 * c.cpt(0.5):.1f}% | {100 * c.cpt(0.8):.1f}% "
            f"| {pgr} |"
        )
    return "\n".join(lines)
