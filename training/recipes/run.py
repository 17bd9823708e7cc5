"""Recipes: the whole chain from nothing to the shipped models, in one command.

A recipe is a directory of small TOML files (`training/recipes/NAME/`): `recipe.toml` names
its stages (`stages`, in the order of `training.config.RECIPE_STAGES`) and what is not one
stage's; each training stage has its own file, whose `[[phase]]` list, where it has one, is the
chain of continuations that stage is (`phases.py`). The chain:

tokenizer -> pretrain (the base MoE, with MTP) -> sft-think, the full tier's SFT curriculum
(with RL runs between its phases where the recipe has them) -> sft-short, the highspeed student:
the think-style model cut to some of its decoder layers (`[highspeed] keep_layers`), fine-tuned
in the short style and distilled from think-style models -> qat-short, quantization-aware SFT
of the student, stored as FP4 -> rl-short, the student's RL through those FP4 weights, kept
only when it loses no domain (`gate.py`) -> mtp-short, the highspeed model's MTP head trained
alone on its own greedy answers -> dpo, rl: the full tier's post-training, each evaluated on
held-out tasks against the model before it and kept only when it loses no domain -> draft, a
dense drafter distilled from the full model that ships -> router, the learned router trained on
both tiers' outcomes -> gate: the tiers replace the models under
`--models` only when they lose no domain to them -> the models, with their cards.

Every run of the chain is planned and validated before the first trains; rerunning the command
skips finished runs and resumes the interrupted one from its last checkpoint. One progress bar
covers the whole run (`training/stages/progress.py`).
"""

import json
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tasks import harness
from training.config import RecipeConfig, load_recipe_config
from training.recipes.evaluation import draft_agreement, evaluate_model, mean_completion
from training.recipes.gate import GateError, post_training_verdict, replacement_regressions
from training.recipes.phases import Run, plan_stage, run_stage_runs
from training.recipes.publish import publish, size_mb
from training.recipes.router_stage import train_router
from training.recipes.tokenizer import build_tokenizer
from training.stages import progress
from training.stages.run import run_stage

RECIPES = resources.files("training") / "recipes"
STAGE_FILES = {
    "pretrain": "pretrain.toml",
    "sft-think": "sft.toml",
    "sft-short": "sft-short.toml",
    "qat-short": "qat.toml",
    "rl-short": "rl-short.toml",
    "mtp-short": "mtp.toml",
    "dpo": "dpo.toml",
    "rl": "rl.toml",
    "draft": "draft.toml",
}
POST_TRAINING = ("dpo", "rl")  # in this order, each from the one kept before it
STUDENT_STAGES = ("sft-short", "qat-short")  # the highspeed student, before its RL
HIGHSPEED_STAGES = (*STUDENT_STAGES, "rl-short")  # each from the one before
TIERS = ("full", "highspeed", "draft")


def recipe_dir(name: str) -> Path:
    path = Path(str(RECIPES / name))
    if not (path / "recipe.toml").is_file():
        known = sorted(p.parent.name for p in Path(str(RECIPES)).glob("*/recipe.toml"))
        raise ValueError(f"unknown recipe {name!r}; choose from {', '.join(known)}")
    return path


def wiring(stage: str, work: Path, recipe: RecipeConfig, full: Path, short: Path) -> dict[str, Any]:
    """What the chain gives a stage's first run: the model it starts from, and for the
    student its layers and teacher; `full` and `short` are the full-tier and highspeed models
    the late stages start from."""
    model = {s: str(work / s / "model") for s in STAGE_FILES}
    student = last_stage(recipe, STUDENT_STAGES)
    return {
        "pretrain": {"tokenizer": str(work / "tokenizer")},
        "sft-think": {"init": model["pretrain"], "style": "think"},
        "sft-short": {
            "init": model["sft-think"],
            "style": "short",
            "keep_layers": recipe.highspeed.keep_layers,
            "teacher": model["sft-think"],
        },
        "qat-short": {"init": model["sft-short"], "style": "short"},
        "rl-short": {"init": model[student], "style": "short"},
        "mtp-short": {"init": str(short), "style": "short"},
    }.get(stage, {"init": str(full)})


def last_stage(recipe: RecipeConfig, stages: tuple[str, ...]) -> str:
    """The last of `stages` the recipe has."""
    return [s for s in stages if s in recipe.stages][-1]


def plan(src: Path, work: Path, recipe: RecipeConfig) -> dict[str, list[Run]]:
    """Every training run of the recipe, validated, in order (the late stages as if they
    start from the full tier's SFT model and the last highspeed stage's: which models they
    start from is decided as it runs)."""
    known: set[str] = {"tokenizer"}
    full = work / "sft-think" / "model"
    short = work / last_stage(recipe, HIGHSPEED_STAGES) / "model"
    return {
        stage: plan_stage(
            src, work, stage, STAGE_FILES[stage], wiring(stage, work, recipe, full, short), known
        )
        for stage in recipe.stages
        if stage in STAGE_FILES
    }


