"""The regression gate, at both places a recipe can lose ground.

Between post-training stages: a stage's model is kept only when no domain completes fewer
held-out tasks than the model before it by more than `[regression] max_drop` points; otherwise
the next stage starts from the model before it. RL and DPO on models this small often move
nothing or trade one domain for another, so the chain must not follow them blindly.

Before publishing: the recipe's tiers replace the models under `--models` (by default the
shipped ones) only when neither tier loses a domain to the model it replaces by more than
`max_drop` points on the same held-out tasks; otherwise they are published under the run's
`candidates/` and the run ends with an error naming the domains. A retrain cut short, or one
whose settings were changed for the worse, then cannot silently overwrite better models.
"""

import hashlib
from collections.abc import Callable
from pathlib import Path

from tasks import harness

Evaluate = Callable[[Path, Path], list[dict]]  # (model dir, report path) -> summary rows


class GateError(RuntimeError):
    """The recipe's tiers lost a domain to the models they were to replace."""


def post_training_verdict(
    rows: list[dict], before_rows: list[dict], before: str, max_drop: float
) -> str | None:
    """Why a post-training stage's model is not kept against the stage `before`, or None."""
    failures = harness.regressions(rows, {"summary": before_rows}, max_drop)
    return f"against {before}: " + "; ".join(failures) if failures else None


def replacement_regressions(
    new: dict[str, list[dict]],
    replaced: dict[str, Path],
    evaluate: Evaluate,
    gate_dir: Path,
    max_drop: float,
) -> dict[str, list[str]]:
    """Per tier, the domains its new model loses to the one at its `replaced` path (a tier
    with nothing there passes: there is nothing to lose to)."""
    gate_dir.mkdir(parents=True, exist_ok=True)
    failures = {}
    for tier, rows in new.items():
        old = replaced[tier]
        if not (old / "config.json").exists():
            continue
        # Named by the replaced weights: a report is reused only for the model it measured
        # (after a run publishes, the next run's gate measures what it published).
        weights = hashlib.sha256((old / "model.safetensors").read_bytes()).hexdigest()[:12]
        baseline = evaluate(old, gate_dir / f"eval-replaced-{tier}-{weights}.json")
        lost = harness.regressions(rows, {"summary": baseline}, max_drop)
        if lost:
            failures[tier] = lost
    return failures
