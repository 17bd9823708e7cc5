"""`tierserve train ...`: one subcommand per stage, plus the tokenizer and whole recipes.

DeepSpeed and matplotlib come with the `train` extra (`pip install -e ".[train]"`); they
are imported only when a training command runs, so serving needs neither.
"""

import argparse
from pathlib import Path

from router.cli import add_train_router
from training.config import ConfigError


def _require_training_extra() -> None:
    try:
        import deepspeed  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"training needs the `train` extra ({e.name} is missing): pip install -e '.[train]'"
        ) from None


def run_stage_command(args: argparse.Namespace) -> None:
    _require_training_extra()
    from training.config import load_stage_config
    from training.stages import run_stage

    fields = {"stage": args.stage}
    for key in ("init", "style", "tokenizer"):
        if getattr(args, key, None) is not None:
            fields[key] = str(getattr(args, key))
    config = load_stage_config(args.config, args.set, **fields)
    print(f"model: {run_stage(config, args.out)}")


def run_recipe_command(args: argparse.Namespace) -> None:
    _require_training_extra()
    from training.recipes import run_recipe

    work = args.work or Path("runs") / args.name
    for tier, path in run_recipe(args.name, work, args.models).items():
        print(f"{tier}: {path}")


def run_tokenizer_command(args: argparse.Namespace) -> None:
    from training.recipes import build_tokenizer

    print(build_tokenizer(args.out, args.vocab_size, args.examples))


def add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train the tiers: stages, tokenizer, whole recipes")
    stages = train.add_subparsers(required=True, metavar="STAGE")
    for stage, help_text in (
        ("pretrain", "the base MoE on the mixed domain corpus (with MTP)"),
        ("sft", "supervised fine-tuning on chat examples (--style think|short)"),
        ("draft", "a small dense drafter distilled from a full model"),
    ):
        p = stages.add_parser(stage, help=help_text)
        p.add_argument("--config", type=Path, help="a TOML stage config (all fields optional)")
        p.add_argument("--out", type=Path, required=True, help="run directory (resumes)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config field, e.g. train.steps=200 (repeatable)",
        )
        if stage == "pretrain":
            p.add_argument("--tokenizer", type=Path, help="directory with tokenizer.json")
        else:
            p.add_argument("--init", type=Path, help="the checkpoint to start from / distil")
        if stage == "sft":
            p.add_argument("--style", choices=["think", "short"])
        p.set_defaults(run=run_stage_command, stage=stage)
    add_train_router(stages)
    p = stages.add_parser("recipe", help="tokenizer, pretrain, both SFT styles and draft")
    p.add_argument("name", help="a recipe under training/recipes: demo or smoke")
    p.add_argument("--work", type=Path, help="stage directories (default runs/NAME)")
    p.add_argument("--models", type=Path, default=Path("models"), help="where models land")
    p.set_defaults(run=run_recipe_command)
    p = stages.add_parser("tokenizer", help="byte-level BPE on the domain corpus")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--examples", type=int, default=2000, help="tasks drawn for the corpus")
    p.set_defaults(run=run_tokenizer_command)
