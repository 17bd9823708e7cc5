"""Reworded training prompts keep every operand of the task, and some say it in words."""

import random
import re

from tasks import get_domain
from tasks.base import play
from tasks.code_ops import OPS_BY_NAME
from tasks.math import MathDomain, operands
from tasks.tool_bank import BANK
from training.data.natural import CODE_SAID, naturalize


def test_math_rewordings_keep_the_operands_and_use_words() -> None:
    domain, rng, worded = MathDomain(), random.Random(0), 0
    for seed in range(300):
        task = domain.generate(seed, 1 + seed % 3)
        prompt = naturalize(task, rng)[0].prompt
        numbers = sorted(int(n) for n in re.findall(r"\d+", prompt))
        assert numbers == sorted(operands(task.data["tree"])), prompt
        worded += bool(re.search(r"plus|minus|times|multiplied|sum|subtract|product|less", prompt))
    assert 60 < worded < 200


def test_tool_rewordings_rename_schemas_and_the_reference_follows() -> None:
    """Reworded tool requests keep their values, and some offer schemas the bank never uses;
    the reference call, played through the real episode, still verifies against them."""
    domain, rng, unseen = get_domain("tools"), random.Random(0), 0
    for seed in range(200):
        task, _ = naturalize(domain.generate(seed, 1 + seed % 2), rng)
        names = {tool["function"]["name"] for tool in task.tools}
        unseen += bool(names - set(BANK))
        _, verdict = play(domain, task, domain.reference(task, "think"))
        assert verdict.reward == 1.0, (verdict.reason, task.data["calls"])
        if task.difficulty == 1:  # every value is said as it is passed, however reworded
            for value in task.data["calls"][0]["arguments"].values():
                assert str(value).lower() in task.prompt.lower(), (value, task.prompt)
    assert 40 < unseen < 160


def test_code_rewordings_name_real_operations_with_their_placeholders() -> None:
    for name, others in CODE_SAID.items():
        op = OPS_BY_NAME[name]
        for said in others:
            assert "{x}" in said and ("{k}" in said) == (op.k is not None), (name, said)


def test_terminal_rewordings_change_only_the_task_sentence() -> None:
    domain, rng = get_domain("terminal"), random.Random(0)
    for seed in range(12):
        task = domain.generate(seed, 1 + seed % 3)
        reworded, _ = naturalize(task, rng)
        head, rest = task.prompt.split("Task: ")
        assert reworded.prompt.startswith(head + "Task: ")
        assert reworded.prompt.endswith(rest[rest.index("\n\n") :])
        assert reworded.prompt != task.prompt
        _, verdict = play(domain, reworded, domain.reference(reworded, "think"))
        assert verdict.reward == 1.0, verdict.reason
