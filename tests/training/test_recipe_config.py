"""recipe.toml and the stage files' phases are validated like the stage configs: a bad one is
a ConfigError naming what is wrong, raised when the plan is made, before anything trains."""

import itertools
from pathlib import Path

import pytest

from training.config import ConfigError, load_config, load_recipe_config, read_stage_file
from training.recipes.run import STAGE_FILES, plan, recipe_dir

TOKENIZER = "[tokenizer]\nvocab_size = 600\nexamples = 60\n"
STAGES = 'stages = ["tokenizer", "pretrain", "sft-think", "sft-short", "draft"]\n'


def _plan(name: str, work: Path = Path("/nonexistent/work")) -> dict:
    src = recipe_dir(name)
    return plan(src, work, load_recipe_config(src / "recipe.toml"))


@pytest.mark.parametrize("name", ["demo", "smoke"])
def test_the_shipped_recipes_load_and_plan(name: str) -> None:
    recipe = load_recipe_config(recipe_dir(name) / "recipe.toml")
    assert recipe.tokenizer.vocab_size > 0
    assert recipe.highspeed.keep_layers
    runs = _plan(name)
    assert list(runs) == [s for s in recipe.stages if s in STAGE_FILES]


def test_smoke_covers_every_stage_and_kind_of_phase_of_demo() -> None:
    demo, smoke = (load_recipe_config(recipe_dir(n) / "recipe.toml") for n in ("demo", "smoke"))
    assert smoke.stages == demo.stages
    demo_plan, smoke_plan = _plan("demo"), _plan("smoke")

    def kinds(runs: dict) -> set[tuple[str, str, bool, bool]]:
        """(stage, stage kind of the run, a phase?, distils a teacher?) of each run."""
        return {
            (
                stage,
                run.config.stage,
                run.phase is not None,
                bool(getattr(run.config, "teacher", 0)),
            )
            for stage, stage_runs in runs.items()
            for run in stage_runs
        }

    assert kinds(smoke_plan) == kinds(demo_plan)


def test_the_demo_curriculum_runs_from_phase_to_phase() -> None:
    work = Path("/w")
    runs = _plan("demo", work)
    think = runs["sft-think"]
    assert think[0].config.init == str(work / "pretrain" / "model")
    for before, after in itertools.pairwise(think):
        assert after.config.init == str(before.out / "model")  # each from the one before
    rl = [run for run in think if run.config.stage == "rl"]
    assert rl and all(run.config.train.optim.lr < 1e-4 for run in rl)  # rl.toml's settings
    student = runs["sft-short"][0].config
    assert student.keep_layers == [0, 2, 3]  # the recipe's wiring reaches the first phase
    assert student.init == str(work / "sft-think" / "full8" / "model") == student.teacher
    assert runs["sft-short"][1].config.qat.format == "nvfp4"  # qat.toml as a phase's base
    assert runs["sft-short"][1].config.keep_layers is None  # only the first phase prunes
    assert runs["sft-short"][2].config.teacher == str(work / "sft-think" / "full12" / "model")


def _recipe(tmp_path: Path, sft: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("recipe.toml", *STAGE_FILES.values()):
        (src / name).write_text((recipe_dir("smoke") / name).read_text())
    (src / "sft.toml").write_text(sft)
    return src


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ('[[phase]]\nname = "a"\n[[phase]]\nname = "a"\n', "two phases named 'a'"),
        ('[[phase]]\nname = "a"\ninit = "sft-think/later"\n', "names no stage or phase"),
        ('[[phase]]\nname = "a"\n[[phase]]\nname = "b"\ntrain = { stepz = 3 }\n', "stepz"),
        ('[[phase]]\nname = "Bad Name"\n', "name"),
    ],
)
def test_a_bad_phase_is_refused_when_planned(tmp_path: Path, phases: str, message: str) -> None:
    smoke_sft = (recipe_dir("smoke") / "sft.toml").read_text().split("[[phase]]")[0]
    src = _recipe(tmp_path, smoke_sft + phases)
    with pytest.raises(ConfigError, match=message):
        plan(src, tmp_path / "work", load_recipe_config(src / "recipe.toml"))


def test_a_recipe_needs_its_stages_and_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(STAGES + TOKENIZER)
    recipe = load_recipe_config(path)
    assert recipe.highspeed.keep_layers is None  # the student keeps every layer
    assert recipe.regression.max_drop == 2.0
    assert recipe.eval.domains == ["math", "code", "terminal", "tools"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (STAGES + "[highspeed]\nkeep_layers = [0]\n", "tokenizer"),
        (STAGES + TOKENIZER + "[eval]\ndomains = ['poetry']\n", "poetry"),
        (STAGES + TOKENIZER + "[highspeed]\nkeep = [0]\n", "keep"),
        ("[tokenizer\n", "recipe.toml"),
        (TOKENIZER, "stages"),
        ('stages = ["tokenizer", "pretrain", "sft-think"]\n' + TOKENIZER, "sft-short"),
        (STAGES.replace('"draft"', '"draft", "sft-short"') + TOKENIZER, "order"),
        (STAGES.replace('"draft"', '"draft", "polish"') + TOKENIZER, "polish"),
    ],
)
def test_a_bad_recipe_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('stage = "sft"\nphase = 3\n', "list of tables"),
        ('extends = "sft.toml"\n', "another TOML file"),
        ('extends = "missing.toml"\n', "missing.toml"),
    ],
)
def test_a_bad_stage_file_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "sft.toml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_stage_file(tmp_path / "sft.toml")


def test_a_file_extends_another_table_by_table(tmp_path: Path) -> None:
    (tmp_path / "base.toml").write_text(
        'stage = "sft"\n[train]\nsteps = 9\nseq_len = 64\n[[phase]]\nname = "not-mine"\n'
    )
    (tmp_path / "variant.toml").write_text('extends = "base.toml"\n[train]\nsteps = 3\n')
    raw, phases = read_stage_file(tmp_path / "variant.toml")
    assert raw == {"stage": "sft", "train": {"steps": 3, "seq_len": 64}} and phases == []


def test_an_unknown_recipe_names_the_recipes() -> None:
    """Only directories with a recipe.toml are recipes (hybrid-retrieval is stage files)."""
    with pytest.raises(ValueError, match=r"choose from demo, smoke$"):
        recipe_dir("hybrid-retrieval")


def test_the_hybrid_retrieval_stage_files_load() -> None:
    """Its pretraining holds the hybrid shape, which `init-checkpoint --shape` reads too (for
    the tokenizer the chain trains with); its SFT fine-tunes on the retrieval domain alone."""
    from training.stages.init_checkpoint import read_shape
    from training.stages.pretrain import PretrainStage
    from training.stages.sft import SFTStage

    src = Path(__file__).parents[2] / "training" / "recipes" / "hybrid-retrieval"
    pretrain = load_config(
        src / "pretrain.toml", [], PretrainStage.model_validate, tokenizer="unused"
    )
    assert pretrain.shape == read_shape(src / "pretrain.toml")
    assert pretrain.shape["architectures"] == ["Qwen3NextForCausalLM"]
    assert pretrain.data.mix == {"retrieval": 1.0} and pretrain.train.mtp_weight == 0
    sft = load_config(src / "sft.toml", [], SFTStage.model_validate, init="unused")
    assert sft.data.mix == {"retrieval": 1.0} and sft.style == "think"
