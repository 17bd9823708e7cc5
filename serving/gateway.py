"""The gateway: one OpenAI-compatible endpoint in front of the full and highspeed tiers.

Requests are checked only for what routing needs (the tier validates the rest and its 4xx
passes through unchanged), routed, forwarded over pooled connections, and answered with
which tier answered and why: `X-Tierserve-*` headers on every response, and a `tierserve`
field in whole responses. Streams pass through byte for byte (only the usage event the
gateway itself asked for is dropped), so a streamed answer is the tier's own.
"""

import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
import orjson
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from router.cascade import validate_answer
from router.override import AUTO_MODEL, TIER_HEADER, OverrideError
from router.policy import TIERS, Decision, Tier, other_tier
from router.router import Router, load_policy
from router.spill import SpillPolicy
from serving.gateway_config import GatewayConfig
from serving.gateway_metrics import GatewayMetrics
from serving.gateway_proxy import (
    Attempt,
    RequestRecord,
    UpstreamFailure,
    attempt,
    client_wants_usage,
    relay,
    upstream_payload,
)
from serving.openai_serving import APIError, SSEResponse
from serving.protocol import ModelCard, ModelList
from serving.server import APIKeyAuth, install_error_handlers
from serving.supervisor import Supervisor
from serving.upstream import Upstream, make_upstream

log = logging.getLogger(__name__)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # everything else is the tier's to validate
    model: str | None = None
    stream: bool = False


class ChatBody(_Body):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    stream_options: dict[str, Any] | None = None


class CompletionBody(_Body):
    prompt: str | Annotated[list[Any], Field(min_length=1)]
    stream_options: dict[str, Any] | None = None


class TokenizerBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None


async def read_body(request: Request, shape: type[BaseModel]) -> dict[str, Any]:
    """The JSON body as the client sent it, checked against `shape` (the fields routing
    needs) but not copied through a model: what goes upstream is the client's own body."""
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        shape.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from e
    return body


