"""What a recipe measures of its models: each tier-making stage's held-out tables (JSON with
every task's record, and the Markdown table beside it), and the drafter's agreement with the
model it drafts for."""

import asyncio
import json
import os
import tempfile
from pathlib import Path

import torch

from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tasks import harness
from training.config import DataConfig, EvalSpec
from training.data.datasets import IGNORE, SFTDataset, build_sft
from training.data.tokenizer import PAD_TOKEN
from training.reports.evaluation import evaluate_checkpoint


def evaluate_model(model_dir: Path, spec: EvalSpec, out: Path) -> list[dict]:
    """Play the held-out tasks of `spec` against `model_dir`; `out` (JSON) keeps the report and
    `out` with `.md` its table. A report already there is reused: a resumed recipe does not
    play a finished stage's tasks again."""
    if out.exists():
        return json.loads(out.read_text())["summary"]
    records = asyncio.run(
        evaluate_checkpoint(
            str(model_dir),
            spec.domains,
            spec.difficulties,
            spec.n,
            spec.seed,
            8,
            max_tokens=spec.max_tokens,
        )
    )
    report = harness.report(records)
    out.with_suffix(".md").write_text(harness.format_table(report["summary"]) + "\n")
    partial = out.with_name(f".{out.name}.tmp")
    partial.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(partial, out)  # whole or absent: a cut run never reuses half a report
    return report["summary"]


def mean_completion(rows: list[dict]) -> float:
    overall = [r["completion_rate"] for r in rows if r["difficulty"] == "all"]
    return sum(overall) / len(overall)


def draft_agreement(draft_dir: Path, full_dir: Path, data: DataConfig, seq_len: int) -> float:
    """Share of completion positions where the drafter's greedy next token is the full
    model's, teacher-forced on reference turns of tasks neither model trained on (training
    seeds past the ones the recipe used: the evaluation seed space is reserved for eval)."""
    tokenizer = Tokenizer.from_dir(full_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_sft(data, "think", tokenizer, Path(tmp) / "agreement.jsonl", seq_len)
        dataset = SFTDataset(path, tokenizer.raw.token_to_id(PAD_TOKEN))
    draft, full = load_checkpoint(draft_dir), load_checkpoint(full_dir)
    agree = total = 0
    with torch.inference_mode():
        for start in range(0, len(dataset), 8):
            batch = dataset.collate(list(range(start, min(start + 8, len(dataset)))))
            keep = batch.labels != IGNORE
            guesses = [
                m.compute_logits(
                    m(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
                ).argmax(-1)[keep]
                for m in (draft, full)
            ]
            agree += int((guesses[0] == guesses[1]).sum())
            total += int(keep.sum())
    return agree / total
