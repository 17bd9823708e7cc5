"""Stage configurations: one TOML file per stage, validated at the edge.

Every knob a stage has is a field here with its default; a TOML file overrides some of them,
and `--set key=value` on the command line overrides the file (for quick experiments).
Unknown keys are errors, so a typo cannot silently leave a default in force.

Two keys of a stage file are not fields: `extends = "other.toml"` takes that file's settings
(beside it) as the base this file overrides, so a variant states only how it differs; and a
`[[phase]]` list, the continuations a recipe runs one after another
(`training/recipes/phases.py`). A stage command trains a file's base settings.
"""

import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tasks import DEFAULT_DOMAINS, DOMAINS

T = TypeVar("T")


class ConfigError(ValueError):
    """A stage configuration that does not load or validate."""


def check_domains(names: Iterable[str]) -> None:
    unknown = set(names) - set(DOMAINS)
    if unknown:
        raise ValueError(f"unknown domains {sorted(unknown)}; choose from {sorted(DOMAINS)}")


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)


class TrainConfig(BaseModel):
    """What the trainer itself needs, whatever the stage."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, ge=1)
    micro_batch: int = Field(8, ge=1)  # sequences per process per forward
    grad_accum: int = Field(1, ge=1)
    seq_len: int = Field(512, ge=8)
    # bf16: mixed precision by autocast; auto: bf16 where the device computes it natively
    dtype: Literal["fp32", "bf16", "auto"] = "fp32"
    zero_stage: int = Field(0, ge=0, le=2)
    seed: int = 0
    optim: OptimConfig = OptimConfig()
    aux_loss_coef: float = Field(0.01, ge=0)  # MoE load balancing (Switch / Mixtral)
    z_loss_coef: float = Field(1e-3, ge=0)  # router z-loss (ST-MoE)
    mtp_weight: float = Field(0.0, ge=0)  # lambda of the MTP loss; 0 trains no MTP
    # SFT: the loss weight of copy positions (values copied from the prompt or a tool result).
    # Copying a code whole needs every character right: a small loss a character still loses
    # many whole codes, so those positions can weigh more.
    copy_weight: float = Field(1.0, ge=1)
    save_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_every: int = Field(0, ge=0)  # 0: evaluate only at the end
    eval_n: int = Field(4, ge=1)  # held-out tasks per domain and difficulty
    eval_difficulties: list[int] = [1]
    eval_max_tokens: int = Field(384, ge=1)


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    examples: int = Field(2000, ge=1)  # tasks drawn to build the dataset
    mix: dict[str, float] = {"math": 0.35, "code": 0.25, "terminal": 0.2, "tools": 0.2}
    difficulties: list[int] = [1, 2, 3]
    seed: int = 0  # the first training seed; tasks use seeds seed, seed+1, ...
    natural: float = Field(0.0, ge=0, le=1)  # share of tasks with a reworded prompt
    out_of_domain: float = Field(0.0, ge=0, le=1)  # share of requests outside the domains
    copy_docs: float = Field(0.0, ge=0, le=1)  # pretrain: share of copy-dense documents
    # SFT: share of tool chains whose code is redrawn from merged pieces (`code_pieces`)
    merged_codes: float = Field(0.0, ge=0, le=1)
    # SFT: share of examples that drill copying a chain's code (`copy_drills`)
    copy_drills: float = Field(0.0, ge=0, le=1)

    @field_validator("mix")
    @classmethod
    def _known_domains(cls, mix: dict[str, float]) -> dict[str, float]:
        check_domains(mix)
        if not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise ValueError("mix weights must be non-negative with a positive sum")
        return mix

    @model_validator(mode="after")
    def _shares_fit(self) -> "DataConfig":
        if self.out_of_domain + self.copy_drills > 1:
            raise ValueError("out_of_domain + copy_drills must be at most 1")
        return self


class DPOConfig(BaseModel):
    """Multi-objective preference pairs from the `init` model's samples
    (training/objectives/preference.py)."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(4, ge=2)  # answers sampled per task to pick a pair from
    max_tokens: int = Field(256, ge=1)
    beta: float = Field(0.1, gt=0)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    margin: float = Field(0.05, ge=0)  # the least weighted-score gap that makes a pair
    weights: dict[str, float] = {"correctness": 1.0, "format": 0.3, "brevity": 0.2, "quality": 0.2}
    eval_tasks: int = Field(16, ge=1)  # held-out tasks for the before/after win rates


# Each objective's weight in a merged reward: correctness first, the others shaping.
MERGE_WEIGHTS = {"correctness": 1.0, "chain": 0.3, "maintainability": 0.3, "steps": 0.3}


