"""The training stages: pretrain, SFT (think or short style), draft distillation, DPO and RL.

Each stage reads its `StageConfig`, builds (or reuses) its tokenized data under
`OUT/data`, trains through the shared `Trainer` with checkpoints under `OUT/checkpoints`
(rerunning the same command resumes), and exports the result as a Hugging Face directory in
bf16 under `OUT/model`, with the loss curves and held-out evaluation tables beside it. An SFT
stage with `[qat]` trains through FP4 weights and exports the FP4 checkpoint (compressed-
tensors, as `tierserve quantize` writes it) instead.
"""

import asyncio
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from serving.model.causal_lm import CausalLM
from serving.model.checkpoint import load_checkpoint, quantize_checkpoint, save_checkpoint
from serving.model.config import ModelConfig
from serving.model.tokenizer import Tokenizer
from tasks import harness
from training.config import ConfigError, StageConfig, TrainConfig
from training.data.curriculum import Curriculum, domain_sums
from training.data.datasets import (
    IGNORE,
    Batch,
    PretrainDataset,
    SFTDataset,
    build_pretrain,
    build_sft,
)
from training.data.target_data import target_completions
from training.data.tokenizer import EOS_TOKEN, PAD_TOKEN
from training.reports.evaluation import evaluate_checkpoint
from training.stages.dpo import DPOTrainer
from training.stages.losses import (
    distillation_loss_sum,
    kl_sum,
    load_balancing_loss,
    router_z_loss,
    shift_labels,
    token_loss_sum,
    token_losses,
)
from training.stages.mtp import export_mtp, load_for_mtp, mtp_loss
from training.stages.pruning import keep_layers
from training.stages.qat import disable_qat, enable_qat, served_state_dict
from training.stages.rl import RLTrainer
from training.stages.trainer import EvalFn, LossFn, LossParts, Trainer, init_distributed

# Training seeds of the held-out SFT examples: far past any run's own (still below the
# evaluation seed space, which is the harness's alone).
HELDOUT_SEED_OFFSET = 2_000_000_000


@dataclass
class Teacher:
    model: CausalLM
    weight: float
    temperature: float


def lm_loss(
    cfg: TrainConfig, domains: list[str] | None = None, teacher: Teacher | None = None
) -> LossFn:
    """Next-token cross-entropy (copy positions weighted `copy_weight`), plus the MoE router
    losses and lambda * the MTP loss. With `domains` (the curriculum's), also the summed
    cross-entropy at copy positions and per domain, with their counts, as metrics. With a
    `teacher`, plus weight * the KL from the teacher's distributions at the same answer tokens,
    which it predicts after its reasoning (`Batch.teacher`): the short-style student learns
    what the reasoning tier concludes."""

    def loss(model: CausalLM, batch: Batch) -> LossParts:
        router_logits: list[torch.Tensor] | None = [] if model.config.is_moe else None
        hidden = model(
            batch.input_ids,
            batch.positions,
            padding_mask=batch.padding_mask,
            router_logits=router_logits,
        )
        logits = model.compute_logits(hidden)
        metrics: dict[str, float] = {}
        ce = token_losses(logits, batch.labels)
        ce_sum = token_sum = ce.sum()
        if cfg.copy_weight != 1 and batch.copy_mask is not None:
            token_sum = ce_sum + (cfg.copy_weight - 1) * ce[batch.copy_mask].sum()
        if domains is not None:
            metrics |= loss_breakdown(ce.detach(), batch, domains)
        if teacher is not None:
            assert batch.teacher is not None  # a dataset built with the teacher's turns
            t = batch.teacher
            with torch.no_grad():
                t_hidden = teacher.model(t.input_ids, t.positions, padding_mask=t.padding_mask)
                t_logits = teacher.model.compute_logits(t_hidden)
            kd = kl_sum(
                logits[batch.labels != IGNORE], t_logits[t.labels != IGNORE], teacher.temperature
            )
            token_sum = token_sum + teacher.weight * kd
            metrics["kd_loss"] = kd.item() / max(1, batch.num_targets)
        extra = torch.zeros(())
        if router_logits:
            aux = load_balancing_loss(
                router_logits, model.config.num_experts_per_tok, batch.padding_mask
            )
            z = router_z_loss(router_logits, batch.padding_mask)
            extra = cfg.aux_loss_coef * aux + cfg.z_loss_coef * z
            metrics |= {"aux_loss": aux.item(), "z_loss": z.item()}
        if cfg.mtp_weight and len(model.mtp):
            mtp_logits = model.mtp_logits(
                hidden, batch.input_ids, batch.positions, batch.padding_mask
            )
            mtp_sum = torch.zeros(())
            for depth, logits in enumerate(mtp_logits, start=1):
                mtp_sum = mtp_sum + token_loss_sum(logits, shift_labels(batch.labels, depth))
            token_sum = token_sum + cfg.mtp_weight * mtp_sum
            metrics["mtp_loss"] = mtp_sum.item() / max(1, batch.num_targets)
        return LossParts(token_sum, ce_sum, extra, metrics)

    return loss


