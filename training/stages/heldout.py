"""Held-out evaluation during training: the stages that train a tier's policy (SFT, DPO, RL)
score it every `eval_every` steps and at the end through the eval harness and our engine,
so a run's curves show what users would get, not only its loss."""

import asyncio
from pathlib import Path

import torch

from serving.model.families import LanguageModel
from tasks import harness
from training.config import TrainConfig
from training.data.datasets import SFTDataset
from training.objectives.losses import hidden_states, token_losses
from training.reports.evaluation import evaluate_checkpoint
from training.stages.outputs import export
from training.stages.trainer import EvalFn


def heldout_copy_loss(model: LanguageModel, heldout: SFTDataset) -> float:
    """Mean cross-entropy at copy positions of SFT examples the run does not train on."""
    total = count = 0.0
    with torch.inference_mode():
        for start in range(0, len(heldout), 8):
            batch = heldout.collate(list(range(start, min(start + 8, len(heldout)))))
            hidden = hidden_states(model, batch)
            ce = token_losses(model.compute_logits(hidden), batch.labels)
            assert batch.copy_mask is not None  # an SFT batch
            total += float(ce[batch.copy_mask].sum())
            count += float(batch.copy_mask.sum())
    return total / max(count, 1.0)


def harness_eval(
    out_dir: Path,
    tokenizer_dir: Path,
    cfg: TrainConfig,
    domains: list[str],
    heldout: SFTDataset | None = None,
) -> EvalFn:
    """Held-out completion rate per domain through the eval harness (tasks) and our
    engine, with the markdown table written to `OUT/eval-step-N.md`; with `heldout`, the
    copy-position loss on it too (`copy_loss`)."""

    def evaluate(model: LanguageModel, step: int) -> dict[str, float]:
        copy = {} if heldout is None else {"copy_loss": heldout_copy_loss(model, heldout)}
        snapshot = export(model, out_dir / "eval-model", tokenizer_dir, torch.float32)
        records = asyncio.run(
            evaluate_checkpoint(
                str(snapshot),
                domains,
                cfg.eval_difficulties,
                cfg.eval_n,
                0,
                8,
                max_tokens=cfg.eval_max_tokens,
            )
        )
        rows = harness.summarize(records)
        table = harness.format_table(rows)
        if copy:
            table += f"\n\nheld-out copy-position loss: {copy['copy_loss']:.3f}"
        (out_dir / f"eval-step-{step + 1}.md").write_text(table + "\n")
        print(f"\nheld-out eval at step {step + 1}:\n{table}", flush=True)
        rates = {r["domain"]: r["completion_rate"] for r in rows if r["difficulty"] == "all"}
        return rates | copy

    return evaluate
