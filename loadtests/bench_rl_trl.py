"""Our RL stage beside TRL's GRPO trainer on the same checkpoint, prompts, rewards and
hyper-parameters: both training-reward curves on one plot, and each side's wall time.

Both sides train `--init` for `--steps` optimizer steps, each on `--tasks` prompts x `--group`
sampled answers, with AdamW (betas 0.9 / 0.95, weight decay 0.1), a constant learning rate `--lr`,
gradient clipping at 1, the clipped objective at 0.2 / 0.28 (clip-higher), token-level
normalisation (TRL's `dapo` loss), group-standardised advantages, the k3 KL term to the initial
model at `--kl-coef` (TRL's `beta`), temperature 1 and at most `--max-tokens` new tokens. The
prompts are the RL stage's own (`step_tasks` over one domain; with `--prompts N`, a fixed set of N
visited in epochs, as a dataset is), given to TRL in the same order (its shuffling off); the reward
is our verifier's verdict on the answer's text plus DAPO's overlong penalty on its length, on both
sides; the curves are the verifier's part. Dynamic sampling is off on ours, as TRL has none: both
normalise by every token of the step. An FP4 checkpoint is widened to fp32 first (transformers
cannot load per-expert FP4 into its fused experts); our stage widens it the same way when it loads
it. transformers adds the MoE router's auxiliary loss to TRL's objective (coefficient 1e-3); our RL
objective has none. Each side's wall time is its training loop alone (our stage's summed step
times, TRL's `train()`), without loading, compiling or exporting.

    python -m loadtests.bench_rl_trl --init models/demo-highspeed --domain math --steps 20

`--ours-run DIR` takes our side from a run of the stage with the same settings (the run that
found them, say), its first `--steps` steps, instead of training it again; its settings are
checked against these.

Writes `OUT/rewards.png`, `OUT/ours/` (the stage's run) and `OUT/trl/` (TRL's trained model in
`OUT/trl/model`, in our layout, for `tierserve eval tasks`), and prints a table of the reward per
step with each side's wall time.
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from serving.model.checkpoint import (
    load_checkpoint,
    read_safetensors,
    save_checkpoint,
    write_safetensors,
)
from tasks import DOMAINS
from tasks.base import play
from training.objectives.grpo import overlong_penalty
from training.stages.rl import RLStage, step_tasks

TIERSERVE = [sys.executable, "-c", "from serving.cli import main; main()"]
OVERLONG_CACHE = 64  # the RL stage's default


def stage_config(args: argparse.Namespace, init: Path) -> RLStage:
    return RLStage(
        init=str(init),
        style=args.style,
        data={"mix": {args.domain: 1.0}, "difficulties": args.difficulties, "seed": 500_000},
        train={
            "steps": args.steps,
            "grad_accum": args.grad_accum,
            "seq_len": 1024,
            "save_every": args.steps,
            "optim": {"lr": args.lr, "min_lr_ratio": 1.0, "warmup_steps": 0},
        },
        rl={
            "tasks_per_step": args.tasks,
            "group_size": args.group,
            "max_tokens": args.max_tokens,
            "max_turns": 1,
            "dynamic_sampling": False,
            "domain_weighting": "fixed",
            "kl_coef": args.kl_coef,
            "track_kl": False,
            "overlong_cache": OVERLONG_CACHE,
            "prompts": args.prompts,
        },
    )


def logged_curve(config: RLStage, out: Path) -> tuple[list[float], float]:
    """The reward per step of a run's first `train.steps` steps, and the seconds they took."""
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    if len(rows) < config.train.steps:
        raise SystemExit(f"{out}: {len(rows)} steps logged, not {config.train.steps}")
    rows = rows[: config.train.steps]
    seconds = sum(row["tokens"] / row["tokens_per_s"] for row in rows)
    return [row[f"reward/{next(iter(config.data.mix))}"] for row in rows], seconds


