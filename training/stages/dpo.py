"""The DPO stage: preference pairs drawn from the starting model's own samples, scored on
several objectives, then DPO against that model frozen (training/objectives/preference.py).

For each training task the `init` model samples several answers (first turns, through our
engine). Each is scored on its own: correctness (the domain's verifier), format (the chat
markup is well formed for the style: reasoning where it belongs, tool calls that parse),
brevity in tokens, and for code the quality of its program. The weighted sum picks a pair
per task. The pairs and the reference's log-probabilities are computed once and stored with
the run (`OUT/data/pairs.jsonl`), so a resumed run trains on the same pairs. At the end, the
stage samples held-out tasks from the model before and after and reports each objective's
win rate (`OUT/win-rates.md`).
"""

import json
from pathlib import Path
from typing import Any, Literal

import torch

from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tasks import DOMAINS, Task
from tasks.answers import (
    CALL_START,
    THINK_END,
    THINK_START,
    extract_program,
    parse_tool_calls,
    split_reasoning,
)
from tasks.seeds import eval_seed, train_seed
from training.config import DPOConfig, FromCheckpoint
from training.data.datasets import IGNORE, Batch, completion_batch
from training.objectives.losses import LossParts
from training.objectives.preference import (
    OBJECTIVES,
    Scored,
    brevity,
    code_quality,
    combined_score,
    completion_logprobs,
    dpo_loss,
    preference_pair,
)
from training.stages.policy import post_train, trainable_policy
from training.stages.rollouts import Rollout, inference_copy, mixed_tasks, play
from training.stages.trainer import EvalFn, Trainer


class DPOStage(FromCheckpoint):
    """`init` is the policy trained and, frozen, the reference of the DPO loss."""

    stage: Literal["dpo"] = "dpo"
    dpo: DPOConfig = DPOConfig()


def objective_scores(rollout: Rollout, style: str, max_tokens: int) -> dict[str, float]:
    """Each objective of the rollout's first answer, in [0, 1]."""
    turn = rollout.turns[0]
    reasoning, content = split_reasoning(turn.text)
    reasons = DOMAINS[rollout.task.domain].reasons(style)
    well_formed = (reasoning is not None) == reasons and not any(
        tag in content for tag in (THINK_START, THINK_END)
    )
    if CALL_START in content:
        well_formed = well_formed and bool(parse_tool_calls(content)[1])
    scores = {
        "correctness": rollout.reward,
        "format": float(well_formed),
        "brevity": brevity(len(turn.completion_ids), max_tokens),
    }
    if rollout.task.domain == "code":
        scores["quality"] = code_quality(extract_program(content))
    return scores


def _sample(
    engine: LLMEngine,
    tasks: list[Task],
    n: int,
    max_tokens: int,
    seed: int,
    style: str,
    temperature: float = 1.0,
) -> list[list[tuple[Rollout, dict[str, float]]]]:
    groups = play(engine, DOMAINS, tasks, n, max_tokens, seed, 1, temperature)
    return [
        [(r, objective_scores(r, style, max_tokens)) for r in group if r.turns] for group in groups
    ]


def build_pairs(config: DPOStage, tokenizer: Tokenizer, path: Path) -> None:
    """Sample, score and pair; store each pair's token ids and the reference's
    log-probabilities of both answers."""
    dpo = config.dpo
    reference = load_checkpoint(config.init, keep_fp4=False).eval()  # as the trainer computes
    engine = inference_copy(reference, tokenizer, EngineConfig(max_num_seqs=64))
    seeds = [train_seed(config.data.seed + i) for i in range(config.data.examples)]
    groups = _sample(
        engine,
        mixed_tasks(config.data, seeds),
        dpo.samples,
        dpo.max_tokens,
        config.train.seed,
        config.style,
    )
    lines = []
    for group in groups:
        pair = preference_pair(
            [Scored(r.turns[0].completion_ids, s) for r, s in group], dpo.weights, dpo.margin
        )
        if pair is None:
            continue
        prompt = group[0][0].turns[0].prompt_ids
        chosen, rejected = pair
        refs = [_sequence_logprob(reference, prompt, s.completion_ids) for s in pair]
        lines.append(json.dumps({
            "prompt": prompt, "chosen": chosen.completion_ids, "rejected": rejected.completion_ids,
            "ref_chosen": refs[0], "ref_rejected": refs[1],
        }))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


@torch.no_grad()
def _sequence_logprob(model: CausalLM, prompt: list[int], completion: list[int]) -> float:
    batch = completion_batch([(prompt, completion)], 0)
    logits = model.compute_logits(model(batch.input_ids, batch.positions))
    return completion_logprobs(logits, batch.labels, IGNORE)[0].item()


