"""The RL stage: each step samples tasks, plays groups of episodes with the current policy
through our engine, and takes one optimizer step on the GRPO / DAPO objective
(training/objectives/grpo.py).

Tasks come from the training seed range, their domains drawn by `DomainWeights` (learning
progress, or the fixed mix as a baseline) and their difficulties from the data config, all
from a generator seeded by (seed, step, rank); or, with `rl.prompts`, from a fixed set of
that many tasks visited in epochs, as a dataset is. With the rollouts' own seeded sampling, a
resumed run repeats exactly what the uninterrupted one did. The domain weights' state is
checkpointed with the model. Each answer turn becomes one training row (prompt, completion,
the sampling log-probabilities, its episode's advantage); the rows of a step are split over
the `grad_accum` micro-batches by length, and the trainer divides the summed token losses by the
step's completion tokens (DAPO's token-level loss). With `rl.reward_model`, a learned
reward per objective (training/stages/reward_model.py), merged, joins each verdict. With
`rl.reference_style`, the domain's reference answer joins each group as a member no sampling
drew (LUFFY's mixed-policy GRPO), so a task the policy never solves still teaches.
"""

import bisect
import random
from pathlib import Path
from typing import Any, Literal

import torch

from serving.engine.llm_engine import EngineConfig
from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tasks import DOMAINS, Task
from tasks.seeds import train_seed
from training.config import DataConfig, FromCheckpoint, QATConfig, RLConfig
from training.data.datasets import IGNORE, Batch, SampleOrder, completion_batch
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
from training.objectives.losses import LossParts, token_losses
from training.objectives.reward_model import load_reward_model
from training.stages.policy import post_train, trainable_policy
from training.stages.qat import enable_qat
from training.stages.reward_model import merged_rewards
from training.stages.rollouts import Rollout, inference_copy, play, reference_rollout
from training.stages.trainer import EvalFn, Trainer


class RLStage(FromCheckpoint):
    """`init` is the policy trained (and, with a KL term, the frozen reference). With `[qat]`
    the policy samples, learns and ships through the FP4 weights it is served with."""

    stage: Literal["rl"] = "rl"
    rl: RLConfig = RLConfig()
    qat: QATConfig = QATConfig()


class RLBatch(Batch):
    """A batch of answer turns with what the objective needs beside the tokens."""

    def __init__(
        self,
        batch: Batch,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        off_policy: torch.Tensor | None = None,
    ) -> None:
        super().__init__(batch.input_ids, batch.labels, batch.padding_mask)
        self.old_logprobs = old_logprobs  # [B, L], aligned with labels (0 where IGNORE)
        self.ref_logprobs = ref_logprobs  # [B, L], or None when no KL is tracked
        self.advantages = advantages  # [B, L], aligned with labels
        # [B, L] bool: the tokens of reference answers, which no sampling drew; None: none
        self.off_policy = off_policy


