"""Training's subcommands: `train` (one subcommand per stage, plus the tokenizer, a random
initial checkpoint and whole recipes) and `eval` (`tasks`: the harness on a model, a server or
the references; `router`: the routers' curves; `quantization`: quantized checkpoints against
their model).

DeepSpeed and matplotlib come with the `train` extra (`pip install -e ".[train]"`); they
are imported only when a training command runs, so serving needs neither.
"""

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from router.commands import add_eval_router, add_train_router
from router.learned import RouterFileError
from router.outcomes import OutcomeError
from training.config import ConfigError, read_stage_file

USER_ERRORS = (ConfigError, RouterFileError, OutcomeError)


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
    from training.stages.run import load_stage_config, run_stage

    fields = {"stage": args.stage}
    for key in ("init", "style", "tokenizer"):
        if getattr(args, key, None) is not None:
            fields[key] = str(getattr(args, key))
    config = load_stage_config(args.config, args.set, **fields)
    if args.config is not None and read_stage_file(args.config)[1]:
        print(
            f"{args.config}: its [[phase]] list is the chain `tierserve train recipe` runs; "
            "this command trains the file's own settings, one run",
            file=sys.stderr,
        )
    print(f"model: {run_stage(config, args.out)}")


def run_recipe_command(args: argparse.Namespace) -> None:
    _require_training_extra()
    from training.recipes.gate import GateError
    from training.recipes.run import run_recipe

    work = args.work or Path("runs") / args.name
    try:
        published = run_recipe(args.name, work, args.models)
    except GateError as e:
        sys.exit(f"regression gate: {e}")
    for tier, path in published.items():
        print(f"{tier}: {path}")


def run_tokenizer_command(args: argparse.Namespace) -> None:
    from training.recipes.tokenizer import build_tokenizer

    print(build_tokenizer(args.out, args.vocab_size, args.examples))


