"""A checkpoint's tokenizer files as our loader reads them, and what it says when one is
missing or malformed."""

import shutil
from pathlib import Path

import pytest

from serving.model.tokenizer import ChatTemplateError, Tokenizer, TokenizerError

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def _copy(checkpoint: Path, tmp_path: Path, skip: str = "") -> Path:
    """The checkpoint's tokenizer files (not its weights), less `skip`."""
    for name in FILES:
        if name != skip:
            shutil.copy(checkpoint / name, tmp_path / name)
    return tmp_path


def test_no_template(random_checkpoint: Path, tmp_path: Path) -> None:
    path = _copy(random_checkpoint, tmp_path, skip="chat_template.jinja")
    tok = Tokenizer.from_dir(path)
    assert tok.encode("hi")  # completions still work
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_missing_files(random_checkpoint: Path, tmp_path: Path, missing: str) -> None:
    path = _copy(random_checkpoint, tmp_path, skip=missing)
    with pytest.raises(TokenizerError, match=missing):
        Tokenizer.from_dir(path)
    with pytest.raises(TokenizerError, match="not a checkpoint directory"):
        Tokenizer.from_dir(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("tokenizer.json", "{not json", "tokenizer.json is malformed"),
        ("tokenizer_config.json", "{not json", "not valid JSON"),
        ("tokenizer_config.json", "[1, 2]", "must hold a JSON object"),
        ("generation_config.json", '{"eos_token_id": "x"}', "eos_token_id"),
        ("chat_template.jinja", "{% if %}", "does not parse"),
        ("tokenizer_config.json", '{"eos_token": "<nope>"}', "not in the vocabulary"),
        ("tokenizer_config.json", '{"chat_template": [{"template": "x"}]}', "malformed"),
    ],
)
def test_malformed_files(
    random_checkpoint: Path, tmp_path: Path, name: str, text: str, message: str
):
    # Without the template file, so that tokenizer_config.json's template is read.
    path = _copy(
        random_checkpoint, tmp_path, skip="chat_template.jinja" * (name != "chat_template.jinja")
    )
    (path / name).write_text(text)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(path)
