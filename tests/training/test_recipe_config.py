"""recipe.toml is validated like the stage configs: a bad one is a one-line ConfigError."""

from pathlib import Path

import pytest

from training.config import ConfigError, load_recipe_config
from training.recipes.run import recipe_dir


@pytest.mark.parametrize("name", ["demo", "smoke"])
def test_the_shipped_recipes_load(name: str) -> None:
    recipe = load_recipe_config(recipe_dir(name) / "recipe.toml")
    assert recipe.tokenizer.vocab_size > 0
    assert recipe.highspeed.keep_layers


def test_a_recipe_needs_only_its_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text("[tokenizer]\nvocab_size = 600\nexamples = 60\n")
    recipe = load_recipe_config(path)
    assert recipe.highspeed.keep_layers is None  # the student keeps every layer
    assert recipe.regression.max_drop == 2.0
    assert recipe.eval.domains == ["math", "code", "terminal", "tools"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[highspeed]\nkeep_layers = [0]\n", "tokenizer"),
        ("[tokenizer]\nvocab_size = 600\nexamples = 60\n[eval]\ndomains = ['poetry']\n", "poetry"),
        ("[tokenizer]\nvocab_size = 600\nexamples = 60\n[highspeed]\nkeep = [0]\n", "keep"),
        ("[tokenizer\n", "recipe.toml"),
    ],
)
def test_a_bad_recipe_names_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_recipe_config(path)
