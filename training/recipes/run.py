"""Recipes: the whole chain from nothing to the three shipped models.

tokenizer -> pretrain (the base MoE, with MTP) -> SFT in the think style (the full tier) ->
the highspeed student: the think-style model cut to some of its decoder layers (`[highspeed]
keep_layers` in recipe.toml), fine-tuned in the short style and distilled from the think-style
model -> with a `qat.toml`, quantization-aware SFT of the student, whose FP4 export is the
highspeed tier that ships -> with an `mtp.toml`, that model's MTP head trained alone on its own
greedy answers -> the full
tier's post-training stages that the recipe has (`dpo.toml`, `rl.toml`), each evaluated on
held-out tasks against the model before it -> a dense drafter distilled from the full model
that ships -> model cards with every stage's table, and the three Hugging Face directories
under `models/`. Every stage resumes where it stopped when the recipe is run again. A recipe
is a directory of TOML files (`training/recipes/NAME/`).

The regression gate: a post-training stage's model is kept only when no domain completes
fewer held-out tasks than the model before it by more than `[regression] max_drop` points;
otherwise the next stage starts from the model before it, and the card says which stage was
not kept and why. The full tier ships the kept stage with the best mean completion.
"""

import asyncio
import json
import shutil
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from serving.model.checkpoint import load_checkpoint
from serving.model.tokenizer import Tokenizer
from tasks import harness
from training.config import DataConfig, RecipeConfig, load_recipe_config
from training.data.datasets import IGNORE, SFTDataset, build_sft, chat_examples
from training.data.tokenizer import PAD_TOKEN, save_tokenizer, train_tokenizer
from training.reports.evaluation import evaluate_checkpoint
from training.stages.run import load_stage_config, run_stage

RECIPES = resources.files("training") / "recipes"
POST_TRAINING = ("dpo", "rl")  # in this order, each from the one before


def recipe_dir(name: str) -> Path:
    path = Path(str(RECIPES / name))
    if not (path / "recipe.toml").is_file():
        known = sorted(p.name for p in Path(str(RECIPES)).iterdir() if p.is_dir())
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(known)}")
    return path


def tokenizer_corpus(data: DataConfig) -> Any:
    """Every kind of text the models see: turns of both styles, observations, tool schemas."""
    for style in ("think", "short"):
        for example in chat_examples(data, style):
            for message in example["messages"]:
                if message.get("content") and message["role"] != "assistant":
                    yield message["content"]
            for _, turn in example["turns"]:
                yield turn
            for tool in example.get("tools") or []:
                yield json.dumps(tool, ensure_ascii=False)


def build_tokenizer(out: Path, vocab_size: int, examples: int) -> Path:
    if (out / "tokenizer.json").exists():
        return out
    corpus = tqdm(tokenizer_corpus(DataConfig(examples=examples)), desc="tokenizer corpus")
    save_tokenizer(train_tokenizer(corpus, vocab_size), out)
    return out


def draft_agreement(draft_dir: Path, full_dir: Path, data: DataConfig, seq_len: int) -> float:
    """Share of completion positions where the drafter's greedy next token is the full
    model's, teacher-forced on reference turns of tasks neither model trained on (training
    seeds past the ones the recipe used: the evaluation seed space is reserved for eval)."""
    tokenizer = Tokenizer.from_dir(full_dir)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_sft(data, "think", tokenizer, Path(tmp) / "agreement.jsonl", seq_len)
        dataset = SFTDataset(path, tokenizer.raw.token_to_id(PAD_TOKEN))
    draft, full = load_checkpoint(draft_dir), load_checkpoint(full_dir)
    agree = total = 0
    with torch.inference_mode():
        for start in range(0, len(dataset), 8):
            batch = dataset.collate(list(range(start, min(start + 8, len(dataset)))))
            keep = batch.labels != IGNORE
            guesses = [
                m.compute_logits(
                    m(batch.input_ids, batch.positions, padding_mask=batch.padding_mask)
                ).argmax(-1)[keep]
                for m in (draft, full)
            ]
            agree += int((guesses[0] == guesses[1]).sum())
            total += int(keep.sum())
    return agree / total