class Chain:
    """One recipe run: trains the stages as the plan has them, keeps what each measured."""

    def __init__(self, name: str, work: Path, models: Path) -> None:
        self.name, self.work, self.models = name, work, models
        self.src = recipe_dir(name)
        self.recipe = load_recipe_config(self.src / "recipe.toml")
        self.plan = plan(self.src, work, self.recipe)
        self.known: set[str] = {"tokenizer"}
        self.timings: dict[str, float] = {}
        self.evals: dict[str, list[dict]] = {}
        # What the run decides as it goes: the full-tier stages kept by the gate (and why the
        # others were not), the one that ships, the student's stages, what was measured.
        self.kept, self.rejected, self.best = ["sft-think"], {}, "sft-think"
        self.short_stages: list[str] = []
        self.agreement = 0.0
        self.tables: dict[str, str] = {}

    def has(self, stage: str) -> bool:
        return stage in self.recipe.stages

    def timed(self, stage: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        result = fn()
        self.timings[stage] = self.timings.get(stage, 0.0) + time.monotonic() - t0
        return result

    def train(self, stage: str, full: Path | None = None) -> Path:
        """Run `stage` (every phase); returns its model directory."""
        full = full or self.work / "sft-think" / "model"
        kept = self.short_stages or [last_stage(self.recipe, HIGHSPEED_STAGES)]
        short = self.work / kept[-1] / "model"
        runs = plan_stage(
            self.src,
            self.work,
            stage,
            STAGE_FILES[stage],
            wiring(stage, self.work, self.recipe, full, short),
            self.known,
        )
        self.plan[stage] = runs
        stage_dir = self.work / stage
        return self.timed(stage, lambda: run_stage_runs(runs, stage_dir, run_stage, progress.begin))

    def evaluate(self, stage: str) -> list[dict]:
        progress.note(f"held-out evaluation of {stage}")
        out = self.work / f"eval-{stage}.json"
        rows = self.timed(
            f"eval-{stage}",
            lambda: evaluate_model(self.work / stage / "model", self.recipe.eval, out),
        )
        self.evals[stage] = rows
        return rows

    def chain_lines(self, stages: list[str]) -> str:
        runs = [run for stage in stages for run in self.plan[stage]]
        return "\n".join(f"1. `{run.name}`: {run.steps} {run.config.stage} steps" for run in runs)


def run_recipe(name: str, work: Path, models: Path) -> dict[str, Path]:
    """Run recipe `name` with its stages under `work`, publish its models under `models`."""
    chain = Chain(name, work, models)
    runs = [run for stage_runs in chain.plan.values() for run in stage_runs]
    total, done = sum(r.steps for r in runs), sum(r.steps_done() for r in runs)
    started = time.monotonic()
    with progress.run_progress(total, done):
        published, failures = _run(chain)
    summary = _summary(chain, published, failures, started)
    (work / "recipe-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "tables"}, indent=1))
    for tier, table in summary["tables"].items():
        print(f"\n{name}-{tier}:\n{table}")
    if failures:
        lost = "; ".join(f"{tier}: {', '.join(f)}" for tier, f in failures.items())
        raise GateError(
            f"not published to {models}: the new tiers lose to the models there ({lost}); "
            f"they are under {published['full'].parent}"
        )
    return published


def _run(chain: Chain) -> tuple[dict[str, Path], dict[str, list[str]]]:
    """Every stage in order; returns the published tiers and the final gate's failures."""
    recipe, work = chain.recipe, chain.work
    progress.note("tokenizer")
    tok = recipe.tokenizer
    chain.timed(
        "tokenizer", lambda: build_tokenizer(work / "tokenizer", tok.vocab_size, tok.examples)
    )
    for stage in ("pretrain", "sft-think", "sft-short", "qat-short"):
        if chain.has(stage):
            chain.train(stage)
    chain.short_stages = [s for s in STUDENT_STAGES if chain.has(s)]
    for stage in ("sft-think", *chain.short_stages):
        chain.evaluate(stage)
    if chain.has("rl-short"):
        chain.train("rl-short")
        _keep_if_no_domain_lost(chain, "rl-short", chain.short_stages)
    shipped_short = work / chain.short_stages[-1] / "model"
    if chain.has("mtp-short"):  # the head alone: the main model evaluated above ships
        shipped_short = chain.train("mtp-short")
    _post_train(chain)
    full = work / chain.best / "model"
    models = {"full": full, "highspeed": shipped_short, "draft": chain.train("draft", full)}
    router = None
    if chain.has("router"):
        progress.note("router: both tiers play the router's tasks")
        router = chain.timed(
            "router",
            lambda: train_router(
                models, recipe.eval.domains, recipe.router, work / "router", evaluate_model
            ),
        )
    failures = _gate(chain) if chain.has("gate") else {}
    progress.note("agreement of the drafter")
    chain.agreement = draft_agreement(models["draft"], full, recipe.draft_agreement, 1024)
    dest = work / "candidates" if failures else chain.models
    return _publish(chain, models, router, dest), failures


def _post_train(chain: Chain) -> None:
    """DPO and RL, each from the model kept before it, each kept only if it loses no domain;
    the full tier ships the kept model with the best mean completion."""
    for stage in (s for s in POST_TRAINING if chain.has(s)):
        chain.train(stage, chain.work / chain.kept[-1] / "model")
        _keep_if_no_domain_lost(chain, stage, chain.kept)
    chain.best = max(chain.kept, key=lambda s: mean_completion(chain.evals[s]))


def _keep_if_no_domain_lost(chain: Chain, stage: str, kept: list[str]) -> None:
    """Evaluate a post-training stage against the last of `kept`, its tier's chain so far,
    and add it there only when it loses no domain."""
    before = kept[-1]
    rows = chain.evaluate(stage)
    verdict = post_training_verdict(
        rows, chain.evals[before], before, chain.recipe.regression.max_drop
    )
    if verdict is None:
        kept.append(stage)
    else:
        chain.rejected[stage] = verdict
        tqdm.write(f"regression gate: {stage} not kept, {verdict}")


def _gate(chain: Chain) -> dict[str, list[str]]:
    """The domains each new tier loses to the model under `--models` it would replace."""
    progress.note("gate: the models to be replaced play the held-out tasks")
    new = {"full": chain.evals[chain.best], "highspeed": chain.evals[chain.short_stages[-1]]}
    replaced = {tier: chain.models / f"{chain.name}-{tier}" for tier in new}
    spec, max_drop = chain.recipe.eval, chain.recipe.regression.max_drop
    return chain.timed(
        "gate",
        lambda: replacement_regressions(
            new,
            replaced,
            lambda m, out: evaluate_model(m, spec, out),
            chain.work / "gate",
            max_drop,
        ),
    )


def _publish(
    chain: Chain, models: dict[str, Path], router: Path | None, dest: Path
) -> dict[str, Path]:
    name, recipe = chain.name, chain.recipe
    tables = _tables(chain)
    lineage = {
        "full": ["pretrain", "sft-think", *chain.kept[1 : chain.kept.index(chain.best) + 1]],
        "highspeed": ["pretrain", "sft-think", *chain.short_stages]
        + (["mtp-short"] if chain.has("mtp-short") else []),
        "draft": ["draft"],
    }
    hows = {
        "full": "The full tier: the base MoE fine-tuned on step-by-step reasoning traces "
        "(`<think>...</think>` before the answer) of the four task domains through the SFT "
        f"curriculum's runs, then post-trained ({' -> '.join(chain.kept)}); the `{chain.best}` "
        "model ships.",
        "highspeed": "The highspeed tier: a full-tier SFT model cut to its decoder layers "
        f"{recipe.highspeed.keep_layers or 'all'}, fine-tuned on short direct answers of the same "
        "tasks and distilled from full-tier models' reasoned ones"
        + (", then trained through FP4 expert weights and stored as FP4" * chain.has("qat-short"))
        + (
            "; then RL-trained on the verifiers' rewards, sampling and training through those "
            "FP4 weights" * ("rl-short" in chain.short_stages)
        )
        + ("; its MTP head then trained alone on its own greedy answers" * chain.has("mtp-short"))
        + ".",
        "draft": f"A dense drafter distilled from `{name}-full`'s next-token distributions, "
        "for speculative decoding. Greedy agreement with the full model on held-out "
        f"completion tokens: {chain.agreement:.1%}.",
    }
    command = f"tierserve train recipe {name}"
    published = {tier: dest / f"{name}-{tier}" for tier in TIERS}
    for tier in TIERS:
        table = tables.get(tier, "(not evaluated on the domains: a drafter, see above)")
        publish(
            models[tier],
            published[tier],
            recipe.generation,
            f"{name}-{tier}",
            hows[tier],
            chain.chain_lines(lineage[tier]),
            table,
            command,
        )
    if router is not None:
        (dest / "router.npz").write_bytes(router.read_bytes())
    chain.tables = tables
    return published


def _tables(chain: Chain) -> dict[str, str]:
    def table(stages: tuple[str, ...], shipped: str) -> str:
        def heading(stage: str) -> str:
            if stage in chain.rejected:
                return f"{stage} (not kept: {chain.rejected[stage]})"
            return f"{stage}{' (shipped)' if stage == shipped else ''}"

        return "\n\n".join(
            f"### {heading(s)}\n\n{harness.format_table(chain.evals[s])}"
            for s in stages
            if s in chain.evals
        )

    return {
        "full": table(("sft-think", *POST_TRAINING), chain.best),
        "highspeed": table(HIGHSPEED_STAGES, chain.short_stages[-1]),
    }


def _summary(
    chain: Chain, published: dict[str, Path], failures: dict[str, list[str]], started: float
) -> dict[str, Any]:
    return {
        "recipe": chain.name,
        "minutes": (time.monotonic() - started) / 60,
        "stage_seconds": chain.timings,
        "runs": {run.name: run.steps for runs in chain.plan.values() for run in runs},
        "draft_agreement": chain.agreement,
        "full_stages": chain.kept,
        "shipped_full": chain.best,
        "rejected": chain.rejected,
        "published_to": str(published["full"].parent),
        "not_published": failures,
        "sizes_mb": {tier: size_mb(path) for tier, path in published.items()},
        "tables": chain.tables,
    }
