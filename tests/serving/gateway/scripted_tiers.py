"""The gateway in process over scripted tiers (httpx MockTransport): shared by the gateway's
fallback, limits, security and fuzz tests."""

import json
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.app import build_gateway_app
from serving.gateway.config import GatewayConfig
from serving.gateway.upstream import TierState

Handler = Callable[[httpx.Request], httpx.Response]
MODELS = {"full": "m-full", "highspeed": "m-fast"}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def chat_json(model: str, content: str = "hello") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": content},
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


def sse_events(model: str) -> list[bytes]:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": model}
    deltas = [{"role": "assistant", "content": ""}, {"content": "hel"}, {"content": "lo"}]
    events = [json.dumps(chunk | {"choices": [{"index": 0, "delta": d}]}).encode() for d in deltas]
    events.append(json.dumps(chunk | {"choices": [], "usage": {"prompt_tokens": 5,
                  "completion_tokens": 2, "total_tokens": 7}}).encode())  # fmt: skip
    return [b"data: " + e + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


async def stream_of(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


class ScriptedTier:
    """A tier whose answer each test scripts; counts the requests it gets."""

    def __init__(self, tier: str) -> None:
        self.model = MODELS[tier]
        self.calls: list[dict] = []
        self.headers: list[httpx.Headers] = []
        self.handler: Handler = self.answer

    def answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("stream"):
            return httpx.Response(200, content=stream_of(sse_events(self.model)))
        return httpx.Response(200, json=chat_json(self.model))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(json.loads(request.content))
        self.headers.append(request.headers)
        return self.handler(request)


def make_app(tiers: dict[str, ScriptedTier], **config: object) -> FastAPI:
    remote = {
        tier: {"engine": "remote", "base_url": f"http://{tier}.test/v1", "model": MODELS[tier]}
        for tier in MODELS
    }
    app = build_gateway_app(
        GatewayConfig.model_validate({"tiers": remote, "router": {"policy": "heuristic"}} | config)
    )
    for tier, upstream in app.state.gateway.upstreams.items():
        upstream.transport = httpx.MockTransport(tiers[tier])
        upstream.client = httpx.AsyncClient(transport=upstream.transport)
        upstream.state = TierState.HEALTHY
    return app


def metric(app: FastAPI, name: str, **labels: str) -> float:
    text = app.state.gateway.metrics.render().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
