"""Backpressure and security of the gateway in process over scripted tiers: bounded queues
that answer 429 with Retry-After (never a hang, never a 5xx), spill before refusing, the
stream cap, the request timeout, size limits, API keys, rate limits, CORS, request ids,
JSON logs, malformed upstream answers, and no stack trace in any body."""

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI

from serving.gateway.request_log import JSONFormatter
from tests.serving.gateway.scripted_tiers import (
    CHAT,
    ScriptedTier,
    chat_json,
    make_app,
    metric,
    sse_events,
    stream_of,
)


def client_of(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


class Gate:
    """Holds a tier's answers until opened, so requests pile up at the gateway."""

    def __init__(self, tier: ScriptedTier) -> None:
        self.open = asyncio.Event()
        self.arrived = 0
        self.tier = tier

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.arrived += 1
        await self.open.wait()
        return self.tier.answer(request)


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def one_slot_full_tier(tiers: dict[str, ScriptedTier]) -> tuple[Gate, FastAPI]:
    """A gateway whose full tier takes one request at a time and queues one, its answers
    held by a gate."""
    gate = Gate(tiers["full"])
    tiers["full"].handler = gate
    return gate, make_app(tiers, limits={"full": {"max_in_flight": 1, "max_queue": 1}})


async def test_full_queue_answers_429_at_once_then_serves_the_queued(tiers):
    gate, app = one_slot_full_tier(tiers)
    body = CHAT | {"model": "full"}
    async with client_of(app) as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        queued = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await until(lambda: gate.arrived == 1)
        await until(lambda: metric(app, "tierserve_gateway_queue_depth", tier="full") == 1)
        start = time.monotonic()
        refused = await c.post("/v1/chat/completions", json=body)
        assert time.monotonic() - start < 1.0  # refused at once, not after a wait
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.headers["x-tierserve-tier"] == "full"
        assert refused.json()["error"] | {"message": ""} == {
            "message": "", "type": "overloaded", "param": None, "code": "queue_full"
        }  # fmt: skip
        gate.open.set()
        assert [r.status_code for r in await asyncio.gather(first, queued)] == [200, 200]
    assert metric(app, "tierserve_gateway_rejections_total", reason="queue_full") == 1
    assert metric(app, "tierserve_gateway_admitted_requests", tier="full") == 0


async def test_a_request_queued_past_the_timeout_gets_429(tiers):
    gate = Gate(tiers["full"])
    tiers["full"].handler = gate
    limits = {"full": {"max_in_flight": 1, "max_queue": 4}, "queue_timeout_s": 0.2}
    app = make_app(tiers, limits=limits)
    async with client_of(app) as c:
        held = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT | {"model": "full"}))
        await until(lambda: gate.arrived == 1)
        waited = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
        assert waited.status_code == 429 and waited.json()["error"]["code"] == "queue_timeout"
        gate.open.set()
        assert (await held).status_code == 200
    assert metric(app, "tierserve_gateway_queue_depth", tier="full") == 0


async def test_a_routed_request_spills_before_it_is_refused(tiers):
    gate = Gate(tiers["highspeed"])
    tiers["highspeed"].handler = gate
    app = make_app(tiers, limits={"highspeed": {"max_in_flight": 1, "max_queue": 0}})
    async with client_of(app) as c:
        held = asyncio.create_task(c.post("/v1/chat/completions", json=CHAT))  # auto: highspeed
        await until(lambda: gate.arrived == 1)
        spilled = await c.post("/v1/chat/completions", json=CHAT)
        assert spilled.headers["x-tierserve-tier"] == "full"
        assert spilled.headers["x-tierserve-reason"] == "spill"
        pinned = await c.post("/v1/chat/completions", json=CHAT | {"model": "highspeed"})
        assert pinned.status_code == 429  # a client that named the tier is not moved
        gate.open.set()
        assert (await held).status_code == 200


async def test_streams_beyond_the_cap_get_429(tiers):
    opened = asyncio.Event()

    async def held_stream() -> AsyncIterator[bytes]:
        yield sse_events("m-full")[0]
        await opened.wait()
        for event in sse_events("m-full")[1:]:
            yield event

    def handler(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=held_stream())
        return tiers["full"].answer(request)

    tiers["full"].handler = handler
    app = make_app(tiers, limits={"max_concurrent_streams": 1})
    body = CHAT | {"model": "full", "stream": True}
    async with client_of(app) as c:
        first = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await until(lambda: metric(app, "tierserve_gateway_active_streams") == 1)
        second = await c.post("/v1/chat/completions", json=body)
        assert second.status_code == 429
        assert second.json()["error"]["code"] == "too_many_streams"
        whole = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
        assert whole.status_code == 200  # the cap is on streams only
        opened.set()
        assert (await first).content.endswith(b"data: [DONE]\n\n")
        again = await c.post("/v1/chat/completions", json=body)
        assert again.status_code == 200
    assert metric(app, "tierserve_gateway_active_streams") == 0