def same_settings(config: RLStage, out: Path) -> None:
    """Refuse a run of the stage whose training differs from `config` in more than where
    its start lies, what it logs, how often it saves and how many steps it ran on: at the
    bench's constant learning rate, a longer run's first steps are a shorter one's."""
    run = RLStage.model_validate_json((out / "stage.json").read_text())
    ignored = {"init": True, "rl": {"track_kl"}, "train": {"steps", "save_every", "eval_every"}}
    ignored["train"] |= {"eval_n"}
    ignored["train"] |= {"eval_max_tokens", "eval_difficulties", "keep_checkpoints"}
    theirs, ours = run.model_dump(exclude=ignored), config.model_dump(exclude=ignored)
    if theirs != ours:
        differ = {k for k in ours if ours[k] != theirs[k]}
        raise SystemExit(f"{out}: trained with other settings ({', '.join(sorted(differ))})")


def toml_value(value: object) -> str:
    """A `--set` value: JSON is TOML but for tables, written inline here."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def run_ours(config: RLStage, out: Path) -> None:
    """The stage through its command, as a user runs it."""
    sets = {
        "data.mix": toml_value(config.data.mix),
        "data.difficulties": json.dumps(config.data.difficulties),
        "data.seed": str(config.data.seed),
        "train.eval_every": "0",
        "train.eval_n": "1",
        "train.eval_max_tokens": "8",
    }
    for section in ("train", "rl"):
        for key, value in getattr(config, section).model_dump().items():
            skipped = ("optim", "eval_difficulties", "eval_every", "eval_n", "eval_max_tokens")
            if key in skipped or value is None:  # TOML has no null: None is the default
                continue
            sets[f"{section}.{key}"] = toml_value(value)
    for key, value in config.train.optim.model_dump().items():
        sets[f"train.optim.{key}"] = json.dumps(value)
    sets["style"] = json.dumps(config.style)
    command = [*TIERSERVE, "train", "rl", "--init", config.init, "--out", str(out)]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    subprocess.run(command, check=True)


def run_trl(config: RLStage, model_dir: Path, out: Path) -> tuple[list[float], float]:
    """TRL's GRPOTrainer on the same prompts, reward and settings."""
    try:
        import datasets
        import transformers
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"{e}: TRL comes with the `trl` extra: pip install -e '.[trl]'") from e

    rl, train = config.rl, config.train
    weights = {d: 1.0 for d in config.data.mix}
    tasks = [t for s in range(train.steps) for t in step_tasks(config, s, 0, 1, weights)]
    dataset = datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": t.prompt}],
                "domain": t.domain,
                "task_seed": t.seed,
                "difficulty": t.difficulty,
            }
            for t in tasks
        ]
    )

    def verifier(completions, domain, task_seed, difficulty, **_) -> list[float]:
        rewards = []
        for answer, name, seed, level in zip(
            completions, domain, task_seed, difficulty, strict=True
        ):
            _, verdict = play(
                DOMAINS[name], DOMAINS[name].generate(seed, level), [answer[0]["content"]]
            )
            rewards.append(verdict.reward)
        return rewards

    def overlong(completion_ids, **_) -> list[float]:
        return [overlong_penalty(len(ids), rl.max_tokens, OVERLONG_CACHE) for ids in completion_ids]

    per_step = rl.tasks_per_step * rl.group_size
    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        seed=train.seed,
        max_steps=train.steps,
        per_device_train_batch_size=per_step // train.grad_accum,
        gradient_accumulation_steps=train.grad_accum,
        num_generations=rl.group_size,
        max_completion_length=rl.max_tokens,
        temperature=rl.temperature,
        learning_rate=train.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=train.optim.betas[0],
        adam_beta2=train.optim.betas[1],
        weight_decay=train.optim.weight_decay,
        max_grad_norm=train.optim.grad_clip,
        beta=rl.kl_coef,
        epsilon=rl.eps_low,
        epsilon_high=rl.eps_high,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[verifier, overlong],  # summed, each logged on its own
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    start = time.monotonic()
    trainer.train()
    wall = time.monotonic() - start
    # The trained weights over the start's files (transformers drops the MTP head, which GRPO
    # does not train), so the held-out eval reads TRL's model as it reads ours.
    trainer.model.save_pretrained(out / "hf")
    trained = read_safetensors(out / "hf")
    shutil.copytree(model_dir, out / "model", dirs_exist_ok=True)
    tensors = read_safetensors(model_dir)
    write_safetensors(out / "model", {k: trained.get(k, v) for k, v in tensors.items()})
    # The verifier's part, as our stage logs `reward/DOMAIN` (its penalty apart).
    key = "rewards/verifier/mean"
    return [row[key] for row in trainer.state.log_history if key in row], wall


