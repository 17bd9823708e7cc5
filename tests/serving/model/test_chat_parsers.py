"""Reasoning and tool-call parsing, whole and streamed, with deltas split everywhere."""

import json

import pytest

from serving.api_server.serving_chat import ChatDeltaParser, parse_chat_output
from serving.model.chat_format import ReasoningStream
from serving.model.tool_calls import ToolCallStream
from tasks.answers import parse_tool_calls, split_reasoning


def _splits(text: str):
    """The text as one delta, as single characters, and cut in two at every position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _stream_reasoning(deltas: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    stream = ReasoningStream(in_reasoning=in_reasoning)
    reasoning, content = "", ""
    for piece in [*(stream.feed(d) for d in deltas), stream.finish()]:
        reasoning += piece[0]
        content += piece[1]
    return reasoning, content


REASONING_CASES = [
    # (text, starts inside <think>, reasoning, content)
    (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        False,
        "Let me think.",
        "The answer is 4.",
    ),
    ("<think>a\n\nb</think>c\n", False, "a\n\nb", "c\n"),
    ("  \n<think>x</think>y", False, "x", "y"),
    ("Just an answer.", False, None, "Just an answer."),
    ("  spaced answer\n", False, None, "  spaced answer\n"),
    ("<think>\n\n</think>\n\nNo reasoning.", False, None, "No reasoning."),
    ("<think>\ncut off mid thought\n", False, "cut off mid thought", ""),
    ("<think>cut off at </thi", False, "cut off at </thi", ""),
    ("opened in the prompt\n</think>\n\nanswer", True, "opened in the prompt", "answer"),
    ("</think>answer only", True, None, "answer only"),
    ("<thinking> is not a tag", False, None, "<thinking> is not a tag"),
    ("<thi", False, None, "<thi"),
    ("", False, None, ""),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
]


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), REASONING_CASES)
def test_split_reasoning(text: str, in_reasoning: bool, reasoning: str | None, content: str):
    assert split_reasoning(text) == (reasoning, content)
    for deltas in _splits(text):
        assert _stream_reasoning(deltas, in_reasoning) == (reasoning or "", content), deltas


def test_reasoning_stream_never_leaks_tags() -> None:
    text = "<think>\nstep one\nstep two\n</think>\n\nfinal"
    for deltas in _splits(text):
        stream = ReasoningStream()
        for delta in deltas:
            reasoning, content = stream.feed(delta)
            for tag in ("<", "</", "<think", "</think>", "think>"):
                assert not reasoning.endswith(tag) and not content.startswith(tag), deltas


def test_reasoning_stream_is_incremental() -> None:
    stream = ReasoningStream()
    assert stream.feed("<think>") == ("", "")
    assert stream.feed("\nfirst") == ("first", "")
    assert stream.feed(" second\n") == (" second", "")  # the newline may precede </think>
    assert stream.feed("more</th") == ("\nmore", "")
    assert stream.feed("ink>\n\nAns") == ("", "Ans")
    assert stream.feed("wer") == ("", "wer")
    assert stream.finish() == ("", "")
    plain = ReasoningStream()
    assert plain.feed("Hello") == ("", "Hello")  # no <think>: content streams at once


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _stream_tools(deltas: list[str]) -> tuple[str, list[dict]]:
    stream = ToolCallStream()
    content, calls = "", []
    for piece in [*(stream.feed(d) for d in deltas), stream.finish()]:
        content += piece[0]
        calls += piece[1]
    return content, calls


def _names_and_args(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


TOOL_CASES = [
    # (text, content, [(name, arguments)])
    (_call("get_weather", {"city": "Paris"}), "", [("get_weather", {"city": "Paris"})]),
    (
        "Let me check.\n" + _call("get_weather", {"city": "Paris"}) + "\n" + _call("add", {"a": 1}),
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1})],
    ),
    (
        "Before " + _call("f", {}) + "\n\n after <b>x</b>\n",
        "Beforeafter <b>x</b>\n",
        [("f", {})],
    ),
    (_call("日本", {"q": "é 😀"}), "", [("日本", {"q": "é 😀"})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}', "", [("f", {"a": [1, 2]})]),
    ('<tool_call>{"name": "g"}</tool_call>', "", [("g", {})]),
    ("No tools here. < tool_call > <tool", "No tools here. < tool_call > <tool", []),
    ("", "", []),
]

MALFORMED = [
    "Sure! <tool_call>\n{not json}\n</tool_call> done",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>\n{"name": "f", "argum',
    '<tool_call>["f"]</tool_call>\n',
]


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_parse_tool_calls(text: str, content: str, calls: list) -> None:
    parsed_content, parsed = parse_tool_calls(text)
    assert parsed_content == content
    assert _names_and_args(parsed) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed)
    assert len({c.id for c in parsed}) == len(parsed)
    for deltas in _splits(text):
        streamed_content, deltas_out = _stream_tools(deltas)
        assert streamed_content == content, deltas
        assert [d["index"] for d in deltas_out] == list(range(len(calls)))
        streamed = [
            (d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas_out
        ]
        assert streamed == calls, deltas


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_tool_calls_stay_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])
    for deltas in _splits(text):
        assert _stream_tools(deltas) == (text, []), deltas


def test_one_malformed_block_voids_all_calls() -> None:
    text = _call("f", {}) + "\n<tool_call>{oops}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_tool_call_stream_delta_format() -> None:
    stream = ToolCallStream()
    assert stream.feed("Checking ") == ("Checking", [])  # trailing space held back
    assert stream.feed("now.\n<tool_") == (" now.", [])
    assert stream.feed('call>\n{"name": "f", "arguments": {"x": 1}}\n') == ("", [])
    content, deltas = stream.feed("</tool_call>")
    assert content == ""
    assert deltas == [
        {
            "index": 0,
            "id": stream.calls[0].id,
            "type": "function",
            "function": {"name": "f", "arguments": '{"x": 1}'},
        }
    ]
    assert stream.calls[0].to_openai() == {k: v for k, v in deltas[0].items() if k != "index"}
    assert stream.finish() == ("", [])


def test_arguments_given_as_a_string_are_kept() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    _, calls = parse_tool_calls(text)
    assert calls[0].arguments == '{"x": 1}'


def test_chat_output_parsing() -> None:
    text = (
        "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    message = parse_chat_output(text, in_reasoning=False, with_tools=True)
    assert message.reasoning_content == "The user wants weather."
    assert message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    # Without tools the blocks stay text; reasoning opened by the prompt is still split off.
    plain = parse_chat_output("thinking</think>\n\nanswer", in_reasoning=True, with_tools=False)
    assert (plain.reasoning_content, plain.content, plain.tool_calls) == (
        "thinking",
        "answer",
        None,
    )
    only_call = parse_chat_output(text.split("Let me check.\n")[1], False, True)
    assert only_call.content is None and len(only_call.tool_calls) == 2

    # Streamed in small pieces, the deltas add up to the whole message.
    for size in (1, 3, 7):
        parser = ChatDeltaParser(in_reasoning=False, with_tools=True)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        deltas = [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        deltas = [d for d in deltas if d is not None]
        assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == message.content
        calls = [c for d in deltas for c in d.tool_calls or []]
        assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
            (i, c.function.name, c.function.arguments) for i, c in enumerate(message.tool_calls)
        ]
        assert parser.tools_called
