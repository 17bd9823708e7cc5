"""The reward-model stage: a reward per objective, learned from the `init` model's own
answers (training/objectives/reward_model.py).

The `init` policy plays each training task `samples` times (whole episodes: terminal and tool
tasks run their turns in the sandbox). A judge per objective scores every episode in [0, 1]:
- correctness, in every domain: the verifier's reward (for terminal tasks, the final state);
- chain, in math: the share of the worked steps written in order (`tasks.math.chain_coverage`);
- maintainability, in code: the program's lint (`code_quality`: dead code, unused names);
- steps, in terminal: the share of turns that ran a valid command.
Two answers to one task whose scores on an objective differ by at least `margin` make a pair
for that objective's head; each task gives at most `pairs_per_task` per objective. Held-out
tasks give pairs the same way, and each head's accuracy on them (the share of pairs whose
better answer it rewards more) is reported before and after training (`OUT/accuracy.md`),
with the merged reward's, on pairs the judges' weighted sum ranks. The model ships in
transformers' sequence-classification layout (`OUT/model`).
"""

import json
import random
from pathlib import Path
from typing import Any, Literal

import torch

from serving.engine.llm_engine import EngineConfig
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tasks import DOMAINS
from tasks.answers import extract_program, split_reasoning
from tasks.math import chain_coverage
from tasks.seeds import eval_seed, train_seed
from training.config import (
    DataConfig,
    FromCheckpoint,
    OptimConfig,
    RewardModelConfig,
    TrainConfig,
)
from training.data.datasets import IGNORE, Batch
from training.objectives.losses import LossParts
from training.objectives.preference import code_quality, combined_score
from training.objectives.reward_model import (
    RewardModel,
    bradley_terry_losses,
    merged_reward,
    save_reward_model,
)
from training.stages.outputs import begin, build_once, finish, pad_id
from training.stages.rollouts import Rollout, inference_copy, mixed_tasks, play
from training.stages.trainer import Trainer

OBJECTIVES = ["correctness", "chain", "maintainability", "steps"]
MERGED = "merged"
SHAPING = {"math": "chain", "code": "maintainability", "terminal": "steps"}  # beside correctness


class RewardModelStage(FromCheckpoint):
    """`init` plays the tasks whose answers are ranked, and its decoder starts the model."""

    stage: Literal["reward-model"] = "reward-model"
    reward_model: RewardModelConfig = RewardModelConfig()
    # A fine-tune of a trained decoder: a few hundred tasks' answers, a small learning rate.
    data: DataConfig = DataConfig(examples=256)
    train: TrainConfig = TrainConfig(steps=200, optim=OptimConfig(lr=3e-5, warmup_steps=10))


def judged_weights(domain: str, weights: dict[str, float]) -> dict[str, float]:
    """The merged reward's weights for an answer in `domain`: its own objectives only (a head
    reads any answer, but only its domain's answers taught it)."""
    own = {"correctness", SHAPING.get(domain)}
    return {name: w for name, w in weights.items() if name in own}


def judge(rollout: Rollout) -> dict[str, float]:
    """Each objective the rollout's domain is judged on, in [0, 1]."""
    scores = {"correctness": rollout.reward}
    text = rollout.turns[-1].text if rollout.turns else ""
    domain = rollout.task.domain
    if domain == "math":
        scores["chain"] = chain_coverage(rollout.task, text)
    elif domain == "code":
        scores["maintainability"] = code_quality(extract_program(split_reasoning(text)[1]))
    elif domain == "terminal":
        steps = rollout.metrics.get("steps", 0.0)
        valid = steps - rollout.metrics.get("invalid_ops", 0.0)
        scores["steps"] = valid / steps if steps else 0.0
    return scores


def episode_ids(rollout: Rollout) -> list[int]:
    """The whole conversation as the chat template renders it: the last turn's prompt holds
    every turn before it."""
    last = rollout.turns[-1]
    return last.prompt_ids + last.completion_ids


