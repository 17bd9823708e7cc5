"""The tier server as the official `openai` client sees it: a real uvicorn server on a port,
plus a scripted engine for what a random-weight model never writes (tool calls, reasoning)."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import (
    EngineConfig,
    EngineRequest,
    LLMEngine,
    RequestOutput,
    SequenceOutput,
)

MODEL = "tiny-moe"
KEY = "sk-tierserve-test"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def engine(random_checkpoint: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(kv_cache_bytes=8 << 20, max_model_len=256)
    aengine = AsyncEngine(LLMEngine.from_checkpoint(random_checkpoint, config))
    yield aengine
    aengine.stop()


@pytest.fixture(scope="module")
def base_url(engine: AsyncEngine) -> Iterator[str]:
    """A real uvicorn server in a background thread, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(engine, engine.engine.tokenizer, MODEL, api_key=KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=KEY, max_retries=0)


@pytest.fixture
def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0)


def test_sync_chat(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, temperature=0
    )
    assert completion.object == "chat.completion" and completion.model == MODEL
    [choice] = completion.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens <= 4
    assert [m.id for m in client.models.list()] == [MODEL]


async def test_async_chat_concurrent(async_client: openai.AsyncOpenAI) -> None:
    prompts = ["one", "two words", "three words here", "four"]
    completions = await asyncio.gather(
        *(
            async_client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": p}],
                max_completion_tokens=3,
                temperature=0,
            )
            for p in prompts
        )
    )
    assert len({c.id for c in completions}) == len(prompts)
    assert all(c.usage.completion_tokens <= 3 for c in completions)


def test_stream_with_usage(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_async_stream(async_client: openai.AsyncOpenAI) -> None:
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, temperature=0, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_completions(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="def main():", max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    [choice] = completion.choices
    assert choice.text.startswith("def main():")
    assert len(choice.logprobs.tokens) == completion.usage.total_tokens
    stream = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=2, temperature=0, stream=True
    )
    indices = {c.index for chunk in stream for c in chunk.choices}
    assert indices == {0, 1}


def test_tools_are_accepted(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=4,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.tool_calls is None or choice.message.tool_calls[0].function.name


def test_errors(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=1)
    wrong = openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_disconnect_over_http_aborts(base_url: str, engine: AsyncEngine) -> None:
    """uvicorn's disconnect reaches the engine: closing a stream frees the request's blocks."""
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{base_url}/chat/completions", json=body, headers=headers) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    blocks = engine.engine.blocks
    deadline = time.monotonic() + 30
    while engine.engine.requests or blocks.num_free_blocks < blocks.num_blocks:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    metrics = httpx.get(base_url.removesuffix("/v1") + "/metrics").text
    aborted = 'tierserve_request_success_total{finished_reason="abort",model_name="tiny-moe"} 1.0'
    assert aborted in metrics


class ScriptedEngine(AsyncEngine):
    """The server's real validation, but every request replays `text` a few characters per
    step: the honest way to see tool calls and reasoning through the whole server."""

    def __init__(self, engine: LLMEngine, text: str) -> None:
        super().__init__(engine)
        self.text = text

    async def generate(
        self, request_id: str, request: EngineRequest
    ) -> AsyncIterator[RequestOutput]:
        start = time.monotonic()
        pieces = [self.text[i : i + 5] for i in range(0, len(self.text), 5)]
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            delta = SequenceOutput(0, piece, [i], finish_reason="stop" if last else None)
            yield RequestOutput(
                request_id,
                request.prompt_token_ids,
                [delta],
                finished=last,
                arrival_time=start,
                first_scheduled_time=start,
                first_token_time=start,
            )


SCRIPT = (
    "<think>\nThe user asks about Paris.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.fixture
async def scripted_client(engine: AsyncEngine) -> AsyncIterator[openai.AsyncOpenAI]:
    scripted = ScriptedEngine(engine.engine, SCRIPT)
    app = build_app(scripted, engine.engine.tokenizer, MODEL)
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://tier/v1") as http:
        yield openai.AsyncOpenAI(
            base_url="http://tier/v1", api_key="none", http_client=http, max_retries=0
        )
    scripted.stop()


async def test_tool_calls_end_to_end(scripted_client: openai.AsyncOpenAI) -> None:
    kwargs = {"model": MODEL, "messages": USER, "tools": [WEATHER], "max_tokens": 16}
    completion = await scripted_client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "The user asks about Paris."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )

    stream = await scripted_client.chat.completions.create(**kwargs, stream=True)
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "The user asks about Paris."
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # With tool_choice "none" the same text is plain content, and no tools are parsed.
    plain = await scripted_client.chat.completions.create(**kwargs, tool_choice="none")
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content


async def test_many_concurrent_clients_some_leaving(
    async_client: openai.AsyncOpenAI, engine: AsyncEngine
) -> None:
    """24 clients at once (streams, n = 2, early hang-ups): every answer is whole, and the
    engine ends with no request and an empty KV cache."""

    async def one(i: int) -> int:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": f"count to {i}"}])
        if i % 3 == 0:  # a client that reads two chunks and hangs up
            stream = await async_client.chat.completions.create(**kw, max_tokens=64, stream=True)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.close()
            return -1
        if i % 3 == 1:
            stream = await async_client.chat.completions.create(
                **kw,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                temperature=1.0,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            usage = [c.usage async for c in stream if c.usage is not None]
            return usage[0].completion_tokens
        done = await async_client.chat.completions.create(
            **kw, max_tokens=10, n=2, temperature=0.8, extra_body={"ignore_eos": True}
        )
        assert [c.finish_reason for c in done.choices] == ["length", "length"]
        return done.usage.completion_tokens

    results = await asyncio.gather(*(one(i) for i in range(24)))
    assert [r for i, r in enumerate(results) if i % 3 == 1] == [12] * 8
    assert [r for i, r in enumerate(results) if i % 3 == 2] == [20] * 8
    deadline = time.monotonic() + 10
    blocks = engine.engine.blocks
    while engine.engine.has_unfinished() or blocks.num_free_blocks != blocks.num_blocks:
        assert time.monotonic() < deadline, "aborted requests were not cleaned up"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_call(client: openai.OpenAI, tool_choice) -> None:
    """tool_choice "required" or named: constrained decoding makes even a random model call."""
    names = ["get_date", "get_time"] if tool_choice == "required" else ["get_time"]
    tools = [{"type": "function", "function": {"name": n}} for n in ["get_date", "get_time"]]
    kwargs = {"model": MODEL, "messages": USER, "tools": tools, "tool_choice": tool_choice}
    # A seed with which the random model closes the call in the fixture's short context.
    kwargs |= {"max_tokens": 80, "temperature": 1.0, "seed": 9}
    [choice] = client.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name in names and isinstance(json.loads(call.function.arguments), dict)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    [streamed] = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (
        call.function.name,
        call.function.arguments,
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
