"""The router stage: the learned router trained on the outcomes of the tiers this run made.

The router learns which requests need the full tier from both tiers playing the same tasks
(`router/learned.py`), so it must come after the tiers it routes between: a router trained on
other tiers sends the wrong requests up. The tasks come from an evaluation run seed other than
the held-out tables', so the router is never scored on what it trained on. The training is
`tierserve train router`'s own, run on the two reports.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from router.commands import run_train_router
from router.learned import LearnedPolicy
from router.outcomes import load_outcomes
from training.config import EvalSpec, RouterSpec

Evaluate = Callable[[Path, EvalSpec, Path], list[dict]]  # (model dir, spec, report path)


def train_router(
    tiers: dict[str, Path], domains: list[str], spec: RouterSpec, out_dir: Path, evaluate: Evaluate
) -> Path:
    """Both tiers play `spec`'s tasks (reports kept under `out_dir`, reused when resumed),
    then the router trains on them; returns `out_dir/router.npz`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = EvalSpec(
        domains=domains,
        difficulties=spec.difficulties,
        n=spec.n,
        seed=spec.seed,
        max_tokens=spec.max_tokens,
    )
    reports = {tier: out_dir / f"outcomes-{tier}.json" for tier in ("full", "highspeed")}
    for tier, report in reports.items():
        evaluate(tiers[tier], tasks, report)
    path = out_dir / "router.npz"
    run_train_router(
        argparse.Namespace(
            full=reports["full"],
            highspeed=reports["highspeed"],
            target_full_share=spec.target_full_share,
            out=path,
        )
    )
    summary = {
        "paired_tasks": len(load_outcomes(reports["full"], reports["highspeed"])),
        "threshold": LearnedPolicy.load(path).threshold,
        "target_full_share": spec.target_full_share,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return path
