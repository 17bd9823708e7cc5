"""The trainer every stage shares, running through DeepSpeed.

One process on CPU by default (gloo), or several under `torchrun`/`deepspeed`; ZeRO stages
0-2 with a plain `torch.optim.AdamW` (nothing to compile). The example order is a pure
function of the step (`SampleOrder`): micro-batch m of process r at step s holds the
positions `s*G + (m*W + r)*B ...` of the stream, with G the global batch, W the number of
processes and B the micro-batch, so a run's batches do not depend on how it is split.
Token losses are normalised by the global batch's target count, gathered before the
step's first backward, so the gradient matches a single-process run exactly.

A step's examples are sorted by length before they are cut into micro-batches, so each
micro-batch pads to a similar length: with SFT's mix of short math and long tool prompts
this nearly doubles the real tokens per second at 4 micro-batches of 4. The gradient is the
same sum over the same examples.

`dtype = "bf16"` is mixed precision by `torch.autocast`: fp32 master weights and optimizer,
bf16 matmuls; `"auto"` is bf16 where the device computes it natively (a GPU from Ampere on, a
CPU with AVX512-BF16 or AMX) and fp32 elsewhere, where bf16 is emulated and slower than fp32.
DeepSpeed's own bf16 mode ran several times slower than fp32 on a CPU, so it is not used.
"""

import json
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from serving.model.dtype import is_supported
from serving.model.families import LanguageModel
from training.config import TrainConfig
from training.data.datasets import Batch, SampleOrder
from training.objectives.losses import LossFn
from training.reports.curves import plot_curves
from training.stages import checkpointing, progress

# A save redraws the curves at most this often, and the last step always: drawing them takes
# about as long as a toy model's step, and a run's progress is its bar and log.jsonl meanwhile.
CURVES_EVERY_S = 60.0


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def length(self, index: int) -> int: ...  # tokens of one example, for grouping
    def collate(self, indices: list[int]) -> Batch: ...


class Sampler(Protocol):
    """Chooses each step's examples from the log so far (the SFT curriculum), and turns
    the step's summed metrics into the logged row."""

    def indices(self, step: int, count: int, log: list[dict[str, Any]]) -> list[int]: ...
    def annotate(self, row: dict[str, Any]) -> None: ...


EvalFn = Callable[[LanguageModel, int], dict[str, float]]  # (model, step) -> completion rates


def autocast_bf16(dtype: str, device: torch.device) -> bool:
    """Whether a step runs under bf16 autocast: `bf16`, or `auto` where bf16 is native."""
    return dtype == "bf16" or (dtype == "auto" and is_supported(torch.bfloat16, device))


def init_distributed() -> None:
    """Join the process group a launcher describes, or make a one-process group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port, so concurrent runs do not collide
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed
    import deepspeed.ops

    # Its communication backend builds its shared-memory all-reduce on a CPU when it starts,
    # compiling for most of a minute on a fresh machine; only DeepSpeed's tensor-parallel
    # inference calls it, and training reduces through the process group (gloo).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to `min_lr_ratio` at the last step."""
    warmup, total, floor = cfg.optim.warmup_steps, cfg.steps, cfg.optim.min_lr_ratio

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return scale


def deepspeed_config(cfg: TrainConfig) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def split_by_length(
    indices: list[int], length: Callable[[int], int], micro_batch: int, world: int
) -> list[list[list[int]]]:
    """A step's examples as [micro-step][process] -> examples, shortest first: the examples
    sorted by length (stably) and cut in order, so each micro-batch pads little."""
    ordered = sorted(indices, key=length)
    size = micro_batch * world
    return [
        [ordered[m + r * micro_batch : m + (r + 1) * micro_batch] for r in range(world)]
        for m in range(0, len(ordered), size)
    ]