def label_logprobs(model: CausalLM, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of each position's label [B, L] (0 where IGNORE), and the logits."""
    logits = model.compute_logits(
        model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
    )
    return -token_losses(logits, batch.labels), logits


def rl_loss(config: RLStage) -> Any:
    rl = config.rl

    def loss(model: CausalLM, batch: RLBatch) -> LossParts:
        mask = batch.labels != IGNORE
        logp, logits = label_logprobs(model, batch)
        old, sampled = batch.old_logprobs, mask
        if batch.off_policy is not None:
            # A reference answer's tokens have no sampling probability: their ratio is taken
            # to the policy itself (1, never clipped), so their gradient is the advantage
            # times their log-probability's, as in SFT weighted by the advantage.
            old = torch.where(batch.off_policy, logp.detach(), old)
            sampled = mask & ~batch.off_policy
        objective, clipped = policy_loss_sum(
            logp, old, batch.advantages, mask, rl.eps_low, rl.eps_high
        )
        metrics = {"clip_frac": clipped.item()}
        metrics |= ratio_stats(logp.detach(), old, sampled)
        if batch.ref_logprobs is not None:  # the KL to `init`: a term, or only tracked
            kl = kl_k3_sum(logp if rl.kl_coef > 0 else logp.detach(), batch.ref_logprobs, mask)
            objective = objective + rl.kl_coef * kl
            metrics["kl"] = kl.item() / max(1, int(mask.sum()))
        with torch.no_grad():
            probs = logits.float().softmax(-1)
            entropy = -(probs * probs.clamp(min=1e-12).log()).sum(-1)
            metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
        nll = -(logp.detach() * mask).sum()
        return LossParts(objective, nll, torch.zeros(()), metrics)

    return loss


def step_tasks(
    config: RLStage, step: int, rank: int, world: int, weights: dict[str, float]
) -> list[Task]:
    """The tasks one process plays at one step: domains drawn by `weights`, difficulties from
    the data config, seeds from the training range, all from a generator seeded by (seed,
    step, rank), so a resumed run (or another trainer given the same prompts) plays them
    again."""
    rl, data = config.rl, config.data
    first = (step * world + rank) * rl.tasks_per_step
    if rl.prompts is not None:  # the k-th draw of a seeded order over a fixed set of tasks
        # Task j of the set: domain by the data config's mix, drawn by j alone.
        order = SampleOrder(rl.prompts, config.train.seed)
        indices = [order[first + i] for i in range(rl.tasks_per_step)]
        return [
            _draw_task(random.Random(f"rl-prompt:{data.seed}:{j}"), data.mix, data, j)
            for j in indices
        ]
    rng = random.Random(f"rl:{config.train.seed}:{step}:{rank}")
    return [_draw_task(rng, weights, data, first + i) for i in range(rl.tasks_per_step)]


def _draw_task(
    rng: random.Random, weights: dict[str, float], data: DataConfig, offset: int
) -> Task:
    """Training task `data.seed + offset`, its domain drawn by `weights` and its difficulty
    from the data config's list."""
    names = list(weights)
    domain = rng.choices(names, [weights[n] for n in names])[0]
    return DOMAINS[domain].generate(train_seed(data.seed + offset), rng.choice(data.difficulties))


def episode_advantages(
    group: list[Rollout], rl: RLConfig, learned: list[float] | None = None
) -> list[float] | None:
    """Each episode's advantage: its verdict plus the overlong penalty on its longest turn,
    standardised within the group; None when dynamic sampling drops the group. DAPO drops a
    group on its verdicts alone: among answers that all failed (or all passed), the
    standardised penalty would otherwise become a full-size signal to be short, whatever
    that costs the answers.

    With a reward model, its `learned` rewards, standardised within the group apart, add
    `reward_model_coef` times theirs. Apart, so that the coefficient is the learned reward's
    share of the signal in every group: folded into the rewards before standardising, it
    would become a full-size signal wherever the verdicts tie, from a model that ranks
    held-out pairs far from perfectly, and the policy would learn to please it instead of
    the verifier (docs/training.md measures both)."""
    if rl.dynamic_sampling and not informative([r.reward for r in group]):
        return None
    rewards = [
        r.reward
        + overlong_penalty(
            max((len(t.completion_ids) for t in r.turns), default=0),
            rl.max_tokens,
            rl.overlong_cache,
        )
        for r in group
    ]
    advantages = group_advantages(torch.tensor([rewards]))[0]
    if learned is not None:
        advantages += rl.reward_model_coef * group_advantages(torch.tensor([learned]))[0]
    return advantages.tolist()


# One answer turn: prompt ids, completion ids, the completion's sampling log-probabilities
# (None: a reference answer, not sampled), and each completion token's advantage.
Row = tuple[list[int], list[int], list[float] | None, list[float]]


def error_tokens(tokenizer: Tokenizer, ids: list[int], error: tuple[int, int]) -> tuple[int, int]:
    """The tokens of `ids` that hold the characters `error` of their decoded text: the first
    whose text ends past its start, up to the first whose text reaches its end."""

    def ending_past(offset: int) -> int:  # decoded prefixes only grow, so bisect them
        return bisect.bisect_right(
            range(len(ids)), offset, key=lambda i: len(tokenizer.decode(ids[: i + 1], False))
        )

    start = ending_past(error[0])
    return start, max(start + 1, min(len(ids), ending_past(error[1] - 1) + 1))


def false_steps(rollout: Rollout, tokenizer: Tokenizer) -> list[tuple[int, int] | None]:
    """Each turn's first false step as its domain finds it (`Domain.first_error`), in tokens."""
    domain = DOMAINS[rollout.task.domain]
    spans = []
    for turn in rollout.turns:
        found = domain.first_error(rollout.task, tokenizer.decode(turn.completion_ids, False))
        spans.append(found and error_tokens(tokenizer, turn.completion_ids, found))
    return spans


def turn_rows(
    rollout: Rollout,
    advantage: float | None,
    seq_len: int,
    errors: list[tuple[int, int] | None] | None = None,
    penalty: float = 0.0,
) -> list[Row]:
    """A row for each of the rollout's turns that fits `seq_len`, each token with its
    advantage: the episode's (None: its group was dropped), placed by the turn's first false
    step where `errors` (`false_steps`) has one. A turn with neither teaches nothing and
    makes no row."""
    rows = []
    for i, turn in enumerate(rollout.turns):
        n, error = len(turn.completion_ids), errors[i] if errors else None
        if not n or len(turn.prompt_ids) + n - 1 > seq_len or (advantage is None and not error):
            continue
        advantages = located_advantages(advantage or 0.0, n, error, penalty)
        logprobs = None if rollout.off_policy else turn.logprobs
        rows.append((turn.prompt_ids, turn.completion_ids, logprobs, advantages))
    return rows


def collate(rows: list[Row], pad_id: int) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' batch, and aligned with its labels (0 elsewhere): the sampling
    log-probabilities, the advantages, and where the tokens are a reference answer's."""
    batch = completion_batch([(prompt, completion) for prompt, completion, _, _ in rows], pad_id)
    old, advantages = torch.zeros(batch.labels.shape), torch.zeros(batch.labels.shape)
    off_policy = torch.zeros(batch.labels.shape, dtype=torch.bool)
    for b, (prompt, completion, logprobs, adv) in enumerate(rows):
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
        if logprobs is None:
            off_policy[b, span] = True
        else:
            old[b, span] = torch.tensor(logprobs)
        advantages[b, span] = torch.tensor(adv)
    return batch, old, advantages, off_policy


def micro_batch_rows(rows: list[Row], n: int, pad_id: int) -> list[list[Row]]:
    """Exactly `n` micro-batches (DeepSpeed steps at that boundary); one without rows is a
    padding token with no label, a zero loss. Rows of like length go together, so a
    micro-batch pads little: answers run from a few tokens to `max_tokens`, and the step's
    loss is a sum over all its rows whatever the split."""
    rows = sorted(rows, key=lambda row: len(row[0]) + len(row[1]))
    size = max(1, -(-len(rows) // n))
    return [rows[m * size : (m + 1) * size] or [([pad_id] * 2, [], [], [])] for m in range(n)]


class RLTrainer(Trainer):
    def __init__(
        self,
        config: RLStage,
        tokenizer: Tokenizer,
        pad_id: int,
        out_dir: Path,
        evaluate: EvalFn | None = None,
    ) -> None:
        """Trains `config.init`; with a KL term (or `track_kl`), against a frozen copy of it."""
        self.config, self.tokenizer, self.pad_id = config, tokenizer, pad_id
        tracked = config.rl.kl_coef > 0 or config.rl.track_kl
        # The reference computes as the trainer does (FP4 widened), so its KL starts at 0.
        self.reference = load_checkpoint(config.init, keep_fp4=False).eval() if tracked else None
        model = trainable_policy(config.init)
        qat = config.qat
        if qat.format is not None:  # the reference too, so the KL starts at 0 again
            enable_qat(model, qat.format, qat.all_linear)
            if self.reference is not None:
                enable_qat(self.reference, qat.format, qat.all_linear)
        self.weights = DomainWeights(
            dict(config.data.mix), fixed=config.rl.domain_weighting == "fixed"
        )
        self.step_stats: dict[str, float] = {}
        self.learned_stats: dict[str, float] = {}
        super().__init__(model, config.train, None, out_dir, rl_loss(config), evaluate, "rl")
        rm = config.rl.reward_model
        self.reward_model = load_reward_model(Path(rm)).to(self.device) if rm else None

    def state(self, step: int) -> dict[str, Any]:
        return super().state(step) | {"fast": self.weights.fast, "slow": self.weights.slow}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.weights.fast, self.weights.slow = state["fast"], state["slow"]

    def tasks(self, step: int) -> list[Task]:
        return step_tasks(self.config, step, self.rank, self.world, self.weights.weights())

    def micro_batches(self, step: int) -> list[Batch]:
        rl = self.config.rl
        engine = inference_copy(
            self.model, self.tokenizer, EngineConfig(max_num_seqs=64, kv_cache_bytes=64 << 20)
        )
        groups = play(
            engine, DOMAINS, self.tasks(step), rl.group_size, rl.max_tokens, self.cfg.seed,
            rl.max_turns, rl.temperature,
        )  # fmt: skip
        del engine
        if rl.reference_style is not None:
            for group in groups:
                reference = reference_rollout(
                    self.tokenizer, group[0].task, rl.reference_style, len(group)
                )
                if reference.reward >= 1.0:  # a reference the verifier fails teaches nothing
                    group.append(reference)
        learned = self._learned_rewards(groups)
        rows: list[Row] = []
        stats: dict[str, list[float]] = {}
        kept = flat = guided = 0
        advantages: list[float] = []
        for g, group in enumerate(groups):
            domain = group[0].task.domain
            sampled = [r for r in group if not r.off_policy]
            for r in sampled:
                stats.setdefault(f"reward/{domain}", []).append(r.reward)
                stats.setdefault(f"success/{domain}", []).append(float(r.reward >= 1.0))
                stats.setdefault(f"length/{domain}", []).append(r.num_completion_tokens)
                # The sampled tokens' mean surprisal: an unbiased estimate of the policy's
                # entropy at temperature 1.
                stats.setdefault(f"entropy/{domain}", []).extend(
                    -lp for t in r.turns for lp in t.logprobs
                )
            # Where each answer first went wrong, in domains that can check their working:
            # logged always, and with `step_penalty` where its advantage goes.
            checked = DOMAINS[domain].checks_working
            errors = [
                false_steps(r, self.tokenizer) if checked and not r.off_policy else None
                for r in group
            ]
            if checked:
                stats.setdefault(f"false_step/{domain}", []).extend(
                    float(any(e)) for r, e in zip(group, errors, strict=True) if not r.off_policy
                )
            flat += not informative([r.reward for r in sampled])
            # Groups where only the reference answer succeeded: what guidance adds.
            guided += len(sampled) < len(group) and max(r.reward for r in sampled) < max(
                r.reward for r in group
            )
            group_adv = episode_advantages(group, rl, learned[g] if learned else None)
            if group_adv is not None:
                kept += 1
                advantages += group_adv
            elif rl.step_penalty == 0:
                continue
            for i, r in enumerate(group):
                adv = group_adv[i] if group_adv is not None else None
                placed = errors[i] if rl.step_penalty > 0 else None
                rows += turn_rows(r, adv, self.cfg.seq_len, placed, rl.step_penalty)
        for key, values in stats.items():
            if key.startswith("success/"):
                self.weights.update(key.split("/")[1], sum(values) / len(values))
        self.step_stats = {k: sum(v) / len(v) for k, v in stats.items() if v}
        self.step_stats |= self.learned_stats
        self.step_stats |= {f"weight/{d}": w for d, w in self.weights.weights().items()}
        self.step_stats["groups_kept"] = kept / len(groups)
        # Groups whose verdicts were all alike: no signal of correctness, kept or not.
        self.step_stats["zero_variance_groups"] = flat / len(groups)
        if rl.reference_style is not None:
            self.step_stats["guided_groups"] = guided / len(groups)
        self.step_stats["adv_std"] = float(torch.tensor(advantages or [0.0]).std(unbiased=False))
        return self._split(rows)

    def _learned_rewards(self, groups: list[list[Rollout]]) -> list[list[float]] | None:
        """The reward model's merged reward of each episode, by group (logged per domain)."""
        if self.reward_model is None:
            return None
        flat = [r for group in groups for r in group]
        scores = merged_rewards(
            self.reward_model, flat, self.config.rl.reward_model_weights, self.pad_id
        )
        by_domain: dict[str, list[float]] = {}
        for r, score in zip(flat, scores, strict=True):
            by_domain.setdefault(r.task.domain, []).append(score)
        self.learned_stats = {f"learned/{d}": sum(v) / len(v) for d, v in by_domain.items()}
        size = len(groups[0])
        return [scores[i : i + size] for i in range(0, len(scores), size)]

    def _split(self, rows: list[Row]) -> list[Batch]:
        out = []
        for part in micro_batch_rows(rows, self.cfg.grad_accum, self.pad_id):
            batch, old, adv, off_policy = collate(part, self.pad_id)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = label_logprobs(self.reference, batch)[0]
            out.append(RLBatch(batch, old, ref, adv, off_policy if off_policy.any() else None))
        return out

    def train_step(self, step: int) -> dict[str, float]:
        row = super().train_step(step)
        return row | self.step_stats


def rl(config: RLStage, out_dir: Path) -> Path:
    """GRPO on the verifiers' rewards, into `out_dir`; returns the exported model directory."""
    return post_train(config, out_dir, RLTrainer, config.qat)
