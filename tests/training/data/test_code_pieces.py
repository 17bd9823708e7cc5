"""Training chains whose code is built from the tokenizer's merged pieces."""

import json
import random
from pathlib import Path

import pytest

from serving.model.tokenizer import Tokenizer
from tasks import get_domain
from tasks.tool_tasks import CODE_CHARS
from training.config import DataConfig
from training.data.code_pieces import CodePieces
from training.data.datasets import build_sft
from training.data.streams import sft_examples

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo-full"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


def _multi_char_pieces(tokenizer: Tokenizer, code: str) -> list[str]:
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode(f'"{code}"')]
    return [p for p in pieces if len(p) > 1 and set(p) <= set(CODE_CHARS + CODE_CHARS.lower())]


def test_pieces_are_the_tokenizers_own(tokenizer: Tokenizer) -> None:
    codes = CodePieces.of(tokenizer, 1.0)
    assert len(codes.upper) > 50 and len(codes.lower) > 50
    for piece in codes.upper + codes.lower:
        assert tokenizer.encode(piece) == [tokenizer.raw.token_to_id(piece)]
    assert all(set(p) <= set(CODE_CHARS) for p in codes.upper)


def test_a_redrawn_code_keeps_its_form_and_replaces_every_copy(tokenizer: Tokenizer) -> None:
    codes = CodePieces.of(tokenizer, 1.0)
    tools = get_domain("tools")
    merged = 0
    for seed in range(24):
        task = tools.generate(seed, 3)
        new = codes.redraw(task, random.Random(seed))
        old_key, key = task.data["key"], new.data["key"]
        assert key != old_key and len(key) == len(old_key)
        prefix = next((p for p in ("TRK", "BK-", "msg_") if old_key.startswith(p)), "")
        assert key.startswith(prefix)
        assert (key == key.lower()) == (old_key == old_key.lower())
        text = json.dumps(new.data)
        assert old_key not in text
        assert key in new.data["answer"] and key in json.dumps(new.data["calls"][-1]["result"])
        assert new.prompt == task.prompt and new.tools == task.tools
        merged += len(_multi_char_pieces(tokenizer, key)) - len(
            _multi_char_pieces(tokenizer, old_key)
        )
    assert merged >= 24  # more than one merged piece more per code, on average


def test_only_chains_are_redrawn_and_only_their_share(tokenizer: Tokenizer) -> None:
    tools = get_domain("tools")
    single = tools.generate(5, 2)
    assert CodePieces.of(tokenizer, 1.0).redraw(single, random.Random(0)) is single
    chain = tools.generate(5, 3)
    assert CodePieces.of(tokenizer, 0.0).redraw(chain, random.Random(0)) is chain
    half = CodePieces.of(tokenizer, 0.5)
    redrawn = sum(half.redraw(chain, random.Random(i)) is not chain for i in range(200))
    assert 70 <= redrawn <= 130


def test_references_with_redrawn_codes_still_verify(tokenizer: Tokenizer) -> None:
    """`sft_examples` raises when a reference does not verify: the episode's tool results and
    the verifier's key are the redrawn code, and so is what the reference answers."""
    codes = CodePieces.of(tokenizer, 1.0)
    plain = list(sft_examples(get_domain("tools"), range(6), [3], "think"))
    redrawn = list(sft_examples(get_domain("tools"), range(6), [3], "think", codes=codes))
    for before, after in zip(plain, redrawn, strict=True):
        assert before["turns"][-1][1] != after["turns"][-1][1]
        assert before["messages"][1]["content"] == after["messages"][1]["content"]


def test_build_sft_draws_them_when_asked(tokenizer: Tokenizer, tmp_path: Path) -> None:
    data = DataConfig(examples=8, mix={"tools": 1.0}, difficulties=[3], merged_codes=1.0)
    rows = build_sft(data, "think", tokenizer, tmp_path / "sft.jsonl", 1024).read_text()
    unchanged = data.model_copy(update={"merged_codes": 0.0})
    plain = build_sft(unchanged, "think", tokenizer, tmp_path / "p.jsonl", 1024).read_text()
    assert rows != plain and len(rows.splitlines()) == len(plain.splitlines())