class Trainer:
    def __init__(
        self,
        model: LanguageModel,
        cfg: TrainConfig,
        dataset: Dataset | None,
        out_dir: Path,
        loss_fn: LossFn,
        evaluate: EvalFn | None = None,
        desc: str = "train",
        sampler: Sampler | None = None,
    ) -> None:
        import deepspeed

        init_distributed()
        self.cfg, self.dataset, self.loss_fn, self.evaluate = cfg, dataset, loss_fn, evaluate
        self.out_dir, self.desc, self.sampler = Path(out_dir), desc, sampler
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # None for a stage that overrides `micro_batches` (RL draws examples from its policy).
        self.order = SampleOrder(len(dataset), cfg.seed) if dataset is not None else None
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            weight_decay=cfg.optim.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(cfg),
        )
        self.log: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self._curves_drawn = time.monotonic()

    @property
    def model(self) -> LanguageModel:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def micro_batches(self, step: int) -> list[Batch]:
        cfg = self.cfg
        size = cfg.micro_batch * cfg.grad_accum * self.world
        if self.sampler is not None:
            chosen = self.sampler.indices(step, size, self.log)
        else:
            chosen = [self.order[k] for k in range(step * size, (step + 1) * size)]
        groups = split_by_length(chosen, self.dataset.length, cfg.micro_batch, self.world)
        return [self.dataset.collate(group[self.rank]) for group in groups]

    def train_step(self, step: int) -> dict[str, float]:
        batches = self.micro_batches(step)
        targets = torch.tensor(float(sum(b.num_targets for b in batches)))
        dist.all_reduce(targets)
        scale = self.cfg.grad_accum * self.world / targets.clamp(min=1)
        totals: dict[str, float] = {}
        sums = torch.zeros(3)  # objective, cross-entropy, real tokens
        norm = None
        bf16 = autocast_bf16(self.cfg.dtype, self.device)
        for batch in batches:
            with torch.autocast(self.device.type, torch.bfloat16, enabled=bf16):
                parts = self.loss_fn(self.model, batch)
            self.engine.backward(parts.token_sum * scale + parts.extra)
            if self.engine.is_gradient_accumulation_boundary():
                norm = self._grad_norm()
            self.engine.step()
            sums += torch.stack(
                [parts.token_sum.detach(), parts.ce_sum.detach(), batch.padding_mask.sum()]
            ).float()
            for key, value in parts.metrics.items():
                totals[key] = totals.get(key, 0.0) + value
        dist.all_reduce(sums)
        stats = torch.tensor(list(totals.values()), dtype=torch.float64)
        dist.all_reduce(stats)
        n = self.cfg.grad_accum * self.world
        denominator = targets.clamp(min=1)
        row = {
            "step": step,
            "loss": float(sums[0] / denominator),
            "ce": float(sums[1] / denominator),
        }
        row |= {k: float(v) / n for k, v in zip(totals, stats, strict=True)}
        row["lr"] = self.engine.get_lr()[0]
        ds_norm = self.engine.get_global_grad_norm()  # set by ZeRO 1-2, not by stage 0
        row["grad_norm"] = float(ds_norm if ds_norm is not None else norm)
        row["tokens"] = float(sums[2])
        return row

    def _grad_norm(self) -> float:
        """The accumulated, all-reduced gradient's norm before clipping (ZeRO 0 keeps it in
        .grad; ZeRO 1-2 move it into the optimizer, and DeepSpeed reports the norm itself)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan")

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint holds beside the model, optimizer, scheduler and RNG."""
        return {"step": step, "log": self.log, "evals": self.evals}

    def restore(self, state: dict[str, Any]) -> None:
        self.log, self.evals = state["log"], state["evals"]

    def _checkpoint(self, step: int) -> None:
        checkpointing.save(
            self.engine, self.out_dir / "checkpoints", step, self.state(step),
            self.cfg.keep_checkpoints,
        )  # fmt: skip

    def _resume(self) -> int:
        path = checkpointing.latest(self.out_dir / "checkpoints")
        if path is None:
            return 0
        state = checkpointing.load(self.engine, path)
        self.restore(state)
        return state["step"] + 1

    def _evaluate(self, step: int) -> None:
        if self.evaluate is not None:
            if self.rank == 0:
                self.model.eval()
                self.evals.append({"step": step, **self.evaluate(self.model, step)})
                self.model.train()
            dist.barrier()

    def _write_log(self, last: bool) -> None:
        if self.rank != 0:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(row) + "\n" for row in self.log)
        (self.out_dir / "log.jsonl").write_text(lines)
        (self.out_dir / "evals.json").write_text(json.dumps(self.evals, indent=1) + "\n")
        if last or time.monotonic() - self._curves_drawn >= CURVES_EVERY_S:
            plot_curves(self.log, self.evals, self.out_dir / "curves.png", self.desc)
            self._curves_drawn = time.monotonic()

    def fit(self) -> LanguageModel:
        """Train to `cfg.steps`, resuming from the newest valid checkpoint in `out_dir`."""
        cfg = self.cfg
        start = self._resume()
        self.model.train()
        bar = progress.step_bar(self.desc, start, cfg.steps, disable=self.rank != 0)
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            row = self.train_step(step)
            row["tokens_per_s"] = row["tokens"] / (time.perf_counter() - t0)
            postfix = {"loss": f"{row['loss']:.3f}", "tok_s": f"{row['tokens_per_s']:.0f}"}
            if self.sampler is not None:
                self.sampler.annotate(row)
                if row["copy_loss"] is not None:
                    postfix |= {"copy": f"{row['copy_loss']:.3f}", "phase": row["phase"]}
            self.log.append(row)
            bar.set_postfix(postfix)
            bar.update(1)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                self._evaluate(step)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                last = step + 1 == cfg.steps
                if last:
                    self._evaluate(step)
                self._checkpoint(step)
                self._write_log(last)
        bar.close()
        self.model.eval()
        return self.model
