"""The gateway in process over scripted tiers (httpx MockTransport): fallback before the first
byte, never after it, one outcome per request, pass-through of tier errors, bad input,
spill, cascade and usage accounting."""

import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from serving.gateway.upstream import TierState
from tests import REPO
from tests.serving.gateway.scripted_tiers import (
    CHAT,
    MODELS,
    chat_json,
    make_app,
    metric,
    sse_events,
    stream_of,
)


def gateway_app(client: httpx.AsyncClient) -> FastAPI:
    return client._transport.app  # type: ignore[attr-defined]


async def test_5xx_falls_back_once_and_counts_one_outcome(client, tiers):
    tiers["full"].handler = lambda r: httpx.Response(503, json={"error": {"message": "busy"}})
    response = await client.post("/v1/chat/completions", json=CHAT | {"model": "full"})
    assert response.status_code == 200
    assert response.headers["x-tierserve-tier"] == "highspeed"
    assert response.headers["x-tierserve-fallback-from"] == "full"
    assert response.json()["tierserve"]["reason"] == "fallback"
    assert response.json()["model"] == "m-fast"
    assert len(tiers["full"].calls) == len(tiers["highspeed"].calls) == 1
    app = gateway_app(client)
    assert metric(app, "tierserve_gateway_fallbacks_total", from_tier="full", cause="http_503") == 1
    assert metric(app, "tierserve_gateway_requests_total", tier="highspeed", outcome="success") == 1
    assert metric(app, "tierserve_gateway_requests_total", tier="full") == 0
    assert metric(app, "tierserve_gateway_generation_tokens_total", tier="highspeed") == 2


async def test_both_tiers_down_is_one_openai_error(client, tiers):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    for tier in tiers.values():
        tier.handler = refuse
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    app = gateway_app(client)
    outcomes = sum(
        metric(app, "tierserve_gateway_requests_total", tier=t, outcome="error") for t in MODELS
    )
    assert outcomes == 1
    assert sum(len(t.calls) for t in tiers.values()) == 2  # one try each, no more


async def test_fallback_can_be_switched_off(tiers):
    tiers["full"].handler = lambda r: httpx.Response(500, text="boom")
    app = make_app(tiers, fallback={"enabled": False})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
    assert response.status_code == 502 and not tiers["highspeed"].calls


async def test_stream_falls_back_before_its_first_byte(client, tiers):
    tiers["highspeed"].handler = lambda r: httpx.Response(502, text="bad gateway")
    body = CHAT | {"model": "highspeed", "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.headers["x-tierserve-tier"] == "full"
    assert response.content == b"".join(sse_events("m-full")[:3] + sse_events("m-full")[-1:])


async def test_a_begun_stream_is_never_restarted(client, tiers):
    async def breaks_off() -> AsyncIterator[bytes]:
        yield sse_events("m-full")[0]
        raise httpx.ReadError("connection reset")

    tiers["full"].handler = lambda r: httpx.Response(200, content=breaks_off())
    response = await client.post(
        "/v1/chat/completions", json=CHAT | {"model": "full", "stream": True}
    )
    events = response.content.split(b"\n\n")
    assert events[0] + b"\n\n" == sse_events("m-full")[0]
    assert json.loads(events[1].removeprefix(b"data: "))["error"]["type"] == "server_error"
    assert events[2] == b"data: [DONE]"
    assert not tiers["highspeed"].calls
    app = gateway_app(client)
    assert metric(app, "tierserve_gateway_requests_total", tier="full", outcome="error") == 1
    assert metric(app, "tierserve_gateway_requests_total", outcome="success") == 0


async def test_stream_usage_is_counted_and_dropped_unless_asked(client, tiers):
    body = CHAT | {"model": "full", "stream": True}
    plain = await client.post("/v1/chat/completions", json=body)
    assert b'"usage"' not in plain.content
    assert tiers["full"].calls[0]["stream_options"] == {"include_usage": True}
    asked = await client.post(
        "/v1/chat/completions", json=body | {"stream_options": {"include_usage": True}}
    )
    assert asked.content == b"".join(sse_events("m-full"))
    app = gateway_app(client)
    assert metric(app, "tierserve_gateway_prompt_tokens_total", tier="full") == 10


async def test_the_tier_gets_the_clients_body(client, tiers):
    body = CHAT | {"model": "full", "top_k": 3, "vendor_extra": {"a": [1, None]}, "stop": None}
    await client.post("/v1/chat/completions", json=body)
    assert tiers["full"].calls == [body | {"model": "m-full"}]


async def test_events_split_across_reads_pass_whole(client, tiers):
    whole = b"".join(sse_events("m-full"))
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    tiers["full"].handler = lambda r: httpx.Response(200, content=stream_of(pieces))
    response = await client.post(
        "/v1/chat/completions", json=CHAT | {"model": "full", "stream": True}
    )
    events = sse_events("m-full")
    assert response.content == b"".join(events[:3] + events[-1:])
    app = gateway_app(client)
    assert metric(app, "tierserve_gateway_generation_tokens_total", tier="full") == 2


async def test_tier_4xx_passes_through_without_retry(client, tiers):
    error = {"error": {"message": "temperature too high", "type": "invalid_request_error",
                       "param": "temperature", "code": None}}  # fmt: skip
    tiers["full"].handler = lambda r: httpx.Response(400, json=error)
    response = await client.post("/v1/chat/completions", json=CHAT | {"model": "full"})
    assert response.status_code == 400 and response.json() == error
    assert not tiers["highspeed"].calls
    app = gateway_app(client)
    assert metric(app, "tierserve_gateway_requests_total", tier="full", outcome="client_error") == 1


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        ({"model": "auto"}, {}, 400, "messages"),
        (CHAT | {"model": "gpt-17"}, {}, 404, "model"),
        (CHAT, {"X-Tierserve-Tier": "medium"}, 400, "header"),
        ({"model": "auto", "messages": []}, {}, 400, "messages"),
    ],
)
async def test_bad_input_gets_openai_errors(client, tiers, body, headers, status, param):
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert not any(t.calls for t in tiers.values())