def annotated(content: bytes, annotation: dict[str, Any]) -> bytes:
    """The tier's JSON object with one more field, its own bytes otherwise untouched."""
    return content.rstrip()[:-1] + b', "tierserve": ' + orjson.dumps(annotation) + b"}"


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.upstreams: dict[Tier, Upstream] = {
            tier: make_upstream(
                tier,
                getattr(config.tiers, tier),
                config.fallback,
                config.max_connections_per_tier,
                config.tier_keepalive_s,
            )
            for tier in TIERS
        }
        model_tiers: dict[str, Tier] = {t: t for t in TIERS}
        model_tiers |= {u.model: tier for tier, u in self.upstreams.items()}
        rc = config.router
        spill = SpillPolicy(rc.spill.max_queue, rc.spill.margin) if rc.spill.enabled else None
        policy = load_policy(rc.policy, rc.learned_path, rc.heuristic_threshold, rc.threshold)
        self.router = Router(policy, spill, model_tiers)
        self.metrics = GatewayMetrics(self.upstreams)
        self.supervisor = Supervisor(self.upstreams, config.supervisor)
        log.info("router: %s policy, threshold %.4f", policy.name, policy.threshold)

    def describe_router(self) -> dict[str, Any]:
        rc = self.config.router
        info: dict[str, Any] = {
            "policy": self.router.policy.name,
            "threshold": self.router.policy.threshold,
            "spill": rc.spill.enabled,
            "cascade": rc.cascade.enabled,
            "fallback": self.config.fallback.enabled,
        }
        if self.router.policy.name == "learned":
            info["learned_path"] = str(rc.learned_path)
        return info

    def route(self, body: dict[str, Any], header: str | None) -> Decision:
        queues = {tier: u.in_flight for tier, u in self.upstreams.items()}
        try:
            decision = self.router.route(body, header, queues)
        except OverrideError as e:
            status, code = (404, "model_not_found") if e.not_found else (400, None)
            raise APIError(status, str(e), param=e.param, code=code) from e
        other = self.upstreams[other_tier(decision.tier)]
        down = not self.upstreams[decision.tier].available
        if self.config.fallback.enabled and down and other.available:
            decision = decision.moved(other.tier, "tier_down")  # skip the doomed attempt
        self.metrics.routed(decision)
        return decision

    async def send(
        self, record: RequestRecord, path: str, body: dict[str, Any], stream: bool
    ) -> Attempt:
        """One attempt on the decided tier and, if that fails before its first byte and
        fallback is on, one on the other tier."""
        try:
            return await self._attempt(record, path, body, stream)
        except UpstreamFailure as failure:
            if not self.config.fallback.enabled:
                raise
            record.fell_back(failure)
        return await self._attempt(record, path, body, stream)

    async def _attempt(
        self, record: RequestRecord, path: str, body: dict[str, Any], stream: bool
    ) -> Attempt:
        upstream = self.upstreams[record.decision.tier]
        payload = upstream_payload(body, upstream.model)
        headers = {"X-Request-Id": record.request_id}
        try:
            return await attempt(upstream, upstream.api_root + path, payload, headers, stream)
        except UpstreamFailure as failure:
            self.metrics.upstream_errors.labels(upstream.tier, failure.cause).inc()
            log.warning("request %s: %s", record.request_id, failure)
            raise

    async def generate(self, request: Request, path: str, body: dict[str, Any]) -> Response:
        start = time.perf_counter()
        decision = self.route(body, request.headers.get(TIER_HEADER))
        record = RequestRecord(uuid.uuid4().hex, path, decision, self.metrics, arrival=start)
        stream = bool(body.get("stream"))
        overhead = time.perf_counter() - start
        try:
            result = await self.send(record, path, body, stream)
        except UpstreamFailure as failure:
            record.finish("error", 502)
            status = 504 if failure.cause == "timeout" else 502
            error = APIError(status, f"No tier could answer: {failure}", type="server_error")
            return JSONResponse(error.body.model_dump(), status, headers=record.headers())
        status = result.response.status_code
        if status != 200:  # the tier's own 4xx (bad parameters): passed through as it is
            await result.close()
            record.finish("client_error", status)
            return Response(
                result.response.content,
                status,
                headers=record.headers(),
                media_type=result.response.headers.get("content-type"),
            )
        if stream:
            self.metrics.overhead.observe(overhead)
            return SSEResponse(
                relay(result, record, strip_usage=not client_wants_usage(body)),
                headers=record.headers(),
            )
        await result.close()
        after = time.perf_counter()
        content = result.response.content
        data = orjson.loads(content)
        if self.config.router.cascade.enabled:
            content, data = await self._cascade(record, path, body, content, data)
        record.usage = data.get("usage")
        content = annotated(content, record.annotation())
        self.metrics.overhead.observe(overhead + time.perf_counter() - after)
        record.finish("success", 200)
        return Response(content, 200, headers=record.headers(), media_type="application/json")

    async def _cascade(
        self,
        record: RequestRecord,
        path: str,
        body: dict[str, Any],
        content: bytes,
        data: dict[str, Any],
    ) -> tuple[bytes, dict[str, Any]]:
        """Escalate a routed highspeed answer that fails validation to the full tier; if the
        full tier cannot answer, the highspeed answer stands."""
        if record.decision.tier != "highspeed" or record.decision.policy == "override":
            return content, data
        failure = validate_answer(body, data)
        if failure is None:
            return content, data
        self.metrics.cascade_escalations.labels(failure).inc()
        self.metrics.usage("highspeed", data.get("usage") or {})  # spent, though not used
        routed = record.decision
        record.decision = routed.moved("full", "cascade")
        try:
            result = await self._attempt(record, path, body, stream=False)
        except UpstreamFailure:
            record.decision = routed
            return content, data
        await result.close()
        if result.response.status_code != 200:
            record.decision = routed
            return content, data
        return result.response.content, orjson.loads(result.response.content)

    async def forward_tokenizer(self, path: str, body: dict[str, Any]) -> Response:
        """/tokenize and /detokenize, answered by the named tier (the full tier for `auto`;
        both tiers share one tokenizer)."""
        model = body.get("model")
        tier = "full" if model in (None, AUTO_MODEL) else self.router.model_tiers.get(model)
        if tier is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")  # fmt: skip
        upstream = self.upstreams[tier]
        address, payload = upstream.server_root + path, upstream_payload(body, upstream.model)
        try:
            result = await attempt(upstream, address, payload, {}, stream=False)
        except UpstreamFailure as e:
            raise APIError(502, str(e), type="server_error") from e
        await result.close()
        return Response(
            result.response.content,
            result.response.status_code,
            media_type=result.response.headers.get("content-type"),
        )

    async def tier_metrics(self, tier: str) -> Response:
        upstream = self.upstreams.get(tier)  # type: ignore[call-overload]
        if upstream is None:
            raise APIError(404, f"No tier {tier!r}; tiers: {', '.join(TIERS)}")
        try:
            response = await upstream.client.get(upstream.metrics_url, timeout=5.0)
        except httpx.HTTPError as e:
            raise APIError(
                502, f"{tier} tier metrics unavailable: {e!r}", type="server_error"
            ) from e
        return Response(response.content, response.status_code, media_type=CONTENT_TYPE_LATEST)

    def health(self) -> JSONResponse:
        tiers = {tier: u.describe() for tier, u in self.upstreams.items()}
        healthy = [u.available for u in self.upstreams.values()]
        status = "ok" if all(healthy) else "degraded" if any(healthy) else "unavailable"
        body = {"status": status, "router": self.describe_router(), "tiers": tiers}
        return JSONResponse(body, status_code=200 if any(healthy) else 503)

    async def close(self) -> None:
        await self.supervisor.stop()
        for upstream in self.upstreams.values():
            await upstream.client.aclose()


def build_gateway_app(config: GatewayConfig) -> FastAPI:
    """The gateway app; its lifespan starts (and stops) the tiers' supervision."""
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.supervisor.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(title="tierserve gateway", lifespan=lifespan)
    app.state.gateway = gateway
    if config.api_key:
        app.add_middleware(APIKeyAuth, api_key=config.api_key, open_prefixes=("/metrics",))
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatBody)
        return await gateway.generate(request, "/chat/completions", body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.generate(
            request, "/completions", await read_body(request, CompletionBody)
        )

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        cards = [ModelCard(id=name) for name in (AUTO_MODEL, *TIERS)]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/tokenize")
    async def tokenize(body: TokenizerBody) -> Response:
        return await gateway.forward_tokenizer("/tokenize", body.model_dump(exclude_unset=True))

    @app.post("/detokenize")
    async def detokenize(body: TokenizerBody) -> Response:
        return await gateway.forward_tokenizer("/detokenize", body.model_dump(exclude_unset=True))

    @app.get("/health")
    async def health() -> JSONResponse:
        return gateway.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/tiers/{tier}")
    async def tier_metrics(tier: str) -> Response:
        return await gateway.tier_metrics(tier)

    return app


def serve_gateway(config: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain in-flight requests (up to the drain timeout)
    and stop the tiers."""
    app = build_gateway_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            timeout_keep_alive=int(config.keepalive_timeout_s),
            access_log=False,  # the gateway logs one line per request itself
        )
    )
    server.run()
