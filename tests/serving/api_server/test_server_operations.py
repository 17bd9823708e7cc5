"""The tier server's operations over a real engine: /health through warm-up and a dead
engine, the API key, Prometheus metrics parsed by prometheus-client, and a client that goes
away mid-generation."""

import asyncio
import json
import logging
from collections.abc import Callable

import pytest

from serving.api_server.api_server import build_app
from serving.engine.async_engine import AsyncEngine
from serving.model.graphs.decode import Progress
from serving.model.tokenizer import Tokenizer
from tests.serving.api_server.tier_app import (
    MODEL,
    asgi_client,
    assert_error,
    chat,
    events,
    metric_samples,
)


async def test_health_is_503_with_progress_while_warming(
    aengine: AsyncEngine, tokenizer, monkeypatch
) -> None:
    """Not healthy until the decode graphs full speed needs are compiled (vLLM's /health),
    with how far they are; the tier answers requests meanwhile (eagerly). Ready with one
    graph of four: the others are being compiled apart."""
    warmups = iter(
        [Progress(0, 4, False, False), Progress(1, 4, True, False), Progress(4, 4, True, True)]
    )
    monkeypatch.setattr(aengine.engine, "warmup", lambda: next(warmups))
    async with asgi_client(build_app(aengine, tokenizer, MODEL)) as c:
        warming = await c.get("/health")
        assert_error(warming, 503, code="warming_up")
        assert warming.json()["warmup"] == {"graphs_compiled": 0, "graphs_wanted": 4}
        assert "0 of 4" in warming.json()["error"]["message"]
        assert warming.headers["retry-after"] == "1"
        assert (await c.post("/v1/chat/completions", json=chat())).status_code == 200
        ready = await c.get("/health")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ok",
            "warmup": {"graphs_compiled": 1, "graphs_wanted": 4},
        }
        assert (await c.get("/health")).json() == {"status": "ok"}


async def test_health_when_the_engine_is_dead(aengine: AsyncEngine, tokenizer) -> None:
    dead = AsyncEngine(aengine.engine)
    dead.stop()  # its thread exits; the shared engine itself is untouched
    async with asgi_client(build_app(dead, tokenizer, MODEL)) as c:
        assert_error(await c.get("/health"), 503)


async def test_api_key(aengine: AsyncEngine, tokenizer: Tokenizer) -> None:
    app = build_app(aengine, tokenizer, MODEL, api_key="sk-right")
    async with asgi_client(app) as anonymous:
        assert_error(await anonymous.get("/v1/models"), 401, "invalid_api_key")
        assert_error(await anonymous.post("/v1/chat/completions", content=b"{bad"), 401)
        assert_error(await anonymous.post("/tokenize", json={"prompt": "x"}), 401)
        assert (await anonymous.get("/health")).status_code == 200
        assert (await anonymous.get("/metrics")).status_code == 200
    async with asgi_client(app, authorization="Bearer sk-wrong") as wrong:
        assert_error(await wrong.get("/v1/models"), 401, "invalid_api_key")
    async with asgi_client(app, authorization="Bearer sk-right") as right:
        assert (await right.get("/v1/models")).status_code == 200
        assert (
            await right.post("/v1/chat/completions", json=chat(max_tokens=1))
        ).status_code == 200


async def test_metrics_count_the_requests(aengine: AsyncEngine, tokenizer: Tokenizer) -> None:
    async with asgi_client(build_app(aengine, tokenizer, MODEL)) as c:
        responses = [
            await c.post("/v1/chat/completions", json=chat(n=2)),
            await c.post("/v1/completions", json={"prompt": ["a", "b c"], "max_tokens": 3}),
        ]
        stream = await c.post(
            "/v1/chat/completions",
            json=chat(stream=True, stream_options={"include_usage": True}),
        )
        usages = [r.json()["usage"] for r in responses] + [events(stream)[-1]["usage"]]
        samples = metric_samples((await c.get("/metrics")).text)
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
    async with asgi_client(app) as c:
        samples = metric_samples((await c.get("/metrics")).text)
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
