"""Copy drills: a chain's last turn in the context it copies from."""

import json
from pathlib import Path

import pytest

from serving.model.tokenizer import Tokenizer
from tasks.answers import split_reasoning
from training.config import DataConfig
from training.data.code_pieces import CodePieces
from training.data.copy_drills import copy_drill
from training.data.datasets import chat_examples

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo-full"


@pytest.fixture(scope="module")
def codes() -> CodePieces:
    return CodePieces.of(Tokenizer.from_dir(DEMO), 0.0)


CODE_FIELDS = ("confirmation", "tracking_number", "booking_reference", "message_id")


def _code(result: dict) -> str:
    """The chain's code in its last result."""
    [code] = [result[k] for k in CODE_FIELDS if k in result]
    return code


@pytest.mark.parametrize("style", ["think", "short"])
def test_a_drill_is_the_last_turn_cut_to_request_call_and_result(
    codes: CodePieces, style: str
) -> None:
    tokenizer = Tokenizer.from_dir(DEMO)
    merged = 0
    for seed in range(12):
        drill = copy_drill(seed, style, codes, natural=0.0)
        [(context, turn)] = drill["turns"]
        assert [m["role"] for m in context] == ["user", "assistant", "tool"]
        [call] = context[1]["tool_calls"]
        assert [t["function"]["name"] for t in drill["tools"]] == [call["function"]["name"]]
        code = _code(json.loads(context[2]["content"]))
        reasoning, answer = split_reasoning(turn)
        assert code in answer
        assert (reasoning is not None) == (style == "think")
        if style == "think":
            assert f'"{code}"' in reasoning  # copied as the result writes it, then in the answer
        assert drill["domain"] == "copy"
        pieces = [tokenizer.decode([t]) for t in tokenizer.encode(json.dumps(code))]
        merged += sum(p in codes.upper + codes.lower for p in pieces)
    assert merged >= 24  # the redrawn codes are mostly merged pieces: two or more each


def test_chat_examples_give_their_share_of_drills(codes: CodePieces) -> None:
    data = DataConfig(examples=60, seed=7, copy_drills=0.5, mix={"math": 1.0, "tools": 1.0})
    kinds = [e["domain"] for e in chat_examples(data, "think", codes)]
    assert 18 <= kinds.count("copy") <= 42
    with pytest.raises(ValueError, match="copy drills"):
        list(chat_examples(data, "think"))


def test_drills_and_outside_requests_cannot_take_more_than_every_example() -> None:
    with pytest.raises(ValueError, match="at most 1"):
        DataConfig(copy_drills=0.7, out_of_domain=0.4)
