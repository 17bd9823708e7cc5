"""The gateway: one OpenAI-compatible endpoint in front of the full and highspeed tiers.

Requests are checked only for what routing needs (the tier validates the rest and its 4xx
passes through unchanged), routed, forwarded over pooled connections, and answered with
which tier answered and why: `X-Tierserve-*` headers on every response, and a `tierserve`
field in whole responses. Streams pass through byte for byte (only the usage event the
gateway itself asked for is dropped, and vLLM's `reasoning` key is renamed the gateway's
`reasoning_content`), so a streamed answer is the tier's own.
"""

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.cascade import validate_answer
from router.override import AUTO_MODEL, TIER_HEADER, OverrideError
from router.policy import TIERS, Decision, Tier
from router.router import Router, load_policy
from router.spill import SpillPolicy
from serving.api_server.api_server import install_error_handlers
from serving.api_server.auth import APIKeyAuth
from serving.api_server.responses import ModelCard, ModelList
from serving.api_server.serving_engine import APIError
from serving.gateway import tier_endpoints
from serving.gateway.admission import Admission, Overloaded
from serving.gateway.config import GatewayConfig
from serving.gateway.metrics import GatewayMetrics, vllm_tier_metrics
from serving.gateway.proxy import (
    Attempt,
    RelayResponse,
    RequestRecord,
    UpstreamFailure,
    annotated,
    client_wants_usage,
    post,
    reasoning_renamed,
    upstream_payload,
)
from serving.gateway.rate_limits import RateLimiter, load_api_keys
from serving.gateway.readiness import NoTierReady, gateway_status, wait_for_ready
from serving.gateway.request_limits import BodyLimit, check_prompt, estimated_tokens
from serving.gateway.request_log import RequestIdMiddleware, setup_json_logging
from serving.gateway.schema import (
    ChatBody,
    CompletionBody,
    TokenizerBody,
    body_schema,
    describe_bodies,
    read_body,
)
from serving.gateway.supervisor import Supervisor
from serving.gateway.upstream import Upstream, make_upstream

