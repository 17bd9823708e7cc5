"""The frame the post-training stages (DPO, RL) share: the policy is `init`, evaluated on
held-out tasks as it trains, and ships in bf16, or as FP4 when it trained through FP4."""

from collections.abc import Callable
from pathlib import Path

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from training.config import FromCheckpoint, QATConfig
from training.stages.heldout import harness_eval
from training.stages.outputs import begin, finish, pad_id, trained_export
from training.stages.trainer import EvalFn, Trainer

# A post-training stage's trainer class: (config, tokenizer, pad id, out dir, evaluation).
PolicyTrainer = Callable[[FromCheckpoint, Tokenizer, int, Path, EvalFn | None], Trainer]


def trainable_policy(init: str | Path) -> CausalLM:
    """`init` as a post-training stage trains it: FP4 widened to plain weights, and the MTP
    head frozen. The objectives score the next token alone, so the head gets no gradient;
    DeepSpeed hands the optimizer zeros for a missing gradient, and AdamW's weight decay then
    shrinks a trainable head every step, which the served tier would draft from."""
    model = load_checkpoint(init, keep_fp4=False)
    model.mtp.requires_grad_(False)
    return model


def post_train(
    config: FromCheckpoint, out_dir: Path, trainer: PolicyTrainer, qat: QATConfig | None = None
) -> Path:
    """Post-train `init` into `out_dir` with `trainer`; returns the exported model directory
    (the FP4 checkpoint when the trainer trained through FP4 weights, `qat`)."""
    out_dir = begin(config, out_dir)
    tok_dir = Path(config.init)
    tokenizer = Tokenizer.from_dir(tok_dir)
    evaluate = harness_eval(out_dir, tok_dir, config.train, list(config.data.mix))
    run = trainer(config, tokenizer, pad_id(tokenizer), out_dir, evaluate)
    return finish(run, config, out_dir, trained_export(qat or QATConfig(), tok_dir, out_dir))