class PairBatch(Batch):
    """The chosen answers (first half of the rows) and the rejected ones (second half)."""

    def __init__(self, batch: Batch, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor):
        super().__init__(batch.input_ids, batch.labels, batch.padding_mask)
        self.ref_chosen, self.ref_rejected = ref_chosen, ref_rejected

    @property
    def num_targets(self) -> int:
        """DPO's loss is a mean over pairs, not tokens: the trainer normalises by this."""
        return len(self.ref_chosen)


class PairDataset:
    def __init__(self, path: Path, pad_id: int) -> None:
        self.rows = [json.loads(line) for line in path.read_text().splitlines()]
        if not self.rows:
            raise ValueError(f"{path}: no preference pairs (every task's samples tied)")
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def length(self, index: int) -> int:
        row = self.rows[index]
        return len(row["prompt"]) + max(len(row["chosen"]), len(row["rejected"]))

    def collate(self, indices: list[int]) -> PairBatch:
        rows = [self.rows[i] for i in indices]
        pairs = [(r["prompt"], r["chosen"]) for r in rows] + [
            (r["prompt"], r["rejected"]) for r in rows
        ]
        return PairBatch(
            completion_batch(pairs, self.pad_id),
            torch.tensor([r["ref_chosen"] for r in rows]),
            torch.tensor([r["ref_rejected"] for r in rows]),
        )


def dpo_objective(config: DPOStage) -> Any:
    dpo = config.dpo

    def loss(model: CausalLM, batch: PairBatch) -> LossParts:
        logits = model.compute_logits(
            model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
        )
        logp, count = completion_logprobs(logits, batch.labels, IGNORE)
        n = len(batch.ref_chosen)
        policy, ref = logp, torch.cat([batch.ref_chosen, batch.ref_rejected])
        if dpo.loss_type == "ipo":  # IPO compares length-averaged log-probabilities
            policy, ref = logp / count, ref / count
        losses, chosen, rejected = dpo_loss(
            policy[:n], policy[n:], ref[:n], ref[n:], dpo.beta, dpo.loss_type
        )
        metrics = {
            "reward_margin": (chosen - rejected).mean().item(),
            "accuracy": (chosen > rejected).float().mean().item(),
        }
        return LossParts(losses.sum(), -logp[:n].detach().sum(), torch.zeros(()), metrics)

    return loss


def win_rates(config: DPOStage, tokenizer: Tokenizer, before: CausalLM, after: CausalLM) -> str:
    """Each objective's mean before and after on held-out tasks (greedy answers, as served by
    default), and how often the trained model's answer beats the starting model's (ties
    count half)."""
    dpo = config.dpo
    tasks = mixed_tasks(config.data, [eval_seed(0, i) for i in range(dpo.eval_tasks)])
    scored = []
    for model in (before, after):
        engine = inference_copy(model, tokenizer, EngineConfig(max_num_seqs=64))
        scored.append(_sample(engine, tasks, 1, dpo.max_tokens, 0, config.style, 0.0))
    lines = ["| objective | before | after | after wins % |", "|---|---|---|---|"]
    for name in (*OBJECTIVES, "combined"):
        pairs = []
        for b, a in zip(*scored, strict=True):
            if b and a and _objective(b[0][1], name, dpo.weights) is not None:
                pairs.append(
                    (_objective(b[0][1], name, dpo.weights), _objective(a[0][1], name, dpo.weights))
                )
        if pairs:
            wins = sum(1.0 if y > x else 0.5 if y == x else 0.0 for x, y in pairs)
            lines.append(
                f"| {name} | {sum(x for x, _ in pairs) / len(pairs):.3f} | "
                f"{sum(y for _, y in pairs) / len(pairs):.3f} | {100 * wins / len(pairs):.0f} |"
            )
    return "\n".join(lines)


def _objective(scores: dict[str, float], name: str, weights: dict[str, float]) -> float | None:
    return combined_score(scores, weights) if name == "combined" else scores.get(name)


class DPOTrainer(Trainer):
    def __init__(
        self,
        config: DPOStage,
        tokenizer: Tokenizer,
        pad_id: int,
        out_dir: Path,
        evaluate: EvalFn | None,
    ) -> None:
        path = out_dir / "data" / "pairs.jsonl"
        if not path.exists():
            build_pairs(config, tokenizer, path)
        self.config, self.tokenizer = config, tokenizer
        model = trainable_policy(config.init)
        super().__init__(
            model,
            config.train,
            PairDataset(path, pad_id),
            out_dir,
            dpo_objective(config),
            evaluate,
            "dpo",
        )

    def fit(self) -> CausalLM:
        model = super().fit()
        if self.rank == 0:
            table = win_rates(self.config, self.tokenizer, load_checkpoint(self.config.init), model)
            (self.out_dir / "win-rates.md").write_text(table + "\n")
            print(f"\nobjective win rates, held-out tasks:\n{table}", flush=True)
        return model


def dpo(config: DPOStage, out_dir: Path) -> Path:
    """DPO on multi-objective pairs from `init`'s own samples, into `out_dir`; returns the
    exported model directory."""
    return post_train(config, out_dir, DPOTrainer)