def plot(curves: dict[str, list[float]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o", label=name, linewidth=1)
    ax.set(xlabel="step", ylabel="training reward (mean)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--init", type=Path, default=Path("models/demo-highspeed"))
    ap.add_argument("--style", choices=["think", "short"], default="short")
    ap.add_argument("--domain", choices=list(DOMAINS), default="math")
    ap.add_argument("--difficulties", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=8, help="prompts per step")
    ap.add_argument(
        "--prompts", type=int, help="a fixed set of this many prompts, in epochs (else fresh)"
    )
    ap.add_argument("--group", type=int, default=8, help="answers sampled per prompt")
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--ours-run", type=Path, help="a finished run of our stage to take")
    ap.add_argument("--out", type=Path, default=Path("bench-out/rl-trl"))
    args = ap.parse_args()
    if args.tasks * args.group % args.grad_accum:
        ap.error("--tasks x --group must divide into --grad-accum micro-batches")
    args.out.mkdir(parents=True, exist_ok=True)
    widened = args.out / "init-fp32"
    if not (widened / "config.json").exists():
        save_checkpoint(load_checkpoint(args.init, keep_fp4=False), widened, args.init)
    config = stage_config(args, widened)
    ours_dir = args.ours_run or args.out / "ours"
    if args.ours_run is None:
        run_ours(config, ours_dir)
    same_settings(config, ours_dir)
    ours, ours_s = logged_curve(config, ours_dir)
    trl, trl_s = run_trl(config, widened, args.out / "trl")
    title = f"{args.init.name}, {args.domain}: {args.tasks} x {args.group} a step, lr {args.lr}"
    curves = {f"ours ({ours_s:.0f} s)": ours, f"TRL GRPO ({trl_s:.0f} s)": trl}
    plot(curves, args.out / "rewards.png", title)
    print(f"\n{title}; training reward per step")
    print("| step | ours | TRL |\n|---|---|---|")
    for step, (a, b) in enumerate(zip(ours, trl, strict=False), start=1):
        print(f"| {step} | {a:.3f} | {b:.3f} |")
    third = max(1, len(ours) // 3)
    # With a fixed prompt set, an epoch's steps play every prompt once: their mean reward is
    # free of which prompts a step happened to draw.
    epoch = args.prompts // args.tasks if args.prompts and args.prompts % args.tasks == 0 else 0
    for name, rewards, wall in (("ours", ours, ours_s), ("TRL", trl, trl_s)):
        first, last = sum(rewards[:third]) / third, sum(rewards[-third:]) / third
        print(f"{name}: first third {first:.3f}, last third {last:.3f}, wall {wall:.0f} s")
        if epoch:
            full = range(0, len(rewards) - epoch + 1, epoch)  # whole epochs only
            means = [sum(rewards[i : i + epoch]) / epoch for i in full]
            print(f"  by epoch of {args.prompts} prompts: " + " ".join(f"{m:.3f}" for m in means))
    print(f"wall time, TRL / ours: {trl_s / ours_s:.2f}x; plot: {args.out / 'rewards.png'}")


if __name__ == "__main__":
    main()
