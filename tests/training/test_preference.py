"""DPO's loss against its formula on fixed logits, the objectives and pair selection."""

import math

import pytest
import torch

from training.objectives.preference import (
    Scored,
    brevity,
    code_quality,
    completion_logprobs,
    dpo_loss,
    preference_pair,
)

IGNORE = -100


def test_completion_logprobs_sum_only_labelled_tokens() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 3.0]]])
    labels = torch.tensor([[IGNORE, 1, 2]])
    total, count = completion_logprobs(logits, labels, IGNORE)

    def logp(row: list[float], i: int) -> float:
        return row[i] - math.log(sum(math.exp(x) for x in row))

    expected = logp([0.0, 1.0, 0.0], 1) + logp([0.5, 0.5, 3.0], 2)
    assert total.item() == pytest.approx(expected, abs=1e-6)
    assert count.tolist() == [2]


def test_dpo_sigmoid_and_ipo_match_their_formulas() -> None:
    pc, pr = torch.tensor([-3.0, -10.0]), torch.tensor([-5.0, -4.0])
    rc, rr = torch.tensor([-4.0, -9.0]), torch.tensor([-4.5, -4.5])
    beta = 0.1
    z = [(-3 + 5) - (-4 + 4.5), (-10 + 4) - (-9 + 4.5)]  # 1.5, -1.5
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta, "sigmoid")
    expected = [-math.log(1 / (1 + math.exp(-beta * v))) for v in z]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert chosen.tolist() == pytest.approx([beta * 1.0, beta * -1.0])
    assert rejected.tolist() == pytest.approx([beta * -0.5, beta * 0.5])
    ipo, _, _ = dpo_loss(pc, pr, rc, rr, beta, "ipo")
    assert ipo.tolist() == pytest.approx([(v - 1 / (2 * beta)) ** 2 for v in z], abs=1e-5)


def test_dpo_gradient_raises_the_chosen_answer() -> None:
    pc = torch.tensor([-5.0], requires_grad=True)
    pr = torch.tensor([-5.0], requires_grad=True)
    losses, _, _ = dpo_loss(pc, pr, torch.tensor([-5.0]), torch.tensor([-5.0]), 0.5)
    losses.sum().backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descent raises chosen, lowers rejected


def test_pairs_rank_by_weighted_objectives_and_skip_ties() -> None:
    right_long = Scored([1] * 90, {"correctness": 1.0, "format": 1.0, "brevity": 0.1})
    right_short = Scored([1] * 10, {"correctness": 1.0, "format": 1.0, "brevity": 0.9})
    wrong = Scored([1] * 5, {"correctness": 0.0, "format": 1.0, "brevity": 0.95})
    weights = {"correctness": 1.0, "format": 0.2, "brevity": 0.3}
    chosen, rejected = preference_pair([right_long, wrong, right_short], weights, margin=0.1)
    assert chosen is right_short and rejected is wrong
    assert preference_pair([right_short, right_short], weights, margin=0.1) is None


def test_brevity_and_code_quality() -> None:
    assert brevity(0, 100) == 1.0 and brevity(50, 100) == 0.5 and brevity(200, 100) == 0.0
    clean = "def solve(xs):\n    best = max(xs)\n    return best\n"
    dead = "def solve(xs):\n    return max(xs)\n    print('never')\n"
    unused = "def solve(xs):\n    tmp = 1\n    return max(xs)\n"
    assert code_quality(clean) == 1.0
    assert code_quality(dead) == 0.5 and code_quality(unused) == 0.5
    assert code_quality("def solve(:") == 0.0