async def test_request_timeout_is_a_504_and_ends_a_slow_stream(tiers):
    async def never(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")

    async def stalls() -> AsyncIterator[bytes]:
        yield sse_events("m-fast")[0]
        await asyncio.sleep(60)
        yield b""

    tiers["full"].handler = never
    tiers["highspeed"].handler = lambda r: httpx.Response(200, content=stalls())
    app = make_app(tiers, limits={"request_timeout_s": 0.3})
    async with client_of(app) as c:
        start = time.monotonic()
        whole = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
        assert 0.25 < time.monotonic() - start < 5
        assert whole.status_code == 504
        assert whole.json()["error"]["code"] == "request_timeout"
        stream = await c.post(
            "/v1/chat/completions", json=CHAT | {"model": "highspeed", "stream": True}
        )
        events = stream.content.split(b"\n\n")
        assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "request_timeout"
        assert events[2] == b"data: [DONE]"
    assert metric(app, "tierserve_gateway_admitted_requests", tier="full") == 0


async def test_prompt_and_body_size_limits(tiers):
    app = make_app(tiers, limits={"max_prompt_chars": 10, "max_body_bytes": 2000})
    async with client_of(app) as c:
        long = await c.post("/v1/completions", json={"prompt": "x" * 11, "max_tokens": 1})
        assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
        big = {"messages": [{"role": "user", "content": "hi"}], "pad": "x" * 3000}
        declared = await c.post("/v1/chat/completions", json=big)
        assert declared.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(10):
                yield b" " * 500

        streamed = await c.post("/v1/chat/completions", content=chunks())
        assert streamed.status_code == 413
        assert streamed.json()["error"]["code"] == "body_too_large"
    assert not any(t.calls for t in tiers.values())
    assert metric(app, "tierserve_gateway_rejections_total", reason="body_too_large") == 2


async def test_several_api_keys_from_config_file_and_env(tiers, tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nfile-key\n\n")
    monkeypatch.setenv("TIERSERVE_API_KEYS", "env-a, env-b")
    app = make_app(
        tiers, api_key="legacy", auth={"api_keys": ["listed"], "api_keys_file": keys_file}
    )
    async with client_of(app) as c:
        for key in ("legacy", "listed", "file-key", "env-a", "env-b"):
            bearer = {"Authorization": f"Bearer {key}"}
            ok = await c.post("/v1/chat/completions", json=CHAT, headers=bearer)
            assert ok.status_code == 200, key
        for header in ({}, {"Authorization": "Bearer env"}, {"Authorization": "Basic env-a"}):
            refused = await c.post("/v1/chat/completions", json=CHAT, headers=header)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await c.get("/health")).status_code == 200


async def test_rate_limits_per_key_with_retry_after(tiers):
    app = make_app(
        tiers,
        auth={"api_keys": ["a", "b"]},
        rate_limits={"requests_per_minute": 2, "tokens_per_minute": 600},
    )
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("a", "b"))
    async with client_of(app) as c:
        statuses = [
            (await c.post("/v1/chat/completions", json=CHAT, headers=a)).status_code
            for _ in range(3)
        ]
        assert statuses == [200, 200, 429]
        refused = await c.post("/v1/chat/completions", json=CHAT, headers=a)
        assert refused.json()["error"]["type"] == "requests"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 30  # 2 per minute: one per 30 s
        costly = await c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 500}, headers=b)
        assert costly.status_code == 200  # 500 of b's 600 tokens charged, 7 used: refunded
        again = await c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 500}, headers=b)
        assert again.status_code == 200
    assert metric(app, "tierserve_gateway_rejections_total", reason="rate_limit") == 2