async def test_malformed_json_is_a_400(client):
    response = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "headers", "tier", "reason"),
    [
        ({"model": "highspeed"}, {"X-Tierserve-Tier": "full"}, "full", "header"),
        ({"model": "m-fast", "reasoning_effort": "high"}, {}, "highspeed", "model"),
        ({"model": "auto", "reasoning_effort": "high"}, {}, "full", "reasoning_effort"),
        ({"reasoning_effort": "low"}, {}, "highspeed", "reasoning_effort"),
        ({"reasoning_effort": "medium"}, {}, "highspeed", "score_below_threshold"),
    ],
)
async def test_overrides(client, tiers, fields, headers, tier, reason):
    response = await client.post("/v1/chat/completions", json=CHAT | fields, headers=headers)
    assert response.headers["x-tierserve-tier"] == tier
    assert response.headers["x-tierserve-reason"] == reason
    assert tiers[tier].calls[0]["model"] == MODELS[tier]


async def test_spill_to_full_when_highspeed_is_saturated(client, tiers):
    gateway_app(client).state.gateway.admission.queues["highspeed"].running = 64
    response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.headers["x-tierserve-tier"] == "full"
    assert response.headers["x-tierserve-reason"] == "spill"


async def test_cascade_escalates_an_invalid_json_answer(tiers):
    tiers["highspeed"].handler = lambda r: httpx.Response(200, json=chat_json("m-fast", "not json"))
    tiers["full"].handler = lambda r: httpx.Response(200, json=chat_json("m-full", '{"a": 1}'))
    app = make_app(tiers, router={"policy": "heuristic", "cascade": {"enabled": True}})
    body = CHAT | {"response_format": {"type": "json_object"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", json=body)
    assert response.json()["choices"][0]["message"]["content"] == '{"a": 1}'
    assert response.headers["x-tierserve-reason"] == "cascade"
    assert metric(app, "tierserve_gateway_cascade_escalations_total", cause="invalid_json") == 1
    assert metric(app, "tierserve_gateway_generation_tokens_total", tier="highspeed") == 2


async def test_cascade_keeps_the_highspeed_answer_when_full_fails(tiers):
    tiers["highspeed"].handler = lambda r: httpx.Response(200, json=chat_json("m-fast", "[1]"))
    tiers["full"].handler = lambda r: httpx.Response(503, text="down")
    app = make_app(tiers, router={"policy": "heuristic", "cascade": {"enabled": True}})
    body = CHAT | {"response_format": {"type": "json_object"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        response = await c.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == "m-fast"
    assert response.headers["x-tierserve-tier"] == "highspeed"
    assert metric(app, "tierserve_gateway_requests_total", tier="highspeed", outcome="success") == 1


async def test_health_reports_tiers_and_policy(client):
    gateway = gateway_app(client).state.gateway
    gateway.upstreams["full"].state = TierState.RESTARTING
    response = await client.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "degraded" and body["router"]["policy"] == "heuristic"
    assert body["tiers"]["full"]["state"] == "restarting"
    routed = await client.post("/v1/chat/completions", json=CHAT | {"model": "full"})
    assert routed.headers["x-tierserve-reason"] == "tier_down"


def test_dashboard_plots_only_metrics_that_exist(client):
    """Every gateway metric the Grafana dashboard queries is exported (tier engine metrics
    are checked against serving/api_server/metrics.py)."""
    dashboard = (REPO / "serving/gateway/dashboards/gateway.json").read_text()
    queried = set(re.findall(r"tierserve_\w+", dashboard))
    exported = gateway_app(client).state.gateway.metrics.render().decode()
    engine_source = (REPO / "serving/api_server/metrics.py").read_text()
    suffixes = r"(_bucket|_total|_count|_sum)$"
    for name in queried:
        family = re.sub(suffixes, "", name)
        if name.startswith("tierserve_gateway_"):
            assert re.search(rf"^# TYPE {family}(_total)? ", exported, re.M), name
        else:
            assert f'"{family.removeprefix("tierserve_")}' in engine_source, name


async def test_api_key_guards_all_but_health_and_metrics(tiers):
    app = make_app(tiers, api_key="sesame")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as c:
        refused = await c.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        allowed = await c.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sesame"}
        )
        assert allowed.status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200
