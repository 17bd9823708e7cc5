"""OpenAI request validation and the sampling parameters it yields."""

import pytest
from pydantic import ValidationError

from serving.api_server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TextMessage,
    TokenizeRequest,
)
from serving.api_server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

USER = {"role": "user", "content": "Hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **fields})


def test_full_chat_request() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "system", "content": [{"type": "text", "text": "sys"}]},
            USER,
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
        temperature=0.7,
        top_p=0.9,
        n=2,
        max_tokens=50,
        max_completion_tokens=40,
        stop="END",
        stream=True,
        stream_options={"include_usage": True},
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={},
        logprobs=True,
        top_logprobs=5,
        seed=7,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "f"}},
        response_format={"type": "json_object"},
        user="u",
        reasoning_effort="low",
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        ignore_eos=True,
        min_tokens=3,
        stop_token_ids=[5],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        chat_template_kwargs={"enable_thinking": False},
        some_future_field={"ignored": True},
    )
    assert isinstance(request.messages[0], TextMessage)
    assert isinstance(request.messages[3], AssistantMessage)
    assert request.stream_options.include_usage
    params = request.to_sampling_params(1000, {})
    assert params.max_tokens == 40  # max_completion_tokens wins over the deprecated max_tokens
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 20, 0.05)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.1 and params.seed == 7 and params.n == 2
    assert params.logprobs == 5 and params.prompt_logprobs is None
    assert params.stop == ["END"] and params.stop_token_ids == [5]
    assert params.ignore_eos and params.min_tokens == 3 and params.include_stop_str_in_output
    assert not params.skip_special_tokens


def test_chat_defaults() -> None:
    params = chat().to_sampling_params(123, {})
    assert params.max_tokens == 123
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.logprobs is None and params.stop == [] and params.n == 1
    assert chat(logprobs=True).to_sampling_params(10, {}).logprobs == 0
    assert chat(temperature=0).to_sampling_params(10, {}).greedy


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"messages": []}, "at least 1"),
        ({"messages": [{"content": "no role"}]}, "role"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user"}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"temperature": 2.5}, "less than or equal to 2"),
        ({"temperature": -0.1}, "greater than or equal to 0"),
        ({"top_p": 0}, "greater than 0"),
        ({"top_p": 1.5}, "less than or equal to 1"),
        ({"n": 0}, "greater than or equal to 1"),
        ({"n": 17}, "less than or equal to 16"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, "greater than or equal to 1"),
        ({"presence_penalty": 2.5}, "less than or equal to 2"),
        ({"frequency_penalty": -3}, "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "greater than 0"),
        ({"min_p": 1.5}, "less than or equal to 1"),
        ({"stop": ["s"] * 17}, "at most 16"),
        ({"stop": [""]}, "at least 1 character"),
        ({"logit_bias": {"5": 10}}, "logit_bias is not supported"),
        ({"top_logprobs": 3}, "top_logprobs requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
        ({"stream_options": {"include_usage": True}}, "only be set when stream"),
        ({"tool_choice": "required"}, "requires tools"),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": "g"}}}, "not among the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"stop_token_ids": [-1]}, "greater than or equal to 0"),
        ({"seed": 2**64}, "less than 9223372036854775808"),
    ],
)
def test_invalid_chat_requests(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        chat(**fields)


def test_tool_choice_without_tools_is_fine_when_optional() -> None:
    assert chat(tool_choice="none").tool_choice == "none"
    assert chat(tool_choice="auto", tools=[TOOL]).tools[0].function.name == "f"


@pytest.mark.parametrize(
    ("fields", "names", "optional"),
    [
        ({"tools": [TOOL]}, ["f"], True),  # no tool_choice with tools: "auto"
        ({"tools": [TOOL], "tool_choice": "auto"}, ["f"], True),
        ({"tools": [TOOL], "tool_choice": "required"}, ["f"], False),
        ({"tools": [TOOL], "tool_choice": {"function": {"name": "f"}}}, ["f"], False),
        ({"tools": [TOOL], "tool_choice": "none"}, None, False),
        ({"tools": [TOOL], "response_format": {"type": "json_object"}}, None, False),
        ({}, None, False),
    ],
)
def test_tool_choice_sets_the_tool_call_constraint(fields: dict, names, optional) -> None:
    params = chat(**fields).to_sampling_params(16, {})
    assert (params.tool_names, params.tool_call_optional) == (names, optional)
    assert params.tool_parameters == ({"f": {"type": "object"}} if "tools" in fields else {})


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_completion_prompt_forms(prompt) -> None:
    assert completion(prompt=prompt).prompt == prompt


def test_completion_sampling_params() -> None:
    params = completion().to_sampling_params(500, {})
    assert params.max_tokens == 16  # OpenAI's completions default
    assert completion(max_tokens=None).to_sampling_params(500, {}).max_tokens == 500
    params = completion(logprobs=2, echo=True, stop=["a", "b"], best_of=1).to_sampling_params(9, {})
    assert params.logprobs == 2 and params.prompt_logprobs == 2 and params.stop == ["a", "b"]
    assert completion(logprobs=0).to_sampling_params(9, {}).prompt_logprobs is None
    assert completion(min_tokens=50, max_tokens=None).to_sampling_params(20, {}).min_tokens == 20


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": []}, "at least 1"),
        ({"prompt": [[]]}, "at least 1"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "greater than or equal to 0"),
        ({"prompt": None}, "prompt"),
        ({"logprobs": 6}, "less than or equal to 5"),
        ({"suffix": "x"}, "suffix is not supported"),
        ({"best_of": 3}, "best_of is not supported"),
        ({"logit_bias": {"1": -100}}, "logit_bias is not supported"),
    ],
)
def test_invalid_completion_requests(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        completion(**fields)


def test_tokenize_requests() -> None:
    assert TokenizeRequest(prompt="hi").add_special_tokens is True
    request = TokenizeRequest.model_validate({"messages": [USER], "tools": [TOOL]})
    assert request.add_special_tokens is False and request.add_generation_prompt
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeRequest()
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeRequest.model_validate({"prompt": "x", "messages": [USER]})
    assert DetokenizeRequest(tokens=[1, 2]).tokens == [1, 2]


def test_response_shapes() -> None:
    response = ChatCompletionResponse.model_validate(
        {
            "id": "chatcmpl-1",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"content": "hi", "reasoning_content": "r"},
                    "logprobs": {
                        "content": [
                            {
                                "token": "hi",
                                "logprob": -0.1,
                                "bytes": [104, 105],
                                "top_logprobs": [{"token": "hi", "logprob": -0.1}],
                            }
                        ]
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )
    dumped = response.model_dump()
    assert dumped["object"] == "chat.completion" and dumped["created"] > 1_600_000_000
    assert dumped["choices"][0]["message"]["role"] == "assistant"
    chunk = ChatCompletionChunk(
        id="c",
        model="m",
        choices=[
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
            }
        ],
    )
    assert chunk.model_dump(exclude_none=True)["choices"][0] == {
        "index": 0,
        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
    }
    completion_response = CompletionResponse(
        id="cmpl-1",
        model="m",
        choices=[
            {
                "index": 0,
                "text": " world",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": [" world"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{" world": -0.5}],
                    "text_offset": [5],
                },
            }
        ],
        usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    )
    assert completion_response.object == "text_completion"
    assert ModelList(data=[{"id": "m"}]).model_dump()["data"][0]["object"] == "model"
    error = ErrorResponse(error={"message": "bad", "type": "invalid_request_error", "code": 400})
    assert error.model_dump() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": 400}
    }