class RewardModelConfig(BaseModel):
    """Reward models per objective (training/objectives/reward_model.py), on pairs of the
    `init` model's own answers ranked by each objective's judge."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(8, ge=2)  # answers sampled per task
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_turns: int = Field(8, ge=1)  # terminal and tool episodes run their turns
    pairs_per_task: int = Field(4, ge=1)  # per objective: (better, worse) answers drawn
    margin: float = Field(0.05, ge=0)  # the least score gap that makes a pair
    # the merged reward: each objective's weight (the judges' weighted sum ranks its pairs)
    weights: dict[str, float] = MERGE_WEIGHTS
    eval_tasks: int = Field(64, ge=1)  # held-out tasks whose pairs measure each head


class RLConfig(BaseModel):
    """GRPO with DAPO's refinements (training/objectives/grpo.py)."""

    model_config = ConfigDict(extra="forbid")

    tasks_per_step: int = Field(8, ge=1)  # per process
    group_size: int = Field(8, ge=2)  # answers sampled per task
    max_tokens: int = Field(256, ge=1)  # per assistant turn
    max_turns: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    eps_low: float = Field(0.2, gt=0, lt=1)
    eps_high: float = Field(0.28, gt=0)  # clip-higher: above eps_low
    kl_coef: float = Field(0.0, ge=0)  # 0: no KL term in the objective
    # log the k3 KL to `init` every step even without a KL term (one more forward per row)
    track_kl: bool = True
    overlong_cache: int = Field(64, ge=1)  # the penalty ramps over the budget's last tokens
    dynamic_sampling: bool = True  # drop groups whose verdicts are all equal
    # > 0: where a domain finds an answer's first false step (math: a line whose identity does
    # not hold), the advantage is placed by it and the step costs this much more
    # (training/objectives/grpo.py `located_advantages`); a dropped group's answers then
    # still train on their false steps
    step_penalty: float = Field(0.0, ge=0)
    # "think" / "short": each group also holds the domain's reference answer in that style (the
    # policy's own), scored by the verifier and trained on as one more member of the group,
    # off-policy (LUFFY's mixed-policy GRPO): a group whose sampled answers all failed then
    # still has a success to learn from. None: the sampled answers alone
    reference_style: Literal["think", "short"] | None = None
    # None: a fresh task at every draw; N: a dataset of N tasks (domains and difficulties from
    # the data config's fixed mix), visited in a new seeded order each epoch, as TRL's trainer
    # visits its dataset, so the training reward measures learning on the prompts it trains on
    prompts: int | None = Field(None, ge=1)
    domain_weighting: Literal["progress", "fixed"] = "progress"
    # A reward model (`tierserve train reward-model`'s OUT/model): each episode's merged
    # reward, standardised within its group and times `reward_model_coef`, joins its verdict
    reward_model: str | None = None
    reward_model_coef: float = Field(0.25, ge=0)
    reward_model_weights: dict[str, float] = MERGE_WEIGHTS


class CurriculumConfig(BaseModel):
    """SFT's order of examples (training/data/curriculum.py): the first difficulties alone until
    the loss at copy positions falls below a threshold, then all; each domain's share
    follows its measured loss."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    first_difficulties: list[int] = [1]
    copy_loss_threshold: float = Field(0.5, gt=0)  # the EMA of the copy-position loss
    max_first_steps: int = Field(300, ge=0)  # move on regardless after this many steps
    loss_power: float = Field(1.0, ge=0)  # share ∝ data share * loss**power; 0: data's mix
    # no domain falls below this share, or below its share of the data where that is smaller
    min_share: float = Field(0.05, ge=0, le=1)
    ema: float = Field(0.9, ge=0, lt=1)  # smoothing of the measured losses
    heldout_examples: int = Field(64, ge=1)  # copy-position loss printed with every eval


class QATConfig(BaseModel):
    """SFT and RL: train through FP4 weights (`training/stages/qat.py`) and export the FP4
    checkpoint."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["mxfp4", "nvfp4"] | None = None  # None: no quantization-aware training
    all_linear: bool = False  # attention and dense MLP projections too, not only experts


class StageBase(BaseModel):
    """What every stage's config holds: the data it sees and how it trains. Each stage adds
    its own fields in its module (`training/stages/`), so a field another stage owns is an
    unknown key there, refused like a typo."""

    model_config = ConfigDict(extra="forbid")

    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()


class FromCheckpoint(StageBase):
    """A stage that starts from (or distils) a trained checkpoint."""

    init: str  # a checkpoint directory
    style: Literal["think", "short"] = "think"  # of the turns: reasoning trace, or answer only


class TokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(ge=64)
    examples: int = Field(ge=1)  # tasks whose text trains it


class HighspeedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_layers: list[int] | None = None  # the student's decoder layers; None: all of them


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domains: list[str] = list(DEFAULT_DOMAINS)
    difficulties: list[int] = [1, 2, 3]
    n: int = Field(10, ge=1)
    seed: int = 0
    max_tokens: int = Field(512, ge=1)

    @field_validator("domains")
    @classmethod
    def _known(cls, domains: list[str]) -> list[str]:
        if not domains:
            raise ValueError(f"no domains; choose from {sorted(DOMAINS)}")
        check_domains(domains)
        return domains


class RegressionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # points a domain may lose to a post-training stage whose model is then still kept
    max_drop: float = Field(2.0, ge=0)


class RouterSpec(BaseModel):
    """The router stage: both shipped tiers play the same tasks, and the learned router
    trains on where the full tier was needed (`router/learned.py`)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 1  # an evaluation run seed other than the held-out tables' (`[eval] seed`)
    n: int = Field(200, ge=1)  # tasks per domain and difficulty
    difficulties: list[int] = [1, 2, 3]
    max_tokens: int = Field(512, ge=1)
    target_full_share: float = Field(0.3, ge=0, le=1)


# The chain's stages in the order they run; a recipe names the ones it has (`stages`).
RECIPE_STAGES = (
    "tokenizer",
    "pretrain",
    "sft-think",
    "sft-short",
    "qat-short",
    "rl-short",
    "mtp-short",
    "dpo",
    "rl",
    "draft",
    "router",
    "gate",
)
REQUIRED_STAGES = ("tokenizer", "pretrain", "sft-think", "sft-short", "draft")


class RecipeConfig(BaseModel):
    """A recipe's `recipe.toml`: what is not one stage's (the stages have their own TOMLs)."""

    model_config = ConfigDict(extra="forbid")

    stages: list[str]
    tokenizer: TokenizerSpec
    highspeed: HighspeedSpec = HighspeedSpec()
    # Recommended sampling (temperature, top_p, top_k...) for each model's generation_config.json
    generation: dict[str, float | int] = {}
    eval: EvalSpec = EvalSpec()
    draft_agreement: DataConfig = DataConfig(examples=200, seed=1_000_000_000)
    regression: RegressionSpec = RegressionSpec()
    router: RouterSpec = RouterSpec()

    @field_validator("stages")
    @classmethod
    def _a_chain(cls, stages: list[str]) -> list[str]:
        unknown = [s for s in stages if s not in RECIPE_STAGES]
        if unknown:
            raise ValueError(f"unknown stages {unknown}; choose from {list(RECIPE_STAGES)}")
        missing = [s for s in REQUIRED_STAGES if s not in stages]
        if missing:
            raise ValueError(f"a recipe needs the stages {missing}")
        if stages != sorted(set(stages), key=RECIPE_STAGES.index):
            raise ValueError(f"stages run once each, in the order {list(RECIPE_STAGES)}")
        return stages


def load_recipe_config(path: Path) -> RecipeConfig:
    try:
        return RecipeConfig.model_validate(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    except ValidationError as e:
        raise ConfigError(f"{path}: invalid recipe:\n{e}") from e


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a table")
    node[leaf] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`key.sub=value` with a TOML value (`train.steps=50`, `style="short"`); bare words are
    strings."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected key=value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    return key.strip(), value


def merged(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """`layer` over `base`, table by table: `{train = {steps = 5}}` keeps the base's other
    `train` keys."""
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def read_stage_file(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A stage file's base settings (with what it `extends` under them) and its `[[phase]]`
    list; the extended file's own phases are not this file's."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    phases = raw.pop("phase", [])
    if not isinstance(phases, list) or not all(isinstance(p, dict) for p in phases):
        raise ConfigError(f"{path}: `phase` must be a list of tables ([[phase]])")
    parent = raw.pop("extends", None)
    if parent is not None:
        if not isinstance(parent, str) or (path.parent / parent).resolve() == path.resolve():
            raise ConfigError(f"{path}: `extends` names another TOML file beside it")
        raw = merged(read_stage_file(path.parent / parent)[0], raw)
    return raw, phases


def load_config(
    path: str | Path | None,
    overrides: list[str] | None,
    validate: Callable[[dict[str, Any]], T],
    layers: Iterable[dict[str, Any]] = (),
    **defaults: Any,
) -> T:
    """`defaults`, then the TOML file at `path`, then each of `layers` (a recipe phase's
    settings), then `--set` overrides, validated."""
    raw: dict[str, Any] = dict(defaults)
    if path is not None:
        raw.update(read_stage_file(path)[0])
    for layer in layers:
        raw = merged(raw, layer)
    for item in overrides or []:
        _set_dotted(raw, *parse_override(item))
    try:
        return validate(raw)
    except ValidationError as e:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}invalid stage config:\n{e}") from e
