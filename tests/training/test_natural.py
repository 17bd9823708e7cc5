"""Reworded training prompts keep every operand of the task, and some say it in words."""

import random
import re

from training.natural import naturalize
from training.tasks.math import MathDomain, operands


def test_math_rewordings_keep_the_operands_and_use_words() -> None:
    domain, rng, worded = MathDomain(), random.Random(0), 0
    for seed in range(300):
        task = domain.generate(seed, 1 + seed % 3)
        prompt = naturalize(task, rng)[0].prompt
        numbers = sorted(int(n) for n in re.findall(r"\d+", prompt))
        assert numbers == sorted(operands(task.data["tree"])), prompt
        worded += bool(re.search(r"plus|minus|times|multiplied|sum|subtract|product|less", prompt))
    assert 60 < worded < 200
