"""SFT with a curriculum: which examples each step trains on.

A small model learns to copy values from the prompt (operands, names, arguments) abruptly,
after enough short, copy-dense examples; before that, long examples only teach it formats.
So the first phase draws only the easiest difficulties, until the smoothed loss at copy
positions (`training.data.datasets.copy_positions`) falls below a threshold (or a step cap);
then every difficulty. Throughout, each domain's share is its share of the data times its
smoothed loss to `loss_power`, so the domains the model is worst at get more steps.

The state (phase, smoothed losses) is a pure function of the training log, which the
checkpoints hold, and the examples of a step a pure function of (seed, step, state): a
resumed run draws exactly the batches of an uninterrupted one.
"""

import random
from collections import Counter

from training.config import CurriculumConfig
from training.data.datasets import SFTDataset

COPY_SUMS = ("copy_ce_sum", "copy_n")


def domain_sums(domain: str) -> tuple[str, str]:
    """The log keys of one domain's summed cross-entropy and target count."""
    return f"ce_sum/{domain}", f"n/{domain}"


class Curriculum:
    def __init__(self, dataset: SFTDataset, cfg: CurriculumConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.pools: dict[tuple[bool, str], list[int]] = {}
        for i, row in enumerate(dataset.rows):
            first = row["difficulty"] in cfg.first_difficulties
            self.pools.setdefault((False, row["domain"]), []).append(i)
            if first:
                self.pools.setdefault((True, row["domain"]), []).append(i)
        counts = Counter(row["domain"] for row in dataset.rows)
        self.domains = sorted(counts)
        self.data_share = {d: counts[d] / len(dataset.rows) for d in self.domains}
        if not any(first for first, _ in self.pools):
            raise ValueError(f"no SFT example has a difficulty in {cfg.first_difficulties}")
        self._reset()

    def _reset(self) -> None:
        self.first_phase = True
        self.copy_loss: float | None = None
        self.losses: dict[str, float] = {}
        self._seen = 0

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.cfg.ema * old + (1 - self.cfg.ema) * new

    def _update(self, row: dict[str, float]) -> None:
        """Fold one logged step into the state."""
        if row.get("copy_loss") is not None:
            self.copy_loss = self._smooth(self.copy_loss, row["copy_loss"])
        for d in self.domains:
            if row.get(f"loss/{d}") is not None:
                self.losses[d] = self._smooth(self.losses.get(d), row[f"loss/{d}"])
        done = row["step"] + 1 >= self.cfg.max_first_steps or (
            self.copy_loss is not None and self.copy_loss < self.cfg.copy_loss_threshold
        )
        self.first_phase = self.first_phase and not done

    def sync(self, log: list[dict[str, float]]) -> None:
        """Bring the state up to date with the log (replayed from the start after a resume)."""
        if len(log) < self._seen:
            self._reset()
        for row in log[self._seen :]:
            self._update(row)
        self._seen = len(log)

    def mix(self) -> dict[str, float]:
        """Each domain's share of the next step (among those the phase draws from)."""
        live = [d for d in self.domains if (self.first_phase, d) in self.pools]
        weights = {
            d: self.data_share[d] * self.losses.get(d, 1.0) ** self.cfg.loss_power for d in live
        }
        total = sum(weights.values())
        # The floor keeps a learned domain alive; it never lifts one above its share of the
        # data (out-of-domain answers, 3% of the demo's data, drew 11% of its rows at 0.15).
        floored = {
            d: max(w / total, min(self.cfg.min_share, self.data_share[d]))
            for d, w in weights.items()
        }
        norm = sum(floored.values())
        return {d: w / norm for d, w in floored.items()}

    def indices(self, step: int, count: int, log: list[dict[str, float]]) -> list[int]:
        """The `count` examples of global step `step`."""
        self.sync(log)
        mix = self.mix()
        rng = random.Random(f"curriculum:{self.seed}:{step}")
        names = list(mix)
        chosen = rng.choices(names, [mix[d] for d in names], k=count)
        return [rng.choice(self.pools[(self.first_phase, d)]) for d in chosen]

    def annotate(self, row: dict[str, float]) -> None:
        """Turn the step's summed losses into means, and note the phase and mix it used."""
        copy_ce, copy_n = (row.pop(k) for k in COPY_SUMS)
        row["copy_loss"] = copy_ce / copy_n if copy_n else None
        for d in self.domains:
            ce, n = (row.pop(k, 0.0) for k in domain_sums(d))
            row[f"loss/{d}"] = ce / n if n else None
        row["phase"] = 1 if self.first_phase else 2
        row |= {f"mix/{d}": share for d, share in self.mix().items()}
