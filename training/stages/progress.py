"""One progress display for a run of many stages.

A stage run alone shows its own bar (steps of that stage). A recipe chains dozens of runs, and
a bar per run says nothing about the whole: while a recipe holds a `RunProgress` open, every
trainer advances that one bar instead, which counts the training steps of the whole plan, says
which stage (and phase) is running at which of its steps, and estimates the time left from the
steps done so far in this process (tqdm's smoothed rate, so resumed steps do not count as
instant ones). Steps of different stages cost different times (an RL step samples rollouts),
so the estimate is rough until the running stage has taken a few steps.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

_active: "RunProgress | None" = None


class RunProgress:
    def __init__(self, total: int, done: int) -> None:
        self.bar = tqdm(total=total, initial=done, unit="step", desc="recipe", smoothing=0.05)
        self.stage = ""

    def begin(self, name: str) -> None:
        """`name` (a stage, or `stage/phase`) runs next: it heads the bar."""
        self.stage = name
        self.bar.set_description_str(name)

    def note(self, text: str) -> None:
        """Work between training steps (an evaluation, the router's tasks), which names what
        it works on, shown until the next run begins."""
        self.bar.set_description_str(text)

    def close(self) -> None:
        self.bar.close()


class _RunView:
    """What a trainer's loop drives while a recipe's bar is open: its steps advance it."""

    def __init__(self, run: RunProgress, start: int, total: int) -> None:
        self.run, self.step, self.total = run, start, total

    def update(self, n: int = 1) -> None:
        self.step += n
        self.run.bar.set_description_str(
            f"{self.run.stage} {self.step}/{self.total}", refresh=False
        )
        self.run.bar.update(n)

    def set_postfix(self, postfix: dict[str, Any]) -> None:
        self.run.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.run.bar.set_description_str(self.run.stage)


def step_bar(desc: str, start: int, total: int, disable: bool) -> tqdm | _RunView:
    """The bar a trainer advances once a step: the recipe's, when one is open."""
    if _active is not None and not disable:
        return _RunView(_active, start, total)
    return tqdm(initial=start, total=total, desc=desc, disable=disable)


def begin(name: str) -> None:
    """Head the recipe's bar with the run that starts now (a stage, or `stage/phase`)."""
    if _active is not None:
        _active.begin(name)


def note(text: str) -> None:
    """Say on the recipe's bar what runs between steps; without one, nothing to say it on."""
    if _active is not None:
        _active.note(text)


@contextmanager
def run_progress(total: int, done: int) -> Iterator[RunProgress]:
    """Open the whole run's bar: `total` steps in the plan, `done` of them finished before."""
    global _active
    if _active is not None:
        raise RuntimeError("a run's progress display is already open")
    _active = RunProgress(total, done)
    try:
        yield _active
    finally:
        _active.close()
        _active = None