log = logging.getLogger(__name__)


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
        self.admission = Admission(config.limits, lambda tier: self.upstreams[tier].available)
        self.metrics.registry.register(self.admission)
        self.rate_limiter = RateLimiter(config.rate_limits)
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
        try:
            decision = self.router.route(body, header, self.admission.loads())
        except OverrideError as e:
            status, code = (404, "model_not_found") if e.not_found else (400, None)
            raise APIError(status, str(e), param=e.param, code=code) from e
        return decision

    async def ready_tier(self, decision: Decision) -> Decision:
        """The decision once a ready tier can take it (`readiness`), counted as routed."""
        limits = self.config.limits
        decision = await wait_for_ready(
            decision,
            self.upstreams,
            self.config.fallback.enabled,
            limits.tier_ready_wait_s,
            limits.retry_after_s,
        )
        self.metrics.routed(decision)
        return decision

    async def forward(
        self, record: RequestRecord, path: str, body: dict[str, Any], stream: bool
    ) -> Attempt:
        """One attempt on the decided tier and, if that fails before its first byte and
        fallback is on, one on the other tier."""
        try:
            return await self.attempt(record, path, body, stream)
        except UpstreamFailure as failure:
            if not self.config.fallback.enabled:
                raise
            record.fell_back(failure)
        return await self.attempt(record, path, body, stream)

    async def attempt(
        self, record: RequestRecord, path: str, body: dict[str, Any], stream: bool
    ) -> Attempt:
        """One attempt at the decided tier, counted and logged when it fails."""
        upstream = self.upstreams[record.decision.tier]
        payload = upstream_payload(body, upstream.model)
        headers = {"X-Request-Id": record.request_id}
        try:
            return await post(upstream, upstream.api_root + path, payload, headers, stream)
        except UpstreamFailure as failure:
            self.metrics.upstream_errors.labels(upstream.tier, failure.cause).inc()
            log.warning("request %s: %s", record.request_id, failure)
            raise

    async def generate(self, request: Request, path: str, body: dict[str, Any]) -> Response:
        """Check the request against the limits, route it, admit it to its tier (or refuse
        it with a 429), and answer it within the request timeout."""
        start = time.perf_counter()
        request_id, limits = request.state.request_id, self.config.limits
        client = getattr(request.state, "client_id", None) or getattr(request.client, "host", "-")
        try:
            chars = check_prompt(body, limits.max_prompt_chars)
            charge = self.rate_limiter.charge(client, estimated_tokens(body, chars))
        except APIError as e:
            reason = "rate_limit" if e.status_code == 429 else "prompt_too_long"
            self.metrics.rejected(reason, request_id, client)
            raise
        stream = bool(body.get("stream"))
        decision = self.route(body, request.headers.get(TIER_HEADER))
        try:
            decision = await self.ready_tier(decision)
        except NoTierReady:
            charge.settle(0)
            self.metrics.rejected("no_tier_ready", request_id, client)
            raise
        try:
            decision, ticket = await self.admission.admit(decision, stream)
        except BaseException as e:  # no room (or the client left while queued)
            charge.settle(0)
            if isinstance(e, Overloaded):
                self.metrics.rejected(e.reason, request_id, client)
            raise
        record = RequestRecord(request_id, path, decision, self.metrics, start, client=client)
        record.on_finish += [
            lambda _: ticket.release(),
            lambda r: charge.settle((r.usage or {}).get("total_tokens")),
        ]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.request_timeout_s - (time.perf_counter() - start)
        overhead = time.perf_counter() - start
        try:
            async with asyncio.timeout_at(deadline):
                return await self._answer(record, path, body, stream, deadline, overhead)
        except TimeoutError:
            message = f"No answer within {limits.request_timeout_s:g} s."
            return self._failed(record, 504, message, "request_timeout")
        except UpstreamFailure as failure:
            status = 504 if failure.cause == "timeout" else 502
            return self._failed(record, status, f"No tier could answer: {failure}", failure.cause)
        except APIError as e:  # a body that cannot be forwarded
            record.finish("client_error", e.status_code)
            raise
        except BaseException as e:  # the client left, or a bug (answered 500): the slot is freed
            left = isinstance(e, asyncio.CancelledError)
            record.finish("cancelled" if left else "error", 499 if left else 500)
            raise

    @staticmethod
    def _failed(record: RequestRecord, status: int, message: str, code: str) -> Response:
        record.finish("error", status)
        error = APIError(status, message, type="server_error", code=code)
        return JSONResponse(error.body.model_dump(), status, headers=record.headers())

    async def _answer(
        self,
        record: RequestRecord,
        path: str,
        body: dict[str, Any],
        stream: bool,
        deadline: float,
        overhead: float,
    ) -> Response:
        result = await self.forward(record, path, body, stream)
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
            strip_usage = not client_wants_usage(body)
            return RelayResponse(result, record, strip_usage, deadline)
        await result.close()
        after = time.perf_counter()
        content, data = result.response.content, result.data or {}
        if self.config.router.cascade.enabled:
            content, data = await self._cascade(record, path, body, content, data)
        record.usage = data.get("usage")
        content = reasoning_renamed(self.upstreams[record.decision.tier], content)
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
            result = await self.attempt(record, path, body, stream=False)
        except UpstreamFailure:
            record.decision = routed
            return content, data
        await result.close()
        if result.response.status_code != 200 or result.data is None:
            record.decision = routed
            return content, data
        return result.response.content, result.data

    def health(self) -> JSONResponse:
        tiers = {tier: u.describe() for tier, u in self.upstreams.items()}
        status = gateway_status(self.upstreams)
        body = {
            "status": status,
            "pid": os.getpid(),
            "router": self.describe_router(),
            "tiers": tiers,
        }
        return JSONResponse(body, status_code=200 if status in ("ok", "degraded") else 503)

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

    app = FastAPI(title="tierserve gateway", version="1", lifespan=lifespan)
    app.state.gateway = gateway
    api_keys = load_api_keys(config)
    if api_keys:  # innermost first: auth, then the body limit, CORS, and the request id
        app.add_middleware(APIKeyAuth, api_keys=api_keys, open_prefixes=("/metrics",))
    app.add_middleware(
        BodyLimit,
        max_bytes=config.limits.max_body_bytes,
        on_reject=lambda: gateway.metrics.rejected("body_too_large", None, None),
    )
    if config.cors.allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.cors.allow_origins,
            allow_methods=config.cors.allow_methods,
            allow_headers=config.cors.allow_headers,
            allow_credentials=config.cors.allow_credentials,
            expose_headers=["X-Request-Id", "X-Tierserve-Tier", "X-Tierserve-Reason"],
            max_age=config.cors.max_age_s,
        )
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)
    describe_bodies(app, [ChatBody, CompletionBody, TokenizerBody])

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatBody))
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatBody)
        return await gateway.generate(request, "/chat/completions", body)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionBody))
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
        return await tier_endpoints.forward_tokenizer(
            gateway.upstreams, gateway.router, "/tokenize", body
        )

    @app.post("/detokenize")
    async def detokenize(body: TokenizerBody) -> Response:
        return await tier_endpoints.forward_tokenizer(
            gateway.upstreams, gateway.router, "/detokenize", body
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        return gateway.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        tiers = await vllm_tier_metrics(gateway.upstreams)
        return Response(gateway.metrics.render() + tiers, media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/tiers/{tier}")
    async def tier_metrics(tier: str) -> Response:
        return await tier_endpoints.tier_metrics(gateway.upstreams, tier)

    return app


def serve_gateway(config: GatewayConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain in-flight requests (up to the drain timeout)
    and stop the tiers."""
    if config.json_logs:
        setup_json_logging()
    app = build_gateway_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            timeout_keep_alive=int(config.keepalive_timeout_s),
            access_log=False,  # the gateway logs one line per request itself
            log_config=None if config.json_logs else uvicorn.config.LOGGING_CONFIG,
        )
    )
    server.run()
