"""The gateway routes only to ready tiers (`serving/gateway/readiness.py`): a warming tier is
skipped for the ready one, a request that no ready tier can take waits a bounded time, then
gets a 503 with Retry-After in OpenAI's error shape; the tiers' probes read a warming tier's
progress from its 503."""

import asyncio
import time

import httpx
import pytest

from serving.gateway.upstream import Probe, TierState
from tests.serving.gateway.scripted_tiers import CHAT, ScriptedTier, make_app, metric

WARMUP = {"graphs_compiled": 2, "graphs_wanted": 6}


def warming(tiers: dict[str, ScriptedTier], app, *names: str) -> None:
    for name in names:
        upstream = app.state.gateway.upstreams[name]
        upstream.state, upstream.warmup = TierState.WARMING, dict(WARMUP)


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


@pytest.mark.parametrize("model", ["auto", "full"])
async def test_a_warming_tier_is_skipped_for_the_ready_one(tiers, model):
    app = make_app(tiers)
    warming(tiers, app, "full")
    async with client_of(app) as c:
        response = await c.post("/v1/chat/completions", json=CHAT | {"model": model})
        health = await c.get("/health")
    assert response.status_code == 200
    assert response.headers["x-tierserve-tier"] == "highspeed"
    assert response.headers["x-tierserve-reason"] in ("tier_warming", "score_below_threshold")
    if model == "full":
        assert response.headers["x-tierserve-reason"] == "tier_warming"
    assert not tiers["full"].calls and len(tiers["highspeed"].calls) == 1
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert body["tiers"]["full"]["state"] == "warming"
    assert body["tiers"]["full"]["warmup"] == WARMUP


async def test_no_ready_tier_waits_then_503_with_retry_after(tiers):
    app = make_app(tiers, limits={"tier_ready_wait_s": 0.3, "retry_after_s": 2})
    warming(tiers, app, "full", "highspeed")
    async with client_of(app) as c:
        start = time.monotonic()
        response = await c.post("/v1/chat/completions", json=CHAT)
        waited = time.monotonic() - start
        health = await c.get("/health")
    assert response.status_code == 503
    assert 0.3 <= waited < 5
    assert response.headers["retry-after"] == "2"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "no_tier_ready" and error["type"] == "server_error"
    assert "2 of 6 graphs compiled" in error["message"]
    assert not tiers["full"].calls and not tiers["highspeed"].calls
    assert metric(app, "tierserve_gateway_rejections_total", reason="no_tier_ready") == 1
    assert health.status_code == 503 and health.json()["status"] == "warming"


async def test_a_waiting_request_goes_to_the_tier_that_becomes_ready(tiers):
    app = make_app(tiers, limits={"tier_ready_wait_s": 30})
    warming(tiers, app, "full", "highspeed")
    full = app.state.gateway.upstreams["full"]

    async def ready_later() -> None:
        await asyncio.sleep(0.3)
        full.state = TierState.HEALTHY

    async with client_of(app) as c:
        start = time.monotonic()
        response, _ = await asyncio.gather(
            c.post("/v1/chat/completions", json=CHAT | {"model": "full"}), ready_later()
        )
    assert response.status_code == 200
    assert response.headers["x-tierserve-tier"] == "full"
    assert 0.3 <= time.monotonic() - start < 10
    assert len(tiers["full"].calls) == 1


async def test_without_fallback_a_named_tier_is_waited_for(tiers):
    app = make_app(tiers, fallback={"enabled": False}, limits={"tier_ready_wait_s": 0.2})
    warming(tiers, app, "full")
    async with client_of(app) as c:
        response = await c.post("/v1/chat/completions", json=CHAT | {"model": "full"})
    assert response.status_code == 503
    assert "The full tier is not ready" in response.json()["error"]["message"]
    assert not tiers["highspeed"].calls


@pytest.mark.parametrize(
    ("status", "body", "probe", "warmup"),
    [
        (200, {"status": "ok"}, Probe.READY, None),
        (200, {"status": "ok", "warmup": WARMUP}, Probe.READY, WARMUP),  # larger graphs to come
        (503, {"error": {"message": "warming"}, "warmup": WARMUP}, Probe.WARMING, WARMUP),
        (503, {"error": {"message": "The engine is not running."}}, Probe.DOWN, None),
        (500, {"warmup": WARMUP}, Probe.DOWN, None),
    ],
)
async def test_probe_reads_a_warming_tiers_progress(tiers, status, body, probe, warmup):
    app = make_app(tiers)
    upstream = app.state.gateway.upstreams["full"]
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    upstream.client = httpx.AsyncClient(transport=transport)
    assert await upstream.probe(timeout_s=1) == probe
    assert upstream.warmup == warmup
