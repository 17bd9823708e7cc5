"""The tier server over a real engine (random-weight MoE checkpoint), in process via ASGI."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.engine.llm_engine import EngineConfig, LLMEngine
from serving.model.decode_graphs import Progress
from serving.model.tokenizer import Tokenizer

MODEL = "tiny-moe"
MAX_MODEL_LEN = 256
USER = [{"role": "user", "content": "Write a haiku about the sea."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def aengine(random_checkpoint: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(kv_cache_bytes=8 << 20, max_model_len=MAX_MODEL_LEN)
    engine = AsyncEngine(LLMEngine.from_checkpoint(random_checkpoint, config))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tokenizer(random_checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_checkpoint)


def _client(app, raise_app_exceptions: bool = True, **headers: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://tier", headers=headers)


@pytest.fixture
async def client(aengine: AsyncEngine, tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(build_app(aengine, tokenizer, MODEL)) as c:
        yield c


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": 0, **fields}


def events(response: httpx.Response) -> list[dict]:
    """The SSE stream's JSON events; asserts it is well formed and ends in [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    assert all(block.startswith("data: ") for block in blocks[:-1])
    return [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    assert "Traceback" not in response.text
    if code is not None:
        assert error["code"] == code
    return error


async def test_models_and_health(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_MODEL_LEN)]
    health = await client.get("/health")
    assert health.status_code == 200


async def test_health_is_503_with_progress_while_warming(
    aengine: AsyncEngine, tokenizer, monkeypatch
) -> None:
    """Not healthy until the decode graphs are compiled (vLLM's /health), with how far they
    are; the tier answers requests meanwhile (eagerly)."""
    warmups = iter([Progress(2, 6, done=False), Progress(6, 6, done=True)])
    monkeypatch.setattr(aengine.engine, "warmup", lambda: next(warmups))
    async with _client(build_app(aengine, tokenizer, MODEL)) as c:
        warming = await c.get("/health")
        assert_error(warming, 503, code="warming_up")
        assert warming.json()["warmup"] == {"graphs_compiled": 2, "graphs_wanted": 6}
        assert "2 of 6" in warming.json()["error"]["message"]
        assert warming.headers["retry-after"] == "1"
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        ready = await c.get("/health")
        assert ready.status_code == 200 and ready.json() == {"status": "ok"}


async def test_health_when_the_engine_is_dead(aengine: AsyncEngine, tokenizer) -> None:
    dead = AsyncEngine(aengine.engine)
    dead.stop()  # its thread exits; the shared engine itself is untouched
    async with _client(build_app(dead, tokenizer, MODEL)) as c:
        assert_error(await c.get("/health"), 503)


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
    async with _client(build_app(aengine, tokenizer, MODEL), raise_app_exceptions=False) as c:
        error = assert_error(await c.post("/v1/completions", json={"prompt": "x"}), 500)
    assert "secret" not in error["message"] and error["type"] == "server_error"


async def test_api_key(aengine: AsyncEngine, tokenizer: Tokenizer) -> None:
    app = build_app(aengine, tokenizer, MODEL, api_key="sk-right")
    async with _client(app) as anonymous:
        assert_error(await anonymous.get("/v1/models"), 401, "invalid_api_key")
        assert_error(await anonymous.post("/v1/chat/completions", content=b"{bad"), 401)
        assert_error(await anonymous.post("/tokenize", json={"prompt": "x"}), 401)
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code == 200
    async with _client(app, authorization="Bearer sk-wrong") as wrong:
        assert_error(await wrong.get("/v1/models"), 401, "invalid_api_key")
    async with _client(app, authorization="Bearer sk-right") as right:
        assert (await right.get("/v1/models")).status_code == 200
        assert (
            await right.post("/v1/chat/completions", json=chat(max_tokens=1))
        ).status_code == 200


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_count_the_requests(aengine: AsyncEngine, tokenizer: Tokenizer) -> None:
    async with _client(build_app(aengine, tokenizer, MODEL)) as c:
        responses = [
            await c.post("/v1/chat/completions", json=chat(n=2)),
            await c.post("/v1/completions", json={"prompt": ["a", "b c"], "max_tokens": 3}),
        ]
        stream = await c.post(
            "/v1/chat/completions",
            json=chat(stream=True, stream_options={"include_usage": True}),
        )
        usages = [r.json()["usage"] for r in responses] + [events(stream)[-1]["usage"]]
        samples = _samples((await c.get("/metrics")).text)
    label = (("model_name", MODEL),)
    num_requests = 4  # one engine request per prompt
    assert samples[("tierserve_prompt_tokens_total", label)] == sum(
        u["prompt_tokens"] for u in usages
    )
    assert samples[("tierserve_generation_tokens_total", label)] == sum(
        u["completion_tokens"] for u in usages
    )
    finished = sum(
        v for (name, _), v in samples.items() if name == "tierserve_request_success_total"
    )
    assert finished == num_requests
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert samples[(f"tierserve_{histogram}_seconds_count", label)] == num_requests
    assert samples[("tierserve_inter_token_latency_seconds_count", label)] > 0
    assert samples[("tierserve_num_requests_running", label)] == 0
    assert samples[("tierserve_num_requests_waiting", label)] == 0
    assert samples[("tierserve_kv_cache_usage_perc", label)] == 0


async def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_aborts(aengine: AsyncEngine, tokenizer: Tokenizer, stream) -> None:
    """A client that goes away mid-generation frees its request's KV blocks at once."""
    app = build_app(aengine, tokenizer, MODEL)
    engine = aengine.engine
    body = json.dumps(chat(max_tokens=200, ignore_eos=True, stream=stream)).encode()
    gone, sent = asyncio.Event(), []

    async def receive() -> dict:
        if not sent:
            sent.append(None)
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("test", 1),
        "server": ("tier", 80),
    }
    call = asyncio.ensure_future(app(scope, receive, send))
    await _wait_for(
        lambda: bool(engine.requests) and engine.blocks.num_free_blocks < engine.blocks.num_blocks
    )
    if stream:  # a token or two reached the client first
        await _wait_for(lambda: sum(m["type"] == "http.response.body" for m in messages) >= 2)
    gone.set()
    await asyncio.wait_for(call, 30)
    await _wait_for(lambda: not engine.requests)
    await _wait_for(lambda: engine.blocks.num_free_blocks == engine.blocks.num_blocks)
    async with _client(app) as c:
        samples = _samples((await c.get("/metrics")).text)
    label = (("finished_reason", "abort"), ("model_name", MODEL))
    assert samples[("tierserve_request_success_total", label)] == 1


def test_health_checks_stay_out_of_the_access_log() -> None:
    from serving.api_server.api_server import _not_health_checks

    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 args, None)  # fmt: skip

    assert not _not_health_checks(record("/health"))
    assert _not_health_checks(record("/v1/models"))
