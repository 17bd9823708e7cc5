"""What every stage does around its training loop: a run directory that records its config,
data built once by rank 0, the model exported as a Hugging Face directory, a summary.

Rerunning a stage's command with the same `--out` resumes it: the data files are kept, the
trainer restarts from its last checkpoint (`checkpointing.py`).
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from serving.model import families
from serving.model.checkpoint import quantize_checkpoint
from serving.model.families import LanguageModel
from serving.model.hybrid.config import is_hybrid_config
from serving.model.tokenizer import Tokenizer
from training.config import ConfigError, QATConfig, StageBase
from training.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from training.stages.qat import disable_qat, served_state_dict
from training.stages.trainer import Trainer, init_distributed


def begin(config: StageBase, out_dir: Path) -> Path:
    """Join the process group and write the stage's resolved config beside its outputs."""
    init_distributed()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stage.json").write_text(config.model_dump_json(indent=2) + "\n")
    return out_dir


def build_once(path: Path, build: Callable[[], object]) -> Path:
    """Rank 0 builds the data file if it is not there yet; the others wait for it."""
    if dist.get_rank() == 0 and not path.exists():
        build()
    dist.barrier()
    return path


def pad_id(tokenizer: Tokenizer) -> int:
    return tokenizer.raw.token_to_id(PAD_TOKEN)


def new_model(shape: dict, tokenizer: Tokenizer, mtp: bool, seed: int) -> LanguageModel:
    """A model of `shape` (config.json fields, either family) with random weights, sized to
    `tokenizer`; `mtp` adds an MTP layer, which only the MoE family has."""
    raw = dict(shape)
    raw["vocab_size"] = tokenizer.vocab_size
    raw["eos_token_id"] = tokenizer.raw.token_to_id(EOS_TOKEN)
    raw["pad_token_id"] = pad_id(tokenizer)
    if mtp and is_hybrid_config(raw):
        raise ConfigError("the hybrid family has no MTP layers: set train.mtp_weight = 0")
    if mtp:
        raw["tierserve_mtp"] = {"num_layers": 1}
    torch.manual_seed(seed)
    return families.new_model(raw)


def export(model: LanguageModel, out: Path, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    """A standalone Hugging Face directory of `model` in `dtype` (DeepSpeed's module may hold
    its parameters in another dtype and carry hooks, so the weights are copied out)."""
    fresh = type(model)(model.config)
    state = {k: v.detach().to(dtype).clone() for k, v in served_state_dict(model).items()}
    fresh.load_state_dict(state)
    fresh.to(dtype)
    families.save_model(fresh, out, tokenizer_dir)  # generation_config from the model's config
    return out


def bf16_export(tokenizer_dir: Path) -> Callable[[LanguageModel, Path], Path]:
    """The `write` of `finish` for the stages whose model ships in bf16 as trained."""
    return lambda model, final: export(model, final, tokenizer_dir, torch.bfloat16)


def trained_export(
    qat: QATConfig, tokenizer_dir: Path, out_dir: Path
) -> Callable[[LanguageModel, Path], object]:
    """The `write` of `finish` for a stage that may train through FP4 weights: in bf16 as
    trained, or under `[qat]` the FP4 checkpoint `tierserve quantize` makes of the latent
    weights, which rounds them exactly as training saw them."""
    if qat.format is None:
        return bf16_export(tokenizer_dir)
    fmt = qat.format

    def write(model: LanguageModel, final: Path) -> None:
        disable_qat(model)
        latent = export(model, out_dir / "model-latent", tokenizer_dir, torch.float32)
        shutil.rmtree(final, ignore_errors=True)
        quantize_checkpoint(latent, final, fmt, qat.all_linear, torch.bfloat16)
        shutil.rmtree(latent)

    return write


def finish(
    trainer: Trainer,
    config: StageBase,
    out_dir: Path,
    write: Callable[[LanguageModel, Path], object],
) -> Path:
    """Train to the end, then rank 0 writes the model with `write` and the summary."""
    model = trainer.fit()
    final = out_dir / "model"
    if dist.get_rank() == 0:
        write(model, final)
        summary = {
            "stage": trainer.desc,
            "style": getattr(config, "style", None),
            "log_tail": trainer.log[-1],
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    dist.barrier()
    return final
