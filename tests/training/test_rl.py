"""GRPO / DAPO pieces on fixed tensors: advantages, clip-higher, token-level sums, dynamic
sampling (on the verdicts, not the overlong penalty), the overlong penalty, advantages placed
by a located false step, the k3 KL,
domain weights that follow progress, the tasks a step draws, how a step's rows split, and a
reference answer as an off-policy member of its group."""

import pytest
import torch

from serving.model.tokenizer import Tokenizer
from tasks import Task
from tasks.math import MathDomain
from training.config import RLConfig
from training.objectives.grpo import (
    DomainWeights,
    group_advantages,
    informative,
    kl_k3_sum,
    located_advantages,
    overlong_penalty,
    policy_loss_sum,
    ratio_stats,
)
from training.stages.rl import (
    RLStage,
    episode_advantages,
    false_steps,
    micro_batch_rows,
    step_tasks,
    turn_rows,
)
from training.stages.rollouts import Rollout, Turn, reference_rollout


def test_group_advantages_are_standardised_within_each_group() -> None:
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 5.0]]))
    assert adv[0].tolist() == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([-1 / 3**0.5] * 3 + [3**0.5], abs=1e-5)
    assert group_advantages(torch.ones(1, 4)).abs().max() == 0  # no signal, no step


def test_ratio_stats_over_the_masked_tokens() -> None:
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 9.0], [0.5, 1.0, 1.0]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])  # 9.0 is masked out
    stats = ratio_stats(new, old, mask)
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["ratio_std"] == pytest.approx((0.5 / 5) ** 0.5)  # deviations +-0.5, three 0
    assert stats["ratio_max_dev"] == pytest.approx(0.5)
    nothing = ratio_stats(new, old, torch.zeros(2, 3, dtype=torch.bool))
    assert nothing == {"ratio_mean": 1.0, "ratio_std": 0.0, "ratio_max_dev": 0.0}


def test_dynamic_sampling_drops_groups_with_equal_rewards() -> None:
    assert not informative([1.0, 1.0, 1.0]) and not informative([0.0, 0.0])
    assert informative([0.0, 1.0, 0.0])


def episodes(rewards: list[float], lengths: list[int]) -> list[Rollout]:
    task = Task("math", 0, 1, "1 + 1?", {})
    return [
        Rollout(task, g, [Turn([1], [2] * n, [0.0] * n)], reward)
        for g, (reward, n) in enumerate(zip(rewards, lengths, strict=True))
    ]


def test_dynamic_sampling_ignores_overlong_penalties_among_equal_verdicts() -> None:
    rl = RLConfig(max_tokens=100, overlong_cache=20)
    all_failed = episodes([0.0] * 4, [50, 50, 50, 95])  # the last one is penalised
    assert episode_advantages(all_failed, rl) is None
    kept = episode_advantages(all_failed, rl.model_copy(update={"dynamic_sampling": False}))
    assert kept is not None and kept[3] < 0 < kept[0]
    mixed = episode_advantages(episodes([1.0, 0.0, 0.0, 1.0], [85, 50, 50, 50]), rl)
    assert mixed is not None and mixed[3] > mixed[0] > 0 > mixed[1] == mixed[2]


def test_a_learned_reward_adds_its_own_standardised_share() -> None:
    rl = RLConfig(dynamic_sampling=False)
    tied = episodes([0.0] * 4, [50] * 4)
    ranked = episode_advantages(tied, rl, [0.3, -1.0, 2.0, 0.1])
    # Where the verdicts tie, the learned reward ranks the answers at its coefficient's size.
    assert ranked is not None and ranked[2] > ranked[0] > ranked[3] > ranked[1]
    assert max(abs(a) for a in ranked) < 2 * rl.reward_model_coef
    verdicts = episodes([1.0, 0.0, 1.0, 0.0], [50] * 4)
    shaped = episode_advantages(verdicts, rl, [0.0, 1.0, 2.0, 0.0])
    plain = episode_advantages(verdicts, rl)
    assert shaped is not None and plain is not None
    assert shaped[2] > shaped[0] > 0 > shaped[1] > shaped[3]
    assert all(abs(a - b) < 2 * rl.reward_model_coef for a, b in zip(shaped, plain, strict=True))
    off = rl.model_copy(update={"reward_model_coef": 0.0})
    assert episode_advantages(verdicts, off, [0.0, 1.0, 2.0, 0.0]) == plain
    assert episode_advantages(tied, RLConfig(), [0.3, -1.0, 2.0, 0.1]) is None  # dropped


