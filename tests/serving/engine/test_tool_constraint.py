"""tool_choice "required" / named as constrained decoding: the forced-call validator, the
constraint over the random checkpoint's tokenizer, and the engine end to end."""

import json
from pathlib import Path

import pytest

from serving.engine.json_validator import MAX_WHITESPACE
from serving.engine.llm_engine import EngineConfig, EngineInputError, LLMEngine
from serving.engine.token_vocabulary import json_vocabulary
from serving.engine.tool_constraint import ToolCallConstraint, ToolCallValidator, call_head
from serving.model.sampling import SamplingParams
from serving.model.tokenizer import Tokenizer
from serving.model.tool_calls import parse_tool_calls

NAMES = ["get_weather", "get_time", "météo"]
VALID = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "météo", "arguments":  {"a": [1, {"b": null}], "c": "é"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"h": "<\\/tool_call></tool_"}}\n</tool_call>',
]
# (a valid prefix, what follows it): the first byte that follows is wrong
CALL = '<tool_call>\n{"name": "get_time", "arguments": '
INVALID = [
    ("<tool_call>", ' {"name"'),
    ('<tool_call>\n{"name": "get_', 'x"'),
    ('<tool_call>\n{"name": "get_time"', " , "),
    (CALL, "["),
    (CALL + '{"x": "</tool_call', '>"'),
    (CALL + "{}}", " \n</tool_call>"),
    (VALID[1], "\n"),
    (CALL + " " * MAX_WHITESPACE, " {}"),
]


@pytest.mark.parametrize("text", VALID)
def test_every_prefix_of_a_forced_call_is_accepted(text: str) -> None:
    data = text.encode()
    for i in range(len(data) + 1):
        v = ToolCallValidator(NAMES)
        assert v.accepts(data[:i]), data[:i]
        v.advance(data[:i])
        assert v.complete == (i == len(data))
    _, [call] = parse_tool_calls(text)
    assert call.name in NAMES and isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("ok", "rest"), INVALID)
def test_deviations_are_rejected_at_the_first_bad_byte(ok: str, rest: str) -> None:
    v = ToolCallValidator(NAMES)
    bad = (ok + rest).encode()[: len(ok.encode()) + 1]
    assert v.accepts(ok.encode()) and not v.accepts(bad)
    with pytest.raises(ValueError):
        v.advance(bad)
    assert v.state == ToolCallValidator(NAMES).state  # nothing changed


def test_a_named_call_allows_only_that_name() -> None:
    v = ToolCallValidator(["get_time"])
    assert v.accepts(VALID[1].encode()) and not v.accepts(VALID[0].encode())
    with pytest.raises(ValueError, match="at least one"):
        ToolCallValidator([])


# -- over the random checkpoint's tokenizer --------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(random_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_checkpoint)


def test_mask_is_exactly_the_allowed_tokens(tokenizer: Tokenizer) -> None:
    raw = tokenizer.raw
    vocab = json_vocabulary(raw)
    eos = raw.token_to_id("<|im_end|>")
    call_start = raw.token_to_id("<tool_call>")
    assert vocab.token_bytes[call_start] == b"<tool_call>"  # an added token, by its bytes
    for text in VALID:
        ids = raw.encode(text).ids
        constraint = ToolCallConstraint(vocab, [eos], NAMES)
        for token in [*ids, eos]:
            mask = constraint.allowed_mask(len(vocab) + 3)
            expected = [constraint.allows(t) for t in range(len(vocab))]
            assert mask[: len(vocab)].tolist() == expected and not mask[len(vocab) :].any()
            assert mask[token] and mask[eos] == constraint.complete
            constraint.advance(token)
    assert ToolCallConstraint(vocab, [eos], NAMES).allows(call_start)


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(random_checkpoint: Path) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=16 << 20, max_model_len=512)
    return LLMEngine.from_checkpoint(random_checkpoint, config)


def test_engine_forces_one_call(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.encode(
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    )
    cases = [([*NAMES], 0.0, None), (["get_time"], 0.0, None)]
    cases += [(NAMES, 1.0, seed) for seed in range(4)] + [(["météo"], 0.8, 4)]
    params = [
        SamplingParams(max_tokens=200, temperature=t, seed=seed, tool_names=names)
        for names, t, seed in cases
    ]
    outputs = engine.generate([prompt] * len(params), params)
    for p, [out] in zip(params, outputs, strict=True):
        validator = ToolCallValidator(p.tool_names)
        assert validator.accepts(out.text.encode())  # cut by max_tokens: a valid prefix
        assert any(out.text.startswith(call_head(name).decode()) for name in p.tool_names)
        if out.finish_reason == "stop":
            content, [call] = parse_tool_calls(out.text)
            assert content == "" and call.name in p.tool_names
            assert isinstance(json.loads(call.arguments), dict)
    assert outputs[0][0].finish_reason == "stop"  # greedy closes the call


def test_forced_call_and_json_object_are_exclusive(engine: LLMEngine) -> None:
    both = SamplingParams(json_object=True, tool_names=["f"])
    with pytest.raises(EngineInputError, match="cannot be combined"):
        engine.validate([1, 2], both)
    with pytest.raises(EngineInputError, match="at least one"):
        engine.validate([1, 2], SamplingParams(tool_names=[]))
