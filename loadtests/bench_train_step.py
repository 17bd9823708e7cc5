"""A training step in fp32 against the same step under bf16 autocast, side by side in one run:
a pretraining step (the demo's base MoE from random weights, `pretrain.toml`'s batch) and an
SFT step (the shipped full tier on think-style SFT data, `sft.toml`'s batch).

The two precisions train two copies of the same model on the same batches, step by step in
turn (fp32's step s, then bf16's step s), so both see the same machine load; the first step of
each is left out of the timing (allocation and warm-up). Prints the CPU's flags that decide
whether bf16 is native here, each precision's median step time and the ratio, and the time
building a step's batches takes beside it; writes both loss curves (CSV, and a PNG with
matplotlib) to show that the two train the same.

`--precision auto` (the default) compares with bf16 only where the CPU computes it natively
(AVX512-BF16 or AMX: `serving.model.dtype.is_supported`) and refuses elsewhere, where bf16 is
emulated and fp32 is what `train.dtype = "auto"` trains in; `--precision bf16` times the
emulated bf16 anyway.

    python -m loadtests.bench_train_step [--steps 8] [--precision bf16] [--grad-accum 1]
        [--examples 400] [--threads N] [--out bench-train-step]
"""

import argparse
import copy
import csv
import os
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from serving.model.checkpoint import load_checkpoint
from serving.model.dtype import is_supported
from serving.model.tokenizer import Tokenizer
from training.config import DataConfig, TrainConfig
from training.data.datasets import PretrainDataset, SFTDataset, build_pretrain, build_sft
from training.objectives.lm_loss import lm_loss
from training.stages.outputs import new_model, pad_id
from training.stages.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "training" / "recipes" / "demo"
FULL = REPO / "models" / "demo-full"
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> list[str]:
    """The flags of /proc/cpuinfo that bear on bf16 (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return [f for f in FLAGS if f in have]


def _section(file: str, name: str) -> dict:
    return tomllib.loads((RECIPE / file).read_text())[name]


def train_config(file: str, args: argparse.Namespace, dtype: str) -> TrainConfig:
    """The demo stage's [train] at this bench's step count and precision (its warmup then
    spans most of the run: the curves compare the precisions, not the schedule)."""
    raw = _section(file, "train") | {"dtype": dtype, "steps": args.steps}
    if args.grad_accum is not None:
        raw["grad_accum"] = args.grad_accum
    return TrainConfig.model_validate(raw)


def datasets(tmp: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    data = _section("pretrain.toml", "data") | {"examples": args.examples}
    tokens = build_pretrain(DataConfig.model_validate(data), tokenizer, tmp / "tokens.npy")
    sft_data = _section("sft.toml", "data") | {"examples": args.examples}
    seq_len = _section("sft.toml", "train")["seq_len"]
    rows = build_sft(
        DataConfig.model_validate(sft_data), "think", tokenizer, tmp / "sft.jsonl", seq_len
    )
    return {
        "pretrain": PretrainDataset(tokens, _section("pretrain.toml", "train")["seq_len"]),
        "sft": SFTDataset(rows, pad_id(tokenizer)),
    }


def trainers(stage: str, dataset, tokenizer: Tokenizer, args, tmp: Path) -> dict[str, Trainer]:
    """One trainer per precision, each on its own copy of the same starting weights."""
    file = "pretrain.toml" if stage == "pretrain" else "sft.toml"
    if stage == "pretrain":
        model = new_model(_section(file, "shape"), tokenizer, mtp=True, seed=0)
    else:
        model = load_checkpoint(FULL, keep_fp4=False)
    out = {}
    for name, dtype in (("fp32", "fp32"), ("bf16", args.precision)):
        cfg = train_config(file, args, dtype)
        out[name] = Trainer(copy.deepcopy(model), cfg, dataset, tmp / stage / name, lm_loss(cfg))
    return out


def bench(stage: str, arms: dict[str, Trainer], steps: int) -> list[dict]:
    rows = []
    for step in range(steps):
        t0 = time.perf_counter()
        arms["fp32"].micro_batches(step)
        data_s = time.perf_counter() - t0
        for name, trainer in arms.items():
            t0 = time.perf_counter()
            row = trainer.train_step(step)
            seconds = time.perf_counter() - t0
            rows.append(
                {
                    "stage": stage,
                    "step": step,
                    "precision": name,
                    "seconds": seconds,
                    "loss": row["loss"],
                    "ce": row["ce"],
                    "tokens": row["tokens"],
                    "data_s": data_s,
                }
            )
            print(
                f"{stage} step {step} {name}: {seconds:.2f} s, loss {row['loss']:.4f}", flush=True
            )
    return rows


def summary(rows: list[dict]) -> str:
    lines = [
        "| step | fp32 s | bf16 s | fp32 / bf16 | batches built s | loss fp32 / bf16, last |",
        "|---|---|---|---|---|---|",
    ]
    for stage in dict.fromkeys(r["stage"] for r in rows):
        timed = [r for r in rows if r["stage"] == stage and r["step"] > 0]
        median = {
            p: statistics.median(r["seconds"] for r in timed if r["precision"] == p)
            for p in ("fp32", "bf16")
        }
        data = statistics.median(r["data_s"] for r in timed if r["precision"] == "fp32")
        last = {r["precision"]: r["loss"] for r in rows if r["stage"] == stage}
        lines.append(
            f"| {stage} | {median['fp32']:.2f} | {median['bf16']:.2f} | "
            f"{median['fp32'] / median['bf16']:.2f}x | {data:.3f} | "
            f"{last['fp32']:.4f} / {last['bf16']:.4f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(dict.fromkeys(r["stage"] for r in rows))
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.6))
    for axis, stage in zip(axes, stages, strict=True):
        for precision in ("fp32", "bf16"):
            points = [
                (r["step"], r["loss"])
                for r in rows
                if r["stage"] == stage and r["precision"] == precision
            ]
            axis.plot(*zip(*points, strict=True), marker="o", label=precision)
        axis.set(xlabel="step", ylabel="loss", title=f"{stage} step")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per precision and stage")
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16"),
        default="auto",
        help="the arm set against fp32: auto is bf16 only where it is native",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-batches a step (default: the demo recipe's)",
    )
    parser.add_argument("--examples", type=int, default=400, help="tasks drawn for the data")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-train-step"))
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is not timed")
    if args.threads:
        torch.set_num_threads(args.threads)
    native = is_supported(torch.bfloat16)
    flags = cpu_flags()
    print(
        f"CPU flags: {' '.join(flags) or '(none read)'}; native bf16 matmul: {native}; "
        f"torch threads: {torch.get_num_threads()}; load average: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.precision == "auto" and not native:
        raise SystemExit(
            "this CPU has no native bf16 (AVX512-BF16 or AMX): train.dtype = 'auto' trains in "
            "fp32 here, so there is nothing to compare; --precision bf16 times emulated bf16"
        )
    args.precision = "bf16"
    tokenizer = Tokenizer.from_dir(FULL)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage, dataset in datasets(Path(tmp), tokenizer, args).items():
            rows += bench(stage, trainers(stage, dataset, tokenizer, args, Path(tmp)), args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "losses.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{summary(rows)}\n\nload average at the end: {load}")
    print(f"loss curves: {args.out / 'losses.csv'}")
    if plot(rows, args.out / "losses.png"):
        print(f"and {args.out / 'losses.png'}")


if __name__ == "__main__":
    main()