def test_clip_higher_is_asymmetric_and_the_loss_is_a_token_sum() -> None:
    old = torch.zeros(2, 3)
    # ratios 1.5 (positive advantage: clipped at 1.28), 0.5 (negative: clipped at 0.8).
    new = torch.log(torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[2.0], [-1.0]])  # one per answer, the same for each of its tokens
    loss, clip_frac = policy_loss_sum(new, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # row 0: min(1.5*2, 1.28*2) = 2.56, then 1*2 (third token masked)
    # row 1: min(0.5*-1, 0.8*-1) = -0.8, then -1, -1
    assert loss.item() == pytest.approx(-(2.56 + 2.0 - 0.8 - 1.0 - 1.0), abs=1e-5)
    assert clip_frac.item() == pytest.approx(2 / 5)


def test_unclipped_gradient_follows_the_advantage() -> None:
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss_sum(new, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.28)
    loss.backward()
    assert (new.grad < 0).all()  # descent raises the log-probability of a good answer


def test_overlong_penalty_ramps_over_the_cache() -> None:
    assert overlong_penalty(100, budget=512, cache=128) == 0.0
    assert overlong_penalty(384, budget=512, cache=128) == 0.0
    assert overlong_penalty(448, budget=512, cache=128) == pytest.approx(-0.5)
    assert overlong_penalty(600, budget=512, cache=128) == -1.0


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.2]]))
    mask = torch.ones(1, 2)
    assert kl_k3_sum(lp, lp, mask).item() == pytest.approx(0.0, abs=1e-7)
    assert kl_k3_sum(lp, torch.log(torch.tensor([[0.25, 0.4]])), mask).item() > 0


def test_domain_weights_follow_learning_progress_and_fixed_keeps_the_mix() -> None:
    mix = {"math": 1.0, "code": 1.0, "tools": 2.0}
    dynamic, fixed = DomainWeights(mix), DomainWeights(mix, fixed=True)
    for weights in (dynamic, fixed):
        for d in mix:
            weights.update(d, 0.2)
        for _ in range(5):
            weights.update("math", 0.8)  # math is learning; the others stall
            weights.update("code", 0.2)
            weights.update("tools", 0.2)
    w = dynamic.weights()
    assert w["math"] > w["code"] and w["code"] == pytest.approx(w["tools"])
    assert min(w.values()) > 0 and sum(w.values()) == pytest.approx(1.0)
    assert fixed.weights() == pytest.approx({"math": 0.25, "code": 0.25, "tools": 0.5})


def test_domain_weights_favour_learnable_domains_and_try_unmeasured_ones() -> None:
    weights = DomainWeights({"math": 1.0, "code": 1.0, "terminal": 1.0, "tools": 1.0})
    for rate in (1.0, 0.875, 1.0, 0.875, 1.0):  # solved: its noise is no progress
        weights.update("terminal", rate)
    for _ in range(5):
        weights.update("code", 0.5)  # half its groups are informative
        weights.update("math", 0.0)  # hopeless for now
    w = weights.weights()
    assert w["code"] > 2 * w["terminal"] and w["terminal"] > w["math"] > 0
    assert w["tools"] == pytest.approx(w["code"])  # not measured yet: weighs as the best


def test_a_fixed_prompt_set_is_visited_once_an_epoch_and_fresh_draws_never_repeat() -> None:
    data = {"mix": {"math": 0.5, "code": 0.5}, "difficulties": [1, 2], "seed": 700}
    weights = {"math": 0.5, "code": 0.5}
    fixed = RLStage(init="x", data=data, rl={"tasks_per_step": 4, "prompts": 8})

    def epoch(start: int) -> list[tuple[str, int, int]]:
        tasks = [t for s in (start, start + 1) for t in step_tasks(fixed, s, 0, 1, weights)]
        return [(t.domain, t.seed, t.difficulty) for t in tasks]

    first, second = epoch(0), epoch(2)
    assert len(set(first)) == 8 and set(first) == set(second)  # the same 8 tasks each epoch
    assert first != second  # in a new order
    assert {d for d, _, _ in first} == {"math", "code"}
    assert epoch(0) == first  # a resumed run draws them again
    fresh = RLStage(init="x", data=data, rl={"tasks_per_step": 4})
    seeds = [t.seed for s in range(4) for t in step_tasks(fresh, s, 0, 1, weights)]
    assert len(set(seeds)) == 16


