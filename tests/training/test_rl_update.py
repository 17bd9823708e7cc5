"""One RL update measured on a fixed batch of real rollouts, against what the objective must
do: the rollout engine's log-probabilities are the trainer's (ratio 1 at the first pass), the
stage's gradient is the token-level policy gradient written by hand (each answer scored on
its own, unpadded), a step along it raises the answers with positive advantage and lowers the
others, and the next rollouts are sampled from the stepped weights."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from serving.engine.llm_engine import EngineConfig
from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tests.training.toy_domain import VowelsDomain
from training.data.datasets import IGNORE
from training.objectives.grpo import group_advantages
from training.stages.outputs import pad_id
from training.stages.rl import RLBatch, RLStage, Row, collate, label_logprobs, rl_loss, turn_rows
from training.stages.rollouts import inference_copy, play

DOMAINS = {"vowels": VowelsDomain()}
TASKS = [VowelsDomain().generate(seed, 1) for seed in range(3)]


def rollout_rows(model: CausalLM, tokenizer: Tokenizer) -> list[Row]:
    """Groups of 8 sampled answers to each task from an engine over `model`'s weights, each
    answer a row with its group-standardised reward as advantage."""
    engine = inference_copy(model, tokenizer, EngineConfig(max_num_seqs=32))
    groups = play(engine, DOMAINS, TASKS, 8, 12, seed=0, max_turns=1)
    rows = []
    for group in groups:
        advantages = group_advantages(torch.tensor([[r.reward for r in group]]))[0]
        for rollout, adv in zip(group, advantages.tolist(), strict=True):
            rows += turn_rows(rollout, adv, 256)
    return rows


def answer_logprobs(model: CausalLM, row: Row) -> torch.Tensor:
    """The answer's token log-probabilities from a forward over this row alone."""
    prompt, completion = row[0], row[1]
    ids = torch.tensor([prompt + completion[:-1]])
    logits = model.compute_logits(model(ids, torch.arange(ids.shape[1])[None]))[0]
    logp = F.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 :]
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="module")
def policy(random_checkpoint: Path) -> tuple[CausalLM, Tokenizer, RLBatch, list[Row]]:
    torch.manual_seed(0)
    model = load_checkpoint(random_checkpoint, keep_fp4=False).train()
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    rows = rollout_rows(model, tokenizer)
    batch, old, adv, off_policy = collate(rows, pad_id(tokenizer))
    assert not off_policy.any()
    return model, tokenizer, RLBatch(batch, old, None, adv), rows


def test_rollout_logprobs_are_the_trainers(policy) -> None:
    model, _, batch, rows = policy
    assert len({adv[0] for *_, adv in rows}) > 2, "the toy rewards differ within groups"
    mask = batch.labels != IGNORE
    with torch.no_grad():
        logp = label_logprobs(model, batch)[0]
    assert (logp - batch.old_logprobs)[mask].abs().max() < 1e-4


def test_stage_gradient_is_the_hand_written_policy_gradient(policy, random_checkpoint) -> None:
    model, _, batch, rows = policy
    tokens = batch.num_targets
    model.zero_grad()
    (rl_loss(RLStage(init=str(random_checkpoint)))(model, batch).token_sum / tokens).backward()
    ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    # At ratio 1 the clipped surrogate's gradient is A * grad log pi, summed over the answer
    # tokens and divided by the batch's token count (DAPO's token-level loss, TRL's `dapo`).
    reference = -sum(adv * answer_logprobs(model, row).sum() for row in rows for adv in [row[3][0]])
    (reference / tokens).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    assert len(ours) == len(expected)
    norm = torch.sqrt(sum((g**2).sum() for g in expected))
    assert norm > 1e-3
    error = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(ours, expected, strict=True)))
    assert error < 1e-4 * norm, (float(error), float(norm))


def test_a_reference_answer_trains_as_sft_weighted_by_its_advantage(
    policy, random_checkpoint
) -> None:
    """A row with no sampling log-probabilities (a reference answer): its ratio is 1, so its
    gradient is its advantage times its log-probability's, beside the sampled rows' policy
    gradient; the ratio's statistics leave it out."""
    model, tokenizer, _, rows = policy
    prompt, completion = rows[0][0], rows[0][1]
    reference: Row = (prompt, completion[::-1], None, [1.5] * len(completion))
    mixed = [*rows, reference]
    batch, old, adv, off_policy = collate(mixed, pad_id(tokenizer))
    assert int(off_policy.sum()) == len(completion)
    rl_batch = RLBatch(batch, old, None, adv, off_policy)
    model.zero_grad()
    parts = rl_loss(RLStage(init=str(random_checkpoint)))(model, rl_batch)
    parts.token_sum.backward()
    ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    expected = -sum(row[3][0] * answer_logprobs(model, row).sum() for row in mixed)
    expected.backward()
    theirs = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    norm = torch.sqrt(sum((g**2).sum() for g in theirs))
    error = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(ours, theirs, strict=True)))
    assert error < 1e-4 * norm, (float(error), float(norm))
    # Its old log-probabilities are 0 in the batch: counted, the ratio would be far from 1.
    assert parts.metrics["ratio_max_dev"] < 1e-3
    assert parts.metrics["clip_frac"] == 0.0


def test_a_step_moves_the_answers_and_the_next_rollouts_sample_it(
    policy, random_checkpoint
) -> None:
    model, tokenizer, batch, rows = policy
    model = copy.deepcopy(model)
    before = copy.deepcopy(model)
    model.zero_grad()
    rl_loss(RLStage(init=str(random_checkpoint)))(model, batch).token_sum.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad / norm
    with torch.no_grad():
        change = [
            (adv, float(answer_logprobs(model, row).sum() - answer_logprobs(before, row).sum()))
            for row in rows
            for adv in [row[3][0]]
        ]
    # Answers share parameters, so one may move against its sign; the good ones together rise.
    assert sum(delta for adv, delta in change if adv > 0) > 0, change
    assert sum(delta for adv, delta in change if adv < 0) < 0, change
    # The next step's engine copies the stepped weights: its sampling log-probabilities are
    # the stepped model's, not the ones before the step.
    after = rollout_rows(model, tokenizer)
    with torch.no_grad():
        for row in after:
            sampled = torch.tensor(row[2])
            assert (answer_logprobs(model, row) - sampled).abs().max() < 1e-4
        stale = max(
            float((answer_logprobs(before, row) - torch.tensor(row[2])).abs().max())
            for row in after
        )
    assert stale > 1e-2
