"""Tool calls as constrained decoding: tool_choice "required" / named (one forced call) and
"auto" (optional calls, each held to the grammar): the validators, the constraints over the
random checkpoint's tokenizer, and the engine end to end."""

import json
from pathlib import Path

import httpx
import pytest

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.json_validator import MAX_WHITESPACE
from serving.engine.llm_engine import EngineConfig, EngineInputError, LLMEngine
from serving.engine.token_vocabulary import json_vocabulary
from serving.engine.tool_constraint import (
    OptionalToolCallConstraint,
    OptionalToolCallValidator,
    ToolCallConstraint,
    ToolCallValidator,
    call_head,
)
from serving.model.tokenizer import Tokenizer
from serving.sampling.params import SamplingParams
from tasks.answers import parse_tool_calls
from tests import REPO

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


# -- parameter schemas: the arguments keep to the declared keys -------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "options": {"type": "object"},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city"],
}
HEAD = '<tool_call>\n{"name": "get_weather", "arguments": '


@pytest.mark.parametrize(
    "arguments",
    [
        '{"city": "Paris"}',
        '{"city": "Rome", "days" : -3, "units": "C"}',
        '{ "city": "Oslo" , "units": "F"}',  # optional keys may be skipped
        '{"city": "x", "options": {"city": 1, "other": [true]}}',  # nested keys are free
        '{"city": "\\"Z\\"", "days": 12, "options": {}}',
    ],
)
def test_arguments_with_declared_keys_in_order_are_accepted(arguments: str) -> None:
    v = ToolCallValidator(NAMES, {"get_weather": WEATHER})
    v.advance((HEAD + arguments + "}\n</tool_call>").encode())
    assert v.complete


@pytest.mark.parametrize(
    ("ok", "rest"),
    [
        ('{"', 'town": "Paris"}'),  # undeclared key
        ('{"city', '_name": 1}'),
        ('{"', 'days": 3}'),  # "city" is required, and declared first
        ("{", "}"),
        ('{"city": ', "5}"),  # a string
        ('{"city": "x", "days": ', '"3"}'),  # an integer
        ('{"city": "x", "days": 3', ".5}"),  # ... without a fraction
        ('{"city": "x", "units": "', 'K"}'),  # one of the enum
        ('{"city": "x", "units": "C', 'elsius"}'),
        ('{"city": "x", "options": {}, "', 'days": 1}'),  # in the declared order
        ('{"city": "a", "', 'city": "b"}'),  # each key once
        ('{"city": "a", "days": 1, "options": {}, "units": "F"', ', "x": 1}'),  # none left
    ],
)
def test_arguments_outside_the_schema_are_rejected_at_the_first_bad_byte(
    ok: str, rest: str
) -> None:
    v = ToolCallValidator(NAMES, {"get_weather": WEATHER})
    v.advance(HEAD.encode())
    good = ok.encode()
    bad = (ok + rest).encode()[: len(good) + 1]
    assert v.accepts(good) and not v.accepts(bad)
    other = ToolCallValidator(NAMES)  # no schema: any keys
    other.advance(HEAD.encode())
    assert other.accepts(bad)


def test_open_schemas_leave_the_keys_free() -> None:
    for schema in [{"type": "object"}, {**WEATHER, "additionalProperties": True}, {}]:
        v = ToolCallValidator(NAMES, {"get_weather": schema})
        assert v.accepts((HEAD + '{"anything": 1}}\n</tool_call>').encode())


def test_schema_mask_is_exactly_the_allowed_tokens(tokenizer: Tokenizer) -> None:
    """Inside a key or an enum's value plain string tokens are not all allowed: the mask
    walks them too."""
    raw = tokenizer.raw
    vocab = json_vocabulary(raw)
    eos = raw.token_to_id("<|im_end|>")
    constraint = ToolCallConstraint(vocab, [eos], NAMES, {"get_weather": WEATHER})
    text = HEAD + '{"city": "Paris", "days": 2, "units": "C"}}\n</tool_call>'
    for token in raw.encode(text).ids:
        mask = constraint.allowed_mask(len(vocab))
        assert mask.tolist() == [constraint.allows(t) for t in range(len(vocab))]
        assert mask[token]
        constraint.advance(token)
    assert constraint.complete