async def test_token_rate_limit_refuses_what_the_bucket_cannot_hold(tiers):
    app = make_app(tiers, rate_limits={"tokens_per_minute": 100})
    async with client_of(app) as c:
        tiers["full"].handler = lambda r: httpx.Response(200, json=chat_json("m-full"))
        spent = chat_json("m-full") | {"usage": {"prompt_tokens": 5, "completion_tokens": 90,
                                                 "total_tokens": 95}}  # fmt: skip
        tiers["highspeed"].handler = lambda r: httpx.Response(200, json=spent)
        first = await c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 90})
        assert first.status_code == 200
        refused = await c.post("/v1/chat/completions", json=CHAT | {"max_tokens": 90})
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"


async def test_cors_answers_allowed_origins_only(tiers):
    app = make_app(tiers, cors={"allow_origins": ["https://app.example"]}, api_key="k")
    preflight = {"Access-Control-Request-Method": "POST"}
    async with client_of(app) as c:
        allowed = await c.options(
            "/v1/chat/completions", headers=preflight | {"Origin": "https://app.example"}
        )
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = await c.options(
            "/v1/chat/completions", headers=preflight | {"Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
        refused = await c.post(
            "/v1/chat/completions", json=CHAT, headers={"Origin": "https://app.example"}
        )
        assert refused.status_code == 401  # CORS does not open the API
        assert refused.headers["access-control-allow-origin"] == "https://app.example"


async def test_request_id_is_kept_or_made_and_reaches_the_tier(client, tiers):
    mine = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-1"})
    assert mine.headers["x-request-id"] == "abc-1"
    assert tiers["highspeed"].headers[-1]["x-request-id"] == "abc-1"
    for bad in ("has space", "x" * 200, 'quote"d'):
        made = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad})
        assert made.headers["x-request-id"] != bad and len(made.headers["x-request-id"]) == 32
        assert tiers["highspeed"].headers[-1]["x-request-id"] == made.headers["x-request-id"]
    refused = await client.post("/v1/chat/completions", json={"model": "gpt-17", **CHAT})
    assert refused.status_code == 404 and refused.headers["x-request-id"]


async def test_each_request_logs_one_json_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="tierserve.requests"):
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "log-1"})
    [record] = [r for r in caplog.records if r.name == "tierserve.requests"]
    line = json.loads(JSONFormatter().format(record))
    assert line["request_id"] == "log-1" and line["tier"] == "highspeed"
    assert line["status"] == 200 and line["outcome"] == "success" and line["latency_ms"] > 0
    assert line["level"] == "info" and line["ts"].endswith("Z")


async def test_malformed_upstream_answers_fall_back_then_502(tiers):
    tiers["full"].handler = lambda r: httpx.Response(200, content=b"<html>oops</html>")
    app = make_app(tiers)
    async with client_of(app) as c:
        rescued = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
        assert rescued.status_code == 200 and rescued.headers["x-tierserve-tier"] == "highspeed"
        tiers["highspeed"].handler = lambda r: httpx.Response(200, json=["not", "an", "object"])
        failed = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
        assert failed.status_code == 502
        assert failed.json()["error"]["code"] == "malformed_response"
        for tier in tiers.values():  # streams: what arrives first is not an SSE field
            tier.handler = lambda r: httpx.Response(200, content=stream_of([b"<html>\n\n"]))
        stream = await c.post("/v1/chat/completions", json=CHAT | {"stream": True})
        assert stream.status_code == 502
    errors = {
        tier: metric(app, "tierserve_gateway_upstream_errors_total", tier=tier,
                     cause="malformed_response")
        for tier in tiers
    }  # fmt: skip
    assert errors == {"full": 3, "highspeed": 2}


async def test_a_bug_is_a_500_without_a_stack_trace(tiers, monkeypatch):
    app = make_app(tiers)

    def broken(*args: object) -> None:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(app.state.gateway, "_answer", broken)
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert "secret" not in response.text and "Traceback" not in response.text
    assert response.json()["error"]["type"] == "server_error"
    assert metric(app, "tierserve_gateway_admitted_requests", tier="highspeed") == 0


async def test_a_client_that_leaves_the_queue_frees_its_place(tiers):
    gate, app = one_slot_full_tier(tiers)
    body = CHAT | {"model": "full"}
    async with client_of(app) as c:
        held = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await until(lambda: gate.arrived == 1)
        leaving = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await until(lambda: metric(app, "tierserve_gateway_queue_depth", tier="full") == 1)
        leaving.cancel()
        await until(lambda: metric(app, "tierserve_gateway_queue_depth", tier="full") == 0)
        gate.open.set()
        assert (await held).status_code == 200
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
    assert metric(app, "tierserve_gateway_admitted_requests", tier="full") == 0
    assert gate.arrived == 2  # the one that left never reached the tier
