"""A toy verifiable domain for RL tests: the reward is the share of the answer's characters
that are vowels, so even a random model's samples differ in reward (every group carries a
signal) and a policy that learns to prefer vowel-heavy tokens earns more."""

import sys
from pathlib import Path

from tasks import DOMAINS, Domain, Episode, Task
from tasks.base import Verdict


class _Answer(Episode):
    def step(self, completion: str) -> bool:
        self.messages.append({"role": "assistant", "content": completion})
        self.answer = completion
        return True

    def verdict(self) -> Verdict:
        text = "".join(getattr(self, "answer", "").split())
        share = sum(c in "aeiouAEIOU" for c in text) / len(text) if text else 0.0
        return Verdict(share, f"{share:.0%} vowels")


class VowelsDomain(Domain):
    name = "vowels"

    def generate(self, seed: int, difficulty: int) -> Task:
        return Task("vowels", seed, difficulty, f"Say something ({seed % 7}).", {})

    def reference(self, task: Task, style: str) -> list[str]:
        return ["aeiou"]

    def start(self, task: Task) -> Episode:
        return _Answer(task)


def register() -> None:
    DOMAINS["vowels"] = VowelsDomain()


# `python -c RUN_WITH_TOY_DOMAIN ARGS...`: the tierserve command with the toy domain registered.
RUN_WITH_TOY_DOMAIN = """
import sys
from tests.training.toy_domain import register
register()
from serving.cli import main
main(sys.argv[1:])
"""


def train_command(stage: str, init: Path, out: Path, sets: dict[str, str]) -> list[str]:
    """`tierserve train STAGE` with the toy domain registered, `init`, `out` and `--set`s."""
    command = [sys.executable, "-c", RUN_WITH_TOY_DOMAIN, "train", stage]
    command += ["--init", str(init), "--out", str(out)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    return command
