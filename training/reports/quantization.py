"""How far quantized checkpoints are from their full-precision model: `tierserve eval
quantization`, the PTQ-against-QAT table.

On held-out SFT turns (training seeds past any run's own, in the reference's style), every
candidate is scored against the reference on the completion tokens: the mean KL(reference ||
candidate) of the next-token distributions and the top-1 agreement. Held-out completion comes
from `tierserve eval tasks --model` on each checkpoint, the other half of the table.
"""

import tempfile
from pathlib import Path

import torch

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.config import ModelConfig
from serving.model.tokenizer import Tokenizer
from tasks.base import Style
from training.config import DataConfig
from training.data.datasets import IGNORE, Batch, SFTDataset, build_sft
from training.data.tokenizer import PAD_TOKEN
from training.objectives.losses import distillation_loss_sum

# Seeds of the held-out turns: past every run's training seeds and the curriculum's held-out.
SEED = 3_000_000_000


def _logits(model: CausalLM, batch: Batch) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
        return model.compute_logits(hidden)


def _quantization(model_dir: Path) -> str:
    quant = ModelConfig.from_file(model_dir / "config.json").quantization
    return "-" if quant is None else quant["format"].removesuffix("-pack-quantized")


def _size_mb(model_dir: Path) -> float:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e6


def compare(
    reference: Path, candidates: list[Path], examples: int, style: Style
) -> list[dict[str, float | str]]:
    """One row per candidate: quantization, weight file size, KL and top-1 agreement, and the
    number of tokens they were measured on."""
    tokenizer = Tokenizer.from_dir(reference)
    data = DataConfig(examples=examples, seed=SEED)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_sft(data, style, tokenizer, Path(tmp) / "heldout.jsonl", 1024)
        dataset = SFTDataset(path, tokenizer.raw.token_to_id(PAD_TOKEN))
    batches = [
        dataset.collate(list(range(i, min(i + 8, len(dataset))))) for i in range(0, len(dataset), 8)
    ]
    ref_model = load_checkpoint(reference)
    ref_logits = [_logits(ref_model, b) for b in batches]
    del ref_model
    rows: list[dict[str, float | str]] = []
    for candidate in candidates:
        model = load_checkpoint(candidate)
        kl = agree = count = 0.0
        for batch, ref in zip(batches, ref_logits, strict=True):
            logits = _logits(model, batch)
            keep = batch.labels != IGNORE
            kl += float(distillation_loss_sum(logits, ref, batch.labels, 1.0))
            agree += float((logits.argmax(-1) == ref.argmax(-1))[keep].sum())
            count += float(keep.sum())
        rows.append(
            {
                "model": str(candidate),
                "quantization": _quantization(candidate),
                "weights MB": round(_size_mb(candidate), 1),
                "KL": kl / count,
                "top-1 agreement": agree / count,
                "tokens": count,
            }
        )
    return rows


def format_table(reference: Path, rows: list[dict[str, float | str]]) -> str:
    lines = [
        f"against {reference} on {int(rows[0]['tokens'])} held-out completion tokens",
        "",
        "| model | quantization | weights MB | KL (nats/token) | top-1 agreement |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['quantization']} | {r['weights MB']} | {r['KL']:.4f} "
            f"| {100 * float(r['top-1 agreement']):.1f}% |"
        )
    return "\n".join(lines)