def ranked_pairs(
    group: list[Rollout], names: list[str], cfg: RewardModelConfig, seed: str
) -> list[dict[str, Any]]:
    """Up to `pairs_per_task` (better, worse) pairs of one task's answers for each objective
    in `names` that its domain is judged on (`merged`: ranked by the judges' weighted sum)."""
    played = [(r, judge(r)) for r in group if r.turns]
    rows = []
    for name in names:
        scored = [
            (combined_score(s, cfg.weights) if name == MERGED else s[name], r)
            for r, s in played
            if name == MERGED or name in s
        ]
        pairs = [(hi, lo) for a, hi in scored for b, lo in scored if a - b >= cfg.margin]
        rng = random.Random(f"{seed}:{name}")
        for better, worse in rng.sample(pairs, min(len(pairs), cfg.pairs_per_task)):
            rows.append({
                "objective": name, "domain": better.task.domain,
                "chosen": episode_ids(better), "rejected": episode_ids(worse),
            })  # fmt: skip
    return rows


def build_pairs(
    config: RewardModelStage, tokenizer: Tokenizer, seeds: list[int], names: list[str], path: Path
) -> None:
    """Play a task per seed with `init`, judge the episodes and store their pairs."""
    cfg = config.reward_model
    policy = load_checkpoint(config.init, keep_fp4=False)
    engine = inference_copy(policy, tokenizer, EngineConfig(max_num_seqs=64))
    tasks = mixed_tasks(config.data, seeds)
    print(f"{path.name}: {len(tasks)} tasks x {cfg.samples} answers by {config.init}", flush=True)
    groups = play(
        engine, DOMAINS, tasks, cfg.samples, cfg.max_tokens, config.train.seed, cfg.max_turns,
        cfg.temperature,
    )  # fmt: skip
    rows = []
    for task, group in zip(tasks, groups, strict=True):
        rows += ranked_pairs(group, names, cfg, f"{task.domain}:{task.seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{path.name}: {len(rows)} pairs", flush=True)


class PairRows(Batch):
    """The chosen episodes (first half of the rows) and the rejected ones, whole and
    right-padded, and the objective whose head ranks each pair."""

    def __init__(
        self, input_ids: torch.Tensor, padding_mask: torch.Tensor, objective: torch.Tensor
    ):
        super().__init__(input_ids, torch.full_like(input_ids, IGNORE), padding_mask)
        self.objective = objective

    @property
    def num_targets(self) -> int:
        """The loss is a mean over pairs: the trainer normalises by this."""
        return len(self.objective)


class RewardPairs:
    def __init__(self, path: Path, pad_id: int) -> None:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        self.rows = [r for r in rows if r["objective"] in OBJECTIVES]
        if not self.rows:
            raise ValueError(f"{path}: no pairs (every task's answers tied on every objective)")
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def length(self, index: int) -> int:
        return max(len(self.rows[index]["chosen"]), len(self.rows[index]["rejected"]))

    def collate(self, indices: list[int]) -> PairRows:
        rows = [self.rows[i] for i in indices]
        input_ids, mask = padded(
            [r["chosen"] for r in rows] + [r["rejected"] for r in rows], self.pad_id
        )
        objective = torch.tensor([OBJECTIVES.index(r["objective"]) for r in rows])
        return PairRows(input_ids, mask, objective)


def padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences right-padded to the longest, and the mask of their real tokens."""
    input_ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for b, ids in enumerate(seqs):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        mask[b, : len(ids)] = True
    return input_ids, mask


def reward_loss(model: RewardModel, batch: PairRows) -> LossParts:
    n = len(batch.objective)
    rewards = model(batch.input_ids, batch.padding_mask)
    picked = rewards.gather(1, batch.objective.repeat(2)[:, None])[:, 0]
    margin = (picked[:n] - picked[n:]).detach()
    metrics = {"accuracy": (margin > 0).float().mean().item(), "margin": margin.mean().item()}
    zero = torch.zeros(())
    return LossParts(bradley_terry_losses(picked[:n], picked[n:]).sum(), zero, zero, metrics)


def scored(model: RewardModel, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    """The rewards [len(seqs), objectives] of token sequences, scored on the device the model
    is on (the policy's, in RL) and returned on the CPU."""
    device = next(model.parameters()).device
    ids, mask = padded(seqs, pad_id)
    return model(ids.to(device), mask.to(device)).cpu()


@torch.no_grad()
def merged_rewards(
    model: RewardModel, rollouts: list[Rollout], weights: dict[str, float], pad_id: int
) -> list[float]:
    """Each episode's merged reward over its own domain's objectives (0 for an episode with
    no turn)."""
    out = []
    for start in range(0, len(rollouts), 16):
        part = rollouts[start : start + 16]
        played = [r for r in part if r.turns]
        rewards = scored(model, [episode_ids(r) for r in played], pad_id) if played else None
        k = 0
        for r in part:
            if not r.turns:
                out.append(0.0)
                continue
            own = judged_weights(r.task.domain, weights)
            out.append(float(merged_reward(rewards[k : k + 1], model.objectives, own)[0]))
            k += 1
    return out


@torch.no_grad()
def accuracy_table(model: RewardModel, path: Path, pad_id: int, weights: dict[str, float]) -> str:
    """Per objective and domain, the share of held-out pairs whose better answer gets the
    higher reward (a head, or the merged reward for `merged`), beside the shares a longer and
    a shorter answer win: what a reward that only counted tokens would score."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    results: dict[tuple[str, str], list[tuple[bool, bool, bool]]] = {}
    for start in range(0, len(rows), 16):
        part = rows[start : start + 16]
        rewards = scored(model, [r["chosen"] for r in part] + [r["rejected"] for r in part], pad_id)
        for k, row in enumerate(part):
            name, other = row["objective"], k + len(part)
            if name == MERGED:
                own = judged_weights(row["domain"], weights)
                chosen, rejected = merged_reward(rewards[[k, other]], model.objectives, own)
            else:
                head = model.objectives.index(name)
                chosen, rejected = rewards[k, head], rewards[other, head]
            sizes = len(row["chosen"]), len(row["rejected"])
            hit = (bool(chosen > rejected), sizes[0] > sizes[1], sizes[0] < sizes[1])
            for domain in (row["domain"], "all"):
                results.setdefault((name, domain), []).append(hit)
    lines = [
        "| objective | domain | pairs | accuracy % | longer answer wins % | shorter wins % |",
        "|---|---|---|---|---|---|",
    ]
    for name in [*OBJECTIVES, MERGED]:
        for domain in sorted({d for n, d in results if n == name}, key=lambda d: d == "all"):
            hits = results[(name, domain)]
            shares = [100 * sum(column) / len(hits) for column in zip(*hits, strict=True)]
            cells = " | ".join(f"{share:.1f}" for share in shares)
            lines.append(f"| {name} | {domain} | {len(hits)} | {cells} |")
    return "\n".join(lines)


def reward_model(config: RewardModelStage, out_dir: Path) -> Path:
    """Train the reward heads on `init`'s ranked answers, into `out_dir`; returns the model
    directory."""
    out_dir = begin(config, out_dir)
    tok_dir = Path(config.init)
    tokenizer = Tokenizer.from_dir(tok_dir)
    pad, cfg = pad_id(tokenizer), config.reward_model
    seeds = [train_seed(config.data.seed + i) for i in range(config.data.examples)]
    train_path = out_dir / "data" / "pairs.jsonl"
    build_once(train_path, lambda: build_pairs(config, tokenizer, seeds, OBJECTIVES, train_path))
    held = [eval_seed(0, i) for i in range(cfg.eval_tasks)]
    heldout_path = out_dir / "data" / "heldout-pairs.jsonl"
    names = [*OBJECTIVES, MERGED]
    build_once(heldout_path, lambda: build_pairs(config, tokenizer, held, names, heldout_path))
    torch.manual_seed(config.train.seed)  # the heads' initial weights
    model = RewardModel(load_checkpoint(config.init, keep_fp4=False), OBJECTIVES)
    run = Trainer(
        model,
        config.train,
        RewardPairs(train_path, pad),
        out_dir,
        reward_loss,
        None,
        "reward-model",
    )

    def write(trained: RewardModel, final: Path) -> None:
        save_reward_model(trained, final, tok_dir)
        table = accuracy_table(trained, heldout_path, pad, cfg.weights)
        (out_dir / "accuracy.md").write_text(table + "\n")
        print(f"\nreward accuracy on held-out pairs:\n{table}", flush=True)

    return finish(run, config, out_dir, write)