def evaluate_model(model_dir: Path, recipe: RecipeConfig, out: Path) -> list[dict]:
    spec = recipe.eval
    records = asyncio.run(
        evaluate_checkpoint(
            str(model_dir),
            spec.domains,
            spec.difficulties,
            spec.n,
            spec.seed,
            8,
            max_tokens=spec.max_tokens,
        )
    )
    report = harness.report(records)
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report["summary"]


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6


def recommend_sampling(model_dir: Path, settings: dict[str, float | int]) -> None:
    """Add the recipe's recommended sampling settings to generation_config.json, which the
    engine applies to requests that leave them unset (`--generation-config auto`)."""
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | settings, indent=2) + "\n")


def write_card(model_dir: Path, title: str, how: str, table: str, command: str) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    params = sum(
        p.numel() for p in load_checkpoint(model_dir, keep_fp4=False).parameters()
    )  # tied: once
    card = (
        f"# {title}\n\n{how}\n\n"
        f"- architecture: `{config['architectures'][0]}`, {params / 1e6:.2f}M parameters, "
        f"stored in {config['dtype']} ({_size_mb(model_dir):.1f} MB)\n"
        f"- made by: `{command}`\n\n"
        f"## Held-out evaluation\n\n{table}\n"
    )
    (model_dir / "README.md").write_text(card)


def _mean_completion(rows: list[dict]) -> float:
    overall = [r["completion_rate"] for r in rows if r["difficulty"] == "all"]
    return sum(overall) / len(overall)


def _student_fields(full_sft: Path, recipe: RecipeConfig) -> dict[str, Any]:
    """The highspeed model's SFT: the full tier's SFT model cut to `[highspeed] keep_layers`,
    trained on short answers and distilled from that model's reasoned ones."""
    return {
        "init": str(full_sft),
        "style": "short",
        "keep_layers": recipe.highspeed.keep_layers,
        "teacher": str(full_sft),
    }