def add_train(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser("train", help="train the tiers: stages, tokenizer, whole recipes")
    stages = train.add_subparsers(required=True, metavar="STAGE")
    for stage, help_text in (
        ("pretrain", "the base MoE on the mixed domain corpus (with MTP)"),
        ("sft", "supervised fine-tuning on chat examples (--style think|short)"),
        ("draft", "a small dense drafter distilled from a target model (--style of its turns)"),
        ("mtp", 'the --init model\'s MTP head alone, on its own outputs (draft_data="target")'),
        ("dpo", "DPO on multi-objective pairs from the --init model's own samples"),
        ("reward-model", "a reward head per objective on the --init model's ranked answers"),
        ("rl", "GRPO with DAPO's refinements on the verifiers' rewards (--init: the policy)"),
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
        if stage in ("sft", "draft", "mtp"):
            p.add_argument("--style", choices=["think", "short"])
        p.set_defaults(run=run_stage_command, stage=stage)
    add_train_router(stages)
    p = stages.add_parser(
        "recipe", help="tokenizer, pretrain, both SFT styles, post-training (DPO, RL), draft"
    )
    p.add_argument("name", help="a recipe under training/recipes: demo or smoke")
    p.add_argument("--work", type=Path, help="stage directories (default runs/NAME)")
    p.add_argument("--models", type=Path, default=Path("models"), help="where models land")
    p.set_defaults(run=run_recipe_command)
    p = stages.add_parser("tokenizer", help="byte-level BPE on the domain corpus")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--examples", type=int, default=2000, help="tasks drawn for the corpus")
    p.set_defaults(run=run_tokenizer_command)
    p = stages.add_parser(
        "init-checkpoint", help="step 0: random weights with a freshly trained tokenizer"
    )
    p.add_argument("out", type=Path)
    p.add_argument(
        "--shape",
        type=Path,
        help="a config.json, a card with the config under 'config', or a stage .toml's [shape]",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run_init_checkpoint)


def run_init_checkpoint(args: argparse.Namespace) -> None:
    from training.stages.init_checkpoint import init_checkpoint, read_shape

    shape = read_shape(args.shape) if args.shape else None
    print(init_checkpoint(args.out, shape, seed=args.seed))


def run_eval_quantization(args: argparse.Namespace) -> None:
    from training.reports import quantization as quantization_report

    rows = quantization_report.compare(
        args.full_precision, args.quantized, args.examples, args.style
    )
    print(quantization_report.format_table(args.full_precision, rows))


def run_eval_tasks(args: argparse.Namespace) -> None:
    from tasks import DEFAULT_DOMAINS, harness
    from training.reports.evaluation import evaluate_checkpoint

    domains = args.domains.split(",") if args.domains else list(DEFAULT_DOMAINS)
    selection = (domains, args.difficulty, args.n, args.seed, args.concurrency)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.model is not None:
        episodes = evaluate_checkpoint(args.model, *selection, **sampling)
    else:
        episodes = harness.run(
            *selection,
            url=args.url,
            served_model=args.served_model,
            api_key=args.api_key,
            reference=args.reference,
            **sampling,
        )
    records = asyncio.run(episodes)
    result = harness.report(records)
    print(harness.format_table(result["summary"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.baseline:
        failures = harness.regressions(
            result["summary"], json.loads(args.baseline.read_text()), args.max_drop
        )
        for failure in failures:
            print(f"regression: {failure}", file=sys.stderr)
        if failures:
            sys.exit(1)


def add_eval(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("eval", help="score models on held-out tasks, routers, quantization")
    evals = parser.add_subparsers(required=True, metavar="WHAT")
    add_eval_tasks(evals)
    add_eval_retrieval(evals)
    add_eval_router(evals)
    add_eval_quantization(evals)


def add_eval_tasks(evals: argparse._SubParsersAction) -> None:
    parser = evals.add_parser(
        "tasks", help="held-out tasks of the domains: completion rate by domain and difficulty"
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", type=Path, help="a checkpoint directory, served in process")
    target.add_argument("--url", help="an OpenAI-compatible API root, e.g. http://host:8100/v1")
    target.add_argument(
        "--reference", choices=["think", "short"], help="play the reference solutions instead"
    )
    parser.add_argument("--served-model", help="the model name to ask for at --url")
    parser.add_argument("--api-key", default=os.environ.get("TIERSERVE_API_KEY"))
    parser.add_argument("--domains", help="comma-separated (default: the chat domains)")
    parser.add_argument("--n", type=int, default=20, help="tasks per domain and difficulty")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out tasks")
    parser.add_argument("--difficulty", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512, help="per assistant turn")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", type=Path, help="write the summary and every record here")
    parser.add_argument("--baseline", type=Path, help="an earlier --json: exit 1 on a drop")
    parser.add_argument(
        "--max-drop", type=float, default=5.0, help="allowed drop in completion, in points"
    )
    parser.set_defaults(run=run_eval_tasks)


def run_eval_retrieval(args: argparse.Namespace) -> None:
    from serving.model.tokenizer import Tokenizer
    from training.reports import retrieval

    lines = args.lines or list(retrieval.DEFAULT_LINES)
    depths = args.depths or list(retrieval.DEFAULT_DEPTHS)
    tasks = retrieval.retrieval_tasks(lines, depths, args.n, args.seed)
    records = asyncio.run(
        retrieval.evaluate_retrieval(args.model, tasks, args.concurrency, args.max_tokens)
    )
    result = retrieval.report(tasks, records, Tokenizer.from_dir(args.model))
    print(retrieval.format_table(result["summary"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def add_eval_retrieval(evals: argparse._SubParsersAction) -> None:
    parser = evals.add_parser(
        "retrieval", help="long-context retrieval accuracy by log length and needle depth"
    )
    parser.add_argument("--model", type=Path, required=True, help="served in process")
    parser.add_argument(
        "--lines", type=int, nargs="+", help="log lengths, in lines (default: the domain's three)"
    )
    parser.add_argument(
        "--depths", type=float, nargs="+", help="needle depths in [0, 1] (default: the domain's)"
    )
    parser.add_argument("--n", type=int, default=10, help="tasks per length and depth")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out tasks")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48, help="the answer's budget")
    parser.add_argument("--json", type=Path, help="write the summary and every record here")
    parser.set_defaults(run=run_eval_retrieval)


def add_eval_quantization(evals: argparse._SubParsersAction) -> None:
    parser = evals.add_parser(
        "quantization", help="quantized checkpoints' KL and top-1 agreement to their model"
    )
    parser.add_argument("--full-precision", type=Path, required=True, help="the unquantized model")
    parser.add_argument(
        "--quantized", type=Path, nargs="+", required=True, help="its quantized checkpoints"
    )
    parser.add_argument("--examples", type=int, default=64, help="held-out tasks drawn")
    parser.add_argument("--style", choices=["think", "short"], default="think", help="of the turns")
    parser.set_defaults(run=run_eval_quantization)


def add_commands(sub: argparse._SubParsersAction) -> None:
    for add in (add_eval, add_train):
        add(sub)