def test_micro_batches_hold_rows_of_like_length_and_every_row_once() -> None:
    lengths = [3, 90, 5, 88, 4, 91, 6, 87]  # completion lengths, short and long interleaved
    rows = [([1, 2], [7] * n, [-0.5] * n, [float(i)] * n) for i, n in enumerate(lengths)]
    parts = micro_batch_rows(rows, 2, pad_id=0)
    assert [sorted(len(r[1]) for r in part) for part in parts] == [[3, 4, 5, 6], [87, 88, 90, 91]]
    assert sorted(r[3][0] for part in parts for r in part) == [float(i) for i in range(8)]
    padding = micro_batch_rows(rows[:1], 3, pad_id=0)
    assert len(padding) == 3 and padding[1] == padding[2] == [([0, 0], [], [], [])]


def test_a_located_false_step_places_the_advantage() -> None:
    assert located_advantages(-0.5, 4, None, 1.0) == [-0.5] * 4
    # Failed: the checked prefix is not pushed down, the false step costs the penalty more.
    assert located_advantages(-0.5, 6, (2, 4), 1.0) == [0, 0, -1.5, -1.5, -0.5, -0.5]
    # Right by luck: the prefix keeps its reward, nothing from the false step on is raised.
    assert located_advantages(0.8, 5, (1, 2), 1.0) == [0.8, -1.0, 0, 0, 0]
    # A dropped group's answer (no outcome signal) trains on its false step alone.
    assert located_advantages(0.0, 4, (3, 4), 1.0) == [0, 0, 0, -1.0]


def test_false_steps_are_found_in_the_sampled_tokens(random_checkpoint) -> None:
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    domain = MathDomain()
    task = domain.generate(3, 2)
    lines = domain.reference(task, "short")[0].splitlines(keepends=True)
    slip = next(i for i, line in enumerate(lines) if "=" in line)
    wrong = lines[slip].replace("=", "=9", 1)
    ids = tokenizer.encode("".join([*lines[:slip], wrong, *lines[slip + 1 :]]))
    good = tokenizer.encode("".join(lines))
    rollouts = [
        Rollout(task, g, [Turn([1], c, [0.0] * len(c))], 0.0) for g, c in enumerate([ids, good])
    ]
    errors = [false_steps(r, tokenizer) for r in rollouts]
    assert errors[1] == [None]
    ((start, end),) = errors[0]
    assert tokenizer.decode(ids[start:end], False).strip() == wrong.strip()
    # A dropped group (advantage None): the answer with a false step still makes a row, whose
    # tokens other than the false step's carry nothing.
    (row,) = turn_rows(rollouts[0], None, 1024, errors[0], penalty=1.0)
    assert [i for i, a in enumerate(row[3]) if a] == list(range(start, end))
    assert turn_rows(rollouts[1], None, 1024, errors[1], penalty=1.0) == []


def test_a_reference_answer_joins_its_group_as_an_off_policy_success(random_checkpoint) -> None:
    tokenizer = Tokenizer.from_dir(random_checkpoint)
    domain = MathDomain()
    task = domain.generate(5, 3)
    reference = reference_rollout(tokenizer, task, "short", 8)
    assert (reference.reward, reference.off_policy, reference.sample) == (1.0, True, 8)
    (turn,) = reference.turns
    # Rendered as a sampled turn is, tokenized as SFT tokenizes an answer.
    messages = [{"role": "user", "content": task.prompt}]
    assert turn.prompt_ids == tokenizer.encode(tokenizer.apply_chat_template(messages))
    eos = tokenizer.raw.token_to_id(tokenizer.eos_token)
    assert turn.completion_ids == [*tokenizer.encode(domain.reference(task, "short")[0]), eos]
    # Eight sampled failures: the group is informative only through the reference, which is
    # raised and carries no sampling log-probabilities; the failures are lowered.
    failed = [Rollout(task, g, [Turn([1], [5, 6], [-0.1, -0.2])], 0.0) for g in range(8)]
    advantages = episode_advantages([*failed, reference], RLConfig(max_tokens=1024))
    assert advantages is not None and advantages[-1] > 0 > advantages[0]
    (row,) = turn_rows(reference, advantages[-1], 1024)
    assert row[2] is None and set(row[3]) == {advantages[-1]}
    (sampled,) = turn_rows(failed[0], advantages[0], 1024)
    assert sampled[2] == [-0.1, -0.2]
