"""Seed spaces: training data and evaluation never share a task.

Every task is fully determined by (domain, seed, difficulty). Training data is drawn from
seeds below `EVAL_SEED_BASE`, evaluation from seeds at or above it, and each side refuses the
other's seeds, so a held-out score can never be inflated by a task seen in training.
"""

EVAL_SEED_BASE = 1 << 40


def train_seed(seed: int) -> int:
    if not 0 <= seed < EVAL_SEED_BASE:
        raise ValueError(f"training seed {seed} is outside [0, {EVAL_SEED_BASE}): held out")
    return seed


def eval_seed(run_seed: int, index: int) -> int:
    """The index-th held-out task seed of an evaluation run."""
    if run_seed < 0 or index < 0:
        raise ValueError("seeds and indices are non-negative")
    return EVAL_SEED_BASE + run_seed * 1_000_003 + index