# -- tool_choice "auto": calls are optional, but each one that starts is held to the grammar --

TEXT_AND_CALLS = [
    "The weather in Paris is mild.",
    "a <tool_ b <tool_call",  # a partial tag in text is text
    "Let me look.\n" + VALID[0] + "\n" + VALID[1] + "\nDone.",
    "<think>which tool?</think>\n" + VALID[2],
]


@pytest.mark.parametrize("text", TEXT_AND_CALLS)
def test_text_and_calls_to_offered_functions_are_accepted(text: str) -> None:
    data = text.encode()
    for i in range(len(data) + 1):
        v = OptionalToolCallValidator(NAMES)
        assert v.accepts(data[:i]), data[:i]
        v.advance(data[:i])
        assert not v.complete  # nothing ever forces the end
    assert v.in_text == text.endswith(("</tool_call>", ".", "call"))


@pytest.mark.parametrize(
    ("ok", "rest"),
    [
        ("Sure. <tool_call>", ' {"name"'),
        ('Sure. <tool_call>\n{"name": "get_', 'current_weather"'),  # not offered
        ("x" + VALID[1][:-3], "x"),
    ],
)
def test_a_call_that_starts_must_follow_the_grammar(ok: str, rest: str) -> None:
    v = OptionalToolCallValidator(NAMES)
    bad = (ok + rest).encode()[: len(ok.encode()) + 1]
    assert v.accepts(ok.encode()) and not v.accepts(bad)


def test_optional_mask_is_exactly_the_allowed_tokens(tokenizer: Tokenizer) -> None:
    """Outside a call every token may come, EOS and special tokens too; inside, neither."""
    raw = tokenizer.raw
    vocab = json_vocabulary(raw)
    eos = raw.token_to_id("<|im_end|>")
    special = raw.token_to_id("<|im_start|>")
    constraint = OptionalToolCallConstraint(vocab, [eos], NAMES)
    for token in raw.encode("Checking. " + VALID[0]).ids:
        mask = constraint.allowed_mask(len(vocab) + 3)
        expected = [constraint.allows(t) for t in range(len(vocab))]
        assert mask[: len(vocab)].tolist() == expected and not mask[len(vocab) :].any()
        assert mask[token] and mask[eos] == mask[special] == constraint.validator.in_text
        constraint.advance(token)
    assert constraint.validator.in_text and constraint.allows(eos) and not constraint.complete


def test_engine_holds_optional_calls_to_the_offered_names(engine: LLMEngine) -> None:
    """Sampled freely from the random model, each output is text whose calls (if any) name
    an offered function (it rarely opens one: the shipped model's test is below)."""
    chat = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
    names = ["get_time"]
    params = [
        SamplingParams(
            max_tokens=120, temperature=1.0, seed=s, tool_names=names, tool_call_optional=True
        )
        for s in range(6)
    ]
    outputs = engine.generate([engine.tokenizer.encode(chat)] * 6, params)
    for [out] in outputs:
        assert OptionalToolCallValidator(names).accepts(out.text.encode())


async def test_auto_tool_choice_calls_an_offered_function_of_an_unseen_schema() -> None:
    """The shipped full tier, asked for the weather with a schema it never saw
    (`get_current_weather(location)`), calls `get_weather`, a bank function it knows, when
    unconstrained; with tool_choice "auto" held to the offered names it calls the offered
    one, through the OpenAI app, greedy."""
    engine = AsyncEngine(LLMEngine.from_checkpoint(REPO / "models" / "demo-full", EngineConfig()))
    assert engine.engine.tokenizer is not None
    weather = {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {"location": {"type": "string", "description": "City name"}},
                "required": ["location"],
            },
        },
    }
    body = {
        "model": "full",
        "messages": [{"role": "user", "content": "What's the weather like in Paris?"}],
        "tools": [weather],
        "temperature": 0,
        "max_tokens": 200,
    }
    try:
        app = build_app(engine, engine.engine.tokenizer, "full")
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            reply = (await client.post("/v1/chat/completions", json=body)).json()
    finally:
        engine.stop()
    [call] = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_current_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
