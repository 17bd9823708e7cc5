"""Preference alignment: DPO against a frozen reference, on pairs chosen by several objectives.

Each sampled answer is scored on its own objectives (the verifier's correctness, a valid
format, brevity in tokens, and for code a quality score); a weighted sum ranks the samples of
one prompt, and its best and worst form a pair when they differ by a margin. The loss is
DPO's (Rafailov et al., 2023): with z = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) -
log ref(y_l)), sigmoid: -log sigmoid(beta z); IPO (Azar et al., 2023): (z - 1 / (2 beta))^2,
on length-averaged log-probabilities as TRL computes it.
"""

import ast
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tasks.code import parse_python
from training.data.datasets import IGNORE
from training.objectives.losses import token_losses

DPOLoss = Literal["sigmoid", "ipo"]
OBJECTIVES = ("correctness", "format", "brevity", "quality")


@dataclass(frozen=True)
class Scored:
    """One sampled answer to a prompt with its per-objective scores, each in [0, 1]."""

    completion_ids: list[int]
    scores: dict[str, float]


def completion_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the labelled tokens, and how many there are.
    `logits` [B, L, V] predict `labels` [B, L] (already aligned: position t predicts
    labels[t])."""
    keep = labels != ignore_index
    logp = -token_losses(logits, labels.masked_fill(~keep, IGNORE))
    return logp.sum(-1), keep.sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss_type: DPOLoss = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta * (log pi - log ref) of both answers.

    Inputs are per-pair sequence log-probabilities (for IPO, averaged over tokens)."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    z = chosen - rejected
    losses = -F.logsigmoid(beta * z) if loss_type == "sigmoid" else (z - 1 / (2 * beta)) ** 2
    return losses, beta * chosen.detach(), beta * rejected.detach()


def combined_score(scores: dict[str, float], weights: dict[str, float]) -> float:
    return sum(weights.get(name, 0.0) * value for name, value in scores.items())


def preference_pair(
    samples: list[Scored], weights: dict[str, float], margin: float
) -> tuple[Scored, Scored] | None:
    """(chosen, rejected): the prompt's best and worst samples by weighted score, or None when
    they are closer than `margin` (nothing to learn from a tie)."""
    ranked = sorted(samples, key=lambda s: combined_score(s.scores, weights))
    worst, best = ranked[0], ranked[-1]
    if combined_score(best.scores, weights) - combined_score(worst.scores, weights) < margin:
        return None
    return best, worst


def brevity(num_tokens: int, budget: int) -> float:
    """1 for an empty answer, falling linearly to 0 at the token budget."""
    return max(0.0, 1.0 - num_tokens / budget)


def code_quality(source: str) -> float:
    """A small lint of the answer's Python: it must parse, and every statement after a
    `return`/`raise` in the same block (dead code) and every assigned name never read costs a
    share of the score."""
    try:
        tree = parse_python(source)
    except SyntaxError:
        return 0.0
    problems = 0
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block[:-1]):
                if isinstance(stmt, ast.Return | ast.Raise | ast.Continue | ast.Break):
                    problems += len(block) - i - 1
                    break
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        stored = {
            n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        loaded = {
            n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }
        problems += len(stored - loaded - {"_"})
    return 1.0 / (1 + problems)