def loss_breakdown(ce: torch.Tensor, batch: Batch, domains: list[str]) -> dict[str, float]:
    """Summed cross-entropy and target counts at copy positions and per domain, every key
    always present (the trainer all-reduces metrics by position)."""
    assert batch.copy_mask is not None and batch.domains is not None  # SFT batches
    targets = batch.labels != IGNORE
    out = {"copy_ce_sum": float(ce[batch.copy_mask].sum()), "copy_n": float(batch.copy_mask.sum())}
    for d in domains:
        rows = torch.tensor([x == d for x in batch.domains])
        ce_key, n_key = domain_sums(d)
        out[ce_key] = float(ce[rows].sum())
        out[n_key] = float(targets[rows].sum())
    return out


def distill_loss(teacher: CausalLM, temperature: float) -> LossFn:
    """KL from the teacher's next-token distributions on the completion tokens."""

    def loss(model: CausalLM, batch: Batch) -> LossParts:
        with torch.no_grad():
            t_hidden = teacher(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
            t_logits = teacher.compute_logits(t_hidden)
        logits = model.compute_logits(
            model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
        )
        kd = distillation_loss_sum(logits, t_logits, batch.labels, temperature)
        keep = batch.labels != IGNORE
        agree = (logits.argmax(-1) == t_logits.argmax(-1))[keep].float().mean()
        ce = token_loss_sum(logits.detach(), batch.labels)
        return LossParts(kd, ce, torch.zeros(()), {"agreement": agree.item()})

    return loss


def export(model: CausalLM, out: Path, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    """A standalone Hugging Face directory of `model` in `dtype` (DeepSpeed's module may hold
    its parameters in another dtype and carry hooks, so the weights are copied out)."""
    fresh = CausalLM(model.config)
    state = {k: v.detach().to(dtype).clone() for k, v in served_state_dict(model).items()}
    fresh.load_state_dict(state)
    fresh.to(dtype)
    save_checkpoint(fresh, out, tokenizer_dir)  # generation_config from the model's config
    return out


def heldout_copy_loss(model: CausalLM, heldout: SFTDataset) -> float:
    """Mean cross-entropy at copy positions of SFT examples the run does not train on."""
    total = count = 0.0
    with torch.inference_mode():
        for start in range(0, len(heldout), 8):
            batch = heldout.collate(list(range(start, min(start + 8, len(heldout)))))
            hidden = model(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
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

    def evaluate(model: CausalLM, step: int) -> dict[str, float]:
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


def _build_once(path: Path, build) -> Path:
    """Rank 0 builds the data file if it is not there yet; the others wait for it."""
    if dist.get_rank() == 0 and not path.exists():
        build()
    dist.barrier()
    return path


def _new_model(shape: dict, tokenizer: Tokenizer, mtp: bool, seed: int) -> CausalLM:
    raw = dict(shape)
    raw["vocab_size"] = tokenizer.vocab_size
    raw["eos_token_id"] = tokenizer.raw.token_to_id(EOS_TOKEN)
    raw["pad_token_id"] = tokenizer.raw.token_to_id(PAD_TOKEN)
    if mtp:
        raw["tierserve_mtp"] = {"num_layers": 1}
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(raw))
    model.init_weights()
    return model


def _evaluate(
    config: StageConfig,
    out_dir: Path,
    tok_dir: Path,
    domains: list[str],
    heldout: SFTDataset | None,
) -> EvalFn | None:
    """The held-out evaluation of the stages that train the tiers' policies."""
    if config.stage not in ("sft", "dpo", "rl"):
        return None
    return harness_eval(out_dir, tok_dir, config.train, domains, heldout)


def run_stage(config: StageConfig, out_dir: Path) -> Path:
    """Train one stage into `out_dir`; returns the exported model directory."""
    init_distributed()
    cfg = config.train
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stage.json").write_text(config.model_dump_json(indent=2) + "\n")
    if config.qat.format is not None and config.stage != "sft":
        raise ConfigError(f"[qat] is for the sft stage, not {config.stage}")
    if config.teacher is not None and (config.stage, config.style) != ("sft", "short"):
        raise ConfigError("`teacher` distils a think-style model into the short-style sft stage")
    if config.draft_data != "reference" and config.stage not in ("draft", "mtp"):
        raise ConfigError(f"draft_data is for the draft and mtp stages, not {config.stage}")
    if config.mtp_depths != 1 and config.stage != "mtp":
        raise ConfigError(f"mtp_depths is for the mtp stage, not {config.stage}")
    if config.keep_layers is not None and config.stage != "sft":
        raise ConfigError(f"keep_layers is for the sft stage, not {config.stage}")
    if config.stage in ("sft", "draft", "mtp", "dpo", "rl") and not config.init:
        raise ConfigError(f"the {config.stage} stage needs `init`: a checkpoint directory")
    tok_dir = Path(config.tokenizer or config.init or "")
    if config.stage == "pretrain" and not config.tokenizer:
        raise ConfigError("the pretrain stage needs `tokenizer`: a directory with tokenizer.json")
    tokenizer = Tokenizer.from_dir(tok_dir)
    pad_id = tokenizer.raw.token_to_id(PAD_TOKEN)
    data_dir = out_dir / "data"
    domains = list(config.data.mix)
    curriculum: Curriculum | None = None
    heldout: SFTDataset | None = None
    if config.stage == "rl":
        trainer: Trainer = RLTrainer(
            config, tokenizer, pad_id, out_dir, _evaluate(config, out_dir, tok_dir, domains, None)
        )
    elif config.stage == "dpo":
        trainer = DPOTrainer(
            config, tokenizer, pad_id, out_dir, _evaluate(config, out_dir, tok_dir, domains, None)
        )
    elif config.stage == "pretrain":
        if config.shape is None:
            raise ConfigError("the pretrain stage needs `shape`: the model's config.json fields")
        path = _build_once(
            data_dir / "tokens.npy",
            lambda: build_pretrain(config.data, tokenizer, data_dir / "tokens.npy"),
        )
        dataset = PretrainDataset(path, cfg.seq_len)
        model = _new_model(config.shape, tokenizer, cfg.mtp_weight > 0, cfg.seed)
        loss = lm_loss(cfg)
    else:
        style = config.style
        distil = config.teacher is not None
        name = f"sft-{style}" + ("-teacher" if distil else "")
        path = _build_once(
            data_dir / f"{name}.jsonl",
            lambda: build_sft(
                config.data, style, tokenizer, data_dir / f"{name}.jsonl", cfg.seq_len, distil
            ),
        )
        if config.draft_data == "target":
            reference, path = path, data_dir / f"{name}-target.jsonl"
            _build_once(path, lambda: target_completions(reference, path, config.init, cfg.seq_len))
        dataset = SFTDataset(path, pad_id)
        if config.stage == "sft":
            model = load_checkpoint(config.init, keep_fp4=False)  # trained: plain weights
            if config.keep_layers is not None:
                model = keep_layers(model, config.keep_layers)
            if config.qat.format is not None:
                enable_qat(model, config.qat.format, config.qat.all_linear)
            if config.curriculum.enabled:
                curriculum = Curriculum(dataset, config.curriculum, cfg.seed)
                heldout_data = config.data.model_copy(
                    update={
                        "seed": config.data.seed + HELDOUT_SEED_OFFSET,
                        "examples": config.curriculum.heldout_examples,
                    }
                )
                heldout_path = _build_once(
                    data_dir / f"heldout-{style}.jsonl",
                    lambda: build_sft(
                        heldout_data,
                        style,
                        tokenizer,
                        data_dir / f"heldout-{style}.jsonl",
                        cfg.seq_len,
                    ),
                )
                heldout = SFTDataset(heldout_path, pad_id)
            teacher = None
            if config.teacher is not None:
                teacher_model = load_checkpoint(config.teacher).eval()
                teacher = Teacher(teacher_model, config.kd_weight, config.kd_temperature)
            loss = lm_loss(cfg, curriculum.domains if curriculum else None, teacher)
        elif config.stage == "mtp":
            model, loss = load_for_mtp(config.init), mtp_loss(config.mtp_depths)
        else:
            if config.shape is None:
                raise ConfigError("the draft stage needs `shape`: the drafter's config.json fields")
            model = _new_model(config.shape, tokenizer, False, cfg.seed)
            loss = distill_loss(load_checkpoint(config.init), config.kd_temperature)
    if config.stage not in ("dpo", "rl"):
        trainer = Trainer(
            model,
            cfg,
            dataset,
            out_dir,
            loss,
            _evaluate(config, out_dir, tok_dir, domains, heldout),
            desc=config.stage,
            sampler=curriculum,
        )
    model = trainer.fit()
    final = out_dir / "model"
    if dist.get_rank() == 0:
        if config.qat.format is not None:
            disable_qat(model)
            latent = export(model, out_dir / "model-latent", tok_dir, torch.float32)
            shutil.rmtree(final, ignore_errors=True)
            quantize_checkpoint(
                latent, final, config.qat.format, config.qat.all_linear, torch.bfloat16
            )
            shutil.rmtree(latent)
        elif config.stage == "mtp":
            export_mtp(model, config.init, final)
        else:
            export(model, final, tok_dir, torch.bfloat16)
        summary = {"stage": config.stage, "style": config.style, "log_tail": trainer.log[-1]}
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    dist.barrier()
    return final
