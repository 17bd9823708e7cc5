"""The tier server over a real engine (random-weight MoE checkpoint), in process via ASGI."""

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.testclient import TestClient

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.model.tokenizer import Tokenizer
from tests.serving.api_server.tier_app import (
    MAX_MODEL_LEN,
    MODEL,
    USER,
    asgi_client,
    assert_error,
    chat,
    events,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
async def client(aengine: AsyncEngine, tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(build_app(aengine, tokenizer, MODEL)) as c:
        yield c


def test_the_app_runs_its_on_shutdown_when_it_shuts_down(
    aengine: AsyncEngine, tokenizer: Tokenizer
) -> None:
    """Where the server stops its engine and compile process: uvicorn raises a SIGTERM again
    after the app's shutdown, which ends the process before code after `uvicorn.run`."""
    calls: list[str] = []
    app = build_app(aengine, tokenizer, MODEL, on_shutdown=lambda: calls.append("stopped"))
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 200
        assert calls == []
    assert calls == ["stopped"]


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_MODEL_LEN)]
    health = await client.get("/health")
    assert health.status_code == 200


async def test_chat_completion(client: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    prompt = tokenizer.encode(tokenizer.apply_chat_template(USER, add_generation_prompt=True))
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert 1 <= usage["completion_tokens"] <= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_stream_matches_whole(client: httpx.AsyncClient) -> None:
    whole = (await client.post("/v1/chat/completions", json=chat(max_tokens=8))).json()
    response = await client.post(
        "/v1/chat/completions",
        json=chat(max_tokens=8, stream=True, stream_options={"include_usage": True}),
    )
    chunks = events(response)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0] for c in chunks[:-1]]
    text = "".join(d["delta"].get("content") or "" for d in deltas)
    assert text == whole["choices"][0]["message"]["content"]
    assert [d["finish_reason"] for d in deltas][-1] == whole["choices"][0]["finish_reason"]
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all("usage" not in c for c in chunks[:-1])


async def test_chat_n_and_logprobs(client: httpx.AsyncClient) -> None:
    body = (
        await client.post(
            "/v1/chat/completions", json=chat(n=2, logprobs=True, top_logprobs=3, seed=1)
        )
    ).json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    num_logprobs = 0
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        num_logprobs += len(content)
        for entry in content:
            assert len(entry["top_logprobs"]) == 3
            assert entry["bytes"] == list(entry["token"].encode())
            assert entry["logprob"] <= entry["top_logprobs"][0]["logprob"] + 1e-5
    assert num_logprobs == body["usage"]["completion_tokens"]

    streamed = chat(n=2, logprobs=True, top_logprobs=1, stream=True)
    response = await client.post(
        "/v1/chat/completions", json={**streamed, "stream_options": {"include_usage": True}}
    )
    chunks = events(response)
    choices = [choice for c in chunks for choice in c["choices"]]
    assert {c["index"] for c in choices} == {0, 1}
    entries = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 1 for e in entries)


async def test_chat_with_tools_and_template_kwargs(
    client: httpx.AsyncClient, tokenizer: Tokenizer
) -> None:
    body = chat(
        tools=[WEATHER], tool_choice="auto", chat_template_kwargs={"enable_thinking": False}
    )
    usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    rendered = tokenizer.apply_chat_template(USER, tools=[WEATHER], enable_thinking=False)
    assert usage["prompt_tokens"] == len(tokenizer.encode(rendered))
    tokenized = await client.post(
        "/tokenize",
        json={
            "messages": USER,
            "tools": [WEATHER],
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert tokenized.json()["tokens"] == tokenizer.encode(rendered)


async def test_chat_json_object(client: httpx.AsyncClient) -> None:
    body = chat(max_tokens=64, response_format={"type": "json_object"})
    [choice] = (await client.post("/v1/chat/completions", json=body)).json()["choices"]
    content = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # cut off by max_tokens: still a JSON object's beginning
        assert content.strip() == "" or content.lstrip().startswith("{")


async def test_completions(client: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("import os\n")
    for prompt, num_prompts in (
        ("def main():", 1),
        (["a = 1", "b = 2"], 2),
        (ids, 1),
        ([ids, ids[:2]], 2),
    ):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2}
        response = (await client.post("/v1/completions", json=body)).json()
        assert response["object"] == "text_completion"
        assert sorted(c["index"] for c in response["choices"]) == list(range(2 * num_prompts))
        assert response["usage"]["completion_tokens"] <= 3 * 2 * num_prompts
    assert response["usage"]["prompt_tokens"] == len(ids) + 2


async def test_completions_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "def main():", "max_tokens": 4, "temperature": 0}
    whole = (
        await client.post("/v1/completions", json={**body, "echo": True, "logprobs": 2})
    ).json()
    [choice] = whole["choices"]
    assert choice["text"].startswith("def main():")
    logprobs, usage = choice["logprobs"], whole["usage"]
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)

    stream = await client.post(
        "/v1/completions", json={**body, "echo": True, "logprobs": 2, "stream": True}
    )
    chunks = [c["choices"][0] for c in events(stream)]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == logprobs["tokens"]
    assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == offsets
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


async def test_tokenize_detokenize_round_trip(client: httpx.AsyncClient) -> None:
    text = "def f(x):\n    return x * 2  # ünïcödé"
    tokenized = (await client.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    detokenized = await client.post("/detokenize", json={"tokens": tokenized["tokens"]})
    assert detokenized.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", {"model": MODEL}, 400, None),
        ("/v1/chat/completions", chat(temperature="hot"), 400, None),
        ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400, None),
        ("/v1/chat/completions", chat(model="gpt-4"), 404, "model_not_found"),
        ("/v1/chat/completions", chat(max_tokens=MAX_MODEL_LEN), 400, None),
        ("/v1/chat/completions", chat(tool_choice="required"), 400, None),
        (
            "/v1/chat/completions",
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            400,
            None,
        ),
        ("/v1/chat/completions", chat(chat_template_kwargs={"messages": []}), 400, None),
        ("/v1/chat/completions", chat(logit_bias={"1": 5}), 400, None),
        ("/v1/chat/completions", chat(stop_token_ids=[10**6]), 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": "x " * 400}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": [10**6]}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": [-1]}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, None),
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model_not_found"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model_not_found"),
        ("/tokenize", {}, 400, None),
        ("/detokenize", {"tokens": [10**6]}, 400, None),
        ("/detokenize", {"tokens": "abc"}, 400, None),
        ("/v1/nowhere", {}, 404, None),
    ],
)
async def test_bad_requests(client: httpx.AsyncClient, path, body, status, code) -> None:
    if isinstance(body, bytes):
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    else:
        response = await client.post(path, json=body)
    assert_error(response, status, code)


async def test_context_length_error_names_the_limit(client: httpx.AsyncClient) -> None:
    error = assert_error(
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**4}), 400
    )
    assert f"maximum context length is {MAX_MODEL_LEN}" in error["message"]


async def test_method_not_allowed_is_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/chat/completions"), 405)


async def test_unexpected_errors_are_generic_500s(aengine, tokenizer, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(tokenizer, "encode", boom)
    async with asgi_client(build_app(aengine, tokenizer, MODEL), raise_app_exceptions=False) as c:
        error = assert_error(await c.post("/v1/completions", json={"prompt": "x"}), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"
