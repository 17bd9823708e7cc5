"""The `mtp` stage: a target's MTP head trained alone, on what the target itself writes.

Serving drafts with the MTP head to guess the target's next tokens, so the head should learn
the target's own greedy continuations (`draft_data = "target"`), not reference traces the
target drifts from. Everything but the head stays frozen and is exported byte for byte as
`init` holds it: for an FP4 target (the highspeed tier) only the head's weights are
quantized again, so its served main model is exactly the one evaluated before.
"""

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from serving.model import quantization
from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import (
    MTP_PREFIX,
    load_checkpoint,
    read_safetensors,
    write_safetensors,
)
from serving.model.hf_state_dict import to_hf_state_dict
from serving.model.tokenizer import Tokenizer
from training.config import ConfigError, FromCheckpoint
from training.data.datasets import IGNORE, Batch, SFTDataset
from training.objectives.losses import LossFn, LossParts, shift_labels, token_loss_sum
from training.stages.outputs import begin, finish, pad_id
from training.stages.sft import sft_data
from training.stages.trainer import Trainer


class MTPStage(FromCheckpoint):
    """`init` is the target whose head is trained."""

    stage: Literal["mtp"] = "mtp"
    draft_data: Literal["reference", "target"] = "reference"
    # the drafts a step chains the head for when serving (`num_speculative_tokens`), each
    # depth trained; the first of them alone is what a one-layer head was trained for
    mtp_depths: int = Field(1, ge=1)


def load_for_mtp(init: str) -> CausalLM:
    """`init` in fp32 (FP4 weights dequantized), only its MTP parameters trainable."""
    model = load_checkpoint(init, keep_fp4=False)  # trainable: plain parameters
    if not len(model.mtp):
        raise ConfigError(f"{init} has no MTP head (`tierserve_mtp` in its config.json)")
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith(MTP_PREFIX)
    return model


def mtp_loss(depths: int) -> LossFn:
    """Cross-entropy at `depths` MTP depths, summed, of the target tokens each predicts (depth
    d at t: token t + d + 1), over the frozen model's hidden states; depths past the head's
    layers chain its last one, as serving drafts. Logged per depth with its top-1 accuracy,
    about the share of d-th drafts greedy verification accepts once the earlier ones were."""

    def loss(model: CausalLM, batch: Batch) -> LossParts:
        with torch.no_grad():
            hidden = model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
        depth_logits = model.mtp_logits(
            hidden, batch.input_ids, batch.positions, batch.padding_mask, depths
        )
        sums, metrics = [], {}
        for depth, logits in enumerate(depth_logits, start=1):
            labels = shift_labels(batch.labels, depth)
            sums.append(token_loss_sum(logits, labels))
            targets = labels != IGNORE
            right = (logits.argmax(-1) == labels) & targets
            metrics[f"mtp_top1/{depth}"] = float(right.sum()) / max(1, int(targets.sum()))
        total = torch.stack(sums).sum()
        return LossParts(total, sums[0], torch.zeros(()), metrics)

    return loss


def export_mtp(model: CausalLM, init: str, out: Path) -> Path:
    """`init`'s directory with the trained head's tensors in place of its own, stored as
    `init` stores them (FP4 where its quantization targets them, else in its dtype)."""
    init_dir = Path(init)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(init_dir, out)
    tensors = read_safetensors(init_dir)
    head = {k: v for k, v in to_hf_state_dict(model).items() if k.startswith(MTP_PREFIX)}
    raw = json.loads((init_dir / "config.json").read_text())
    q = raw.get("quantization_config")
    if q is not None:
        fmt, all_linear = quantization.checkpoint_format(q), quantization.checkpoint_all_linear(q)
        head = quantization.quantize_state_dict(head, fmt, all_linear)
    dtype = getattr(torch, raw.get("dtype") or "float32")
    head = {k: v if ".weight_" in k else v.detach().to(dtype) for k, v in head.items()}
    if set(head) != {k for k in tensors if k.startswith(MTP_PREFIX)}:
        raise ConfigError(f"the trained MTP head's tensors do not match {init}'s")
    write_safetensors(out, tensors | head)
    return out


def train_mtp(config: MTPStage, out_dir: Path) -> Path:
    """Train `init`'s MTP head alone into `out_dir`; returns `init` with the new head."""
    out_dir = begin(config, out_dir)
    tokenizer = Tokenizer.from_dir(config.init)
    path = sft_data(config, tokenizer, out_dir, distil=False, draft_data=config.draft_data)
    trainer = Trainer(
        load_for_mtp(config.init),
        config.train,
        SFTDataset(path, pad_id(tokenizer)),
        out_dir,
        mtp_loss(config.mtp_depths),
        None,
        desc="mtp",
    )
    return finish(trainer, config, out_dir, lambda m, final: export_mtp(m, config.init, final))