def run_recipe(name: str, work: Path, models: Path) -> dict[str, Path]:
    """Run recipe `name` with its stages under `work`, publish its models under `models`."""
    src = recipe_dir(name)
    recipe = load_recipe_config(src / "recipe.toml")
    started = time.monotonic()
    timings: dict[str, float] = {}

    def timed(stage: str, fn):
        t0 = time.monotonic()
        result = fn()
        timings[stage] = time.monotonic() - t0
        return result

    tok = timed(
        "tokenizer",
        lambda: build_tokenizer(
            work / "tokenizer", recipe.tokenizer.vocab_size, recipe.tokenizer.examples
        ),
    )
    stages = [
        ("pretrain", "pretrain.toml", {"tokenizer": str(tok)}),
        ("sft-think", "sft.toml", {"init": str(work / "pretrain" / "model"), "style": "think"}),
        ("sft-short", "sft.toml", _student_fields(work / "sft-think" / "model", recipe)),
    ]
    short_stages = ["sft-short"]
    if (src / "qat.toml").exists():
        fields = {"init": str(work / "sft-short" / "model"), "style": "short"}
        stages.append(("qat-short", "qat.toml", fields))
        short_stages.append("qat-short")
    for stage, file, fields in stages:
        config = load_stage_config(src / file, **fields)
        timed(stage, lambda config=config, stage=stage: run_stage(config, work / stage))
    evals = {
        stage: timed(
            f"eval-{stage}",
            lambda s=stage: evaluate_model(work / s / "model", recipe, work / f"eval-{s}.json"),
        )
        for stage in ("sft-think", *short_stages)
    }
    # The highspeed model's MTP head alone: the main model evaluated above is what ships.
    mtp = (src / "mtp.toml").exists()
    shipped_short = work / ("mtp-short" if mtp else short_stages[-1]) / "model"
    if mtp:
        fields = {"init": str(work / short_stages[-1] / "model"), "style": "short"}
        config = load_stage_config(src / "mtp.toml", **fields)
        timed("mtp-short", lambda: run_stage(config, work / "mtp-short"))
    full_stages = ["sft-think"]  # the kept ones
    rejected: dict[str, str] = {}  # a stage the gate did not keep -> why
    for stage in (s for s in POST_TRAINING if (src / f"{s}.toml").exists()):
        before = full_stages[-1]
        config = load_stage_config(src / f"{stage}.toml", init=str(work / before / "model"))
        timed(stage, lambda config=config, stage=stage: run_stage(config, work / stage))
        evals[stage] = timed(
            f"eval-{stage}",
            lambda s=stage: evaluate_model(work / s / "model", recipe, work / f"eval-{s}.json"),
        )
        failures = harness.regressions(
            evals[stage], {"summary": evals[before]}, recipe.regression.max_drop
        )
        if failures:
            rejected[stage] = f"against {before}: " + "; ".join(failures)
            print(f"regression gate: {stage} not kept, {rejected[stage]}", flush=True)
        else:
            full_stages.append(stage)
    best = max(full_stages, key=lambda s: _mean_completion(evals[s]))
    full = work / best / "model"
    config = load_stage_config(src / "draft.toml", init=str(full))
    timed("draft", lambda: run_stage(config, work / "draft"))
    draft = work / "draft" / "model"
    published = {tier: models / f"{name}-{tier}" for tier in ("full", "highspeed", "draft")}
    command = f"tierserve train recipe {name}"

    def heading(stage: str) -> str:
        if stage in rejected:
            return f"{stage} (not kept: {rejected[stage]})"
        return f"{stage}{' (shipped)' if stage == best else ''}"

    evaluated = [s for s in ("sft-think", *POST_TRAINING) if s in evals]
    tables = {
        "full": "\n\n".join(
            f"### {heading(s)}\n\n{harness.format_table(evals[s])}" for s in evaluated
        ),
        "highspeed": "\n\n".join(
            f"### {s}{' (shipped)' if s == short_stages[-1] else ''}\n\n"
            f"{harness.format_table(evals[s])}"
            for s in short_stages
        ),
    }
    agreement = draft_agreement(draft, full, recipe.draft_agreement, 1024)
    hows = {
        "full": "The full tier: the base MoE fine-tuned on step-by-step reasoning traces "
        "(`<think>...</think>` before the answer) of the four task domains, then "
        f"post-trained ({' -> '.join(full_stages)}); the `{best}` model ships.",
        "highspeed": "The highspeed tier: the full tier's SFT model cut to its decoder layers "
        f"{recipe.highspeed.keep_layers or 'all'}, fine-tuned on short direct answers of the same "
        "tasks and distilled from the full tier's reasoned ones"
        + (
            ", then trained through FP4 expert weights (quantization-aware) and stored as FP4"
            if "qat-short" in short_stages
            else ""
        )
        + ("; its MTP head then trained alone on the model's own greedy answers." if mtp else "."),
        "draft": f"A dense drafter distilled from `{name}-full`'s next-token distributions, "
        "for speculative decoding. Greedy agreement with the full model on held-out "
        f"completion tokens: {agreement:.1%}.",
    }
    for tier, model_dir in (("full", full), ("highspeed", shipped_short), ("draft", draft)):
        target = published[tier]
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(model_dir, target)
        recommend_sampling(target, recipe.generation)
        table = tables.get(tier, "(not evaluated on the domains: a drafter, see above)")
        write_card(target, f"{name}-{tier}", hows[tier], table, command)
    summary = {
        "recipe": name,
        "minutes": (time.monotonic() - started) / 60,
        "stage_seconds": timings,
        "draft_agreement": agreement,
        "full_stages": full_stages,
        "shipped_full": best,
        "rejected": rejected,
        "sizes_mb": {tier: _size_mb(path) for tier, path in published.items()},
        "tables": tables,
    }
    (work / "recipe-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "tables"}, indent=1))
    for tier, table in tables.items():
        print(f"\n{name}-{tier}:\n{table}")
    return published
