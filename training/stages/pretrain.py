"""The `pretrain` stage: the base MoE from random weights on plain documents of the domains
(and copy exercises, `data.copy_docs`), packed into `seq_len` windows, with the MTP loss."""

from pathlib import Path
from typing import Any, Literal

from serving.model.tokenizer import Tokenizer
from training.config import StageBase
from training.data.datasets import PretrainDataset, build_pretrain
from training.objectives.lm_loss import lm_loss
from training.stages.outputs import begin, bf16_export, build_once, finish, new_model
from training.stages.trainer import Trainer


class PretrainStage(StageBase):
    stage: Literal["pretrain"] = "pretrain"
    tokenizer: str  # a directory holding tokenizer.json
    shape: dict[str, Any]  # config.json fields of the model built from scratch


def pretrain(config: PretrainStage, out_dir: Path) -> Path:
    """Train the base model into `out_dir`; returns its exported directory."""
    out_dir = begin(config, out_dir)
    cfg, tok_dir = config.train, Path(config.tokenizer)
    tokenizer = Tokenizer.from_dir(tok_dir)
    tokens = out_dir / "data" / "tokens.npy"
    build_once(tokens, lambda: build_pretrain(config.data, tokenizer, tokens))
    model = new_model(config.shape, tokenizer, cfg.mtp_weight > 0, cfg.seed)
    dataset = PretrainDataset(tokens, cfg.seq_len)
    trainer = Trainer(model, cfg, dataset, out_dir, lm_loss(cfg), None, desc="pretrain")
    return finish(trainer, config, out_dir, bf16_export(tok_dir))
