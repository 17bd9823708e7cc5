"""Forwarding one request to a tier: the upstream attempt (which fails over only before the
first byte), the SSE relay that passes a stream through event by event, and the one
accounting record each logical request leaves.

A stream is committed to its tier once the tier's first chunk has arrived; until then every
failure (refused connection, timeout, 5xx, a connection cut before any body) is retryable.
After it, a broken upstream ends the client's stream with an OpenAI error event: a stream
that has begun is never restarted, since the client has already seen part of an answer.
"""

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.types import Receive, Scope, Send

from router.policy import Decision, Tier, other_tier
from serving.api_server.serving_engine import SSE_DONE, APIError, SSEResponse, error_json, sse
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.upstream import Upstream

log = logging.getLogger("tierserve.requests")
_USAGE_EVENT = re.compile(rb'"usage":\s*\{')
# How an SSE stream begins: a field (data, event, id, retry) or a comment (":").
_SSE_START = re.compile(rb"(data|event|id|retry)?:")
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:")
_REASONING_KEY = b'"reasoning":'


class UpstreamFailure(Exception):
    """An attempt that failed before its first byte; `cause` is a metric label."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


@dataclass
class Attempt:
    """A tier's response whose status (and, for a stream, first chunk) has arrived. Holds
    one of the tier's in-flight slots until closed."""

    upstream: Upstream
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first_chunk: bytes = b""
    data: dict[str, Any] | None = None  # a whole answer, parsed
    _closed: bool = False

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.upstream.add_in_flight(-1)
            await self.response.aclose()


async def post(
    upstream: Upstream, address: str, payload: bytes, headers: dict[str, str], stream: bool
) -> Attempt:
    """One HTTP POST to a tier; raise UpstreamFailure if it fails before its first byte,
    or if what arrives is not what an OpenAI server sends (a whole answer that is not a JSON
    object, a stream that does not begin with an SSE field). A whole (non-stream) response
    is read and parsed completely. The request goes straight to the connection pool: a
    proxy needs none of the client's redirects, auth flows or cookies."""
    upstream.add_in_flight(1)
    try:
        url = upstream.url(address)
        request = upstream.client.build_request("POST", url, content=payload, headers=headers)
        response = await upstream.transport.handle_async_request(request)
    except BaseException as e:
        upstream.add_in_flight(-1)
        if isinstance(e, httpx.TimeoutException):
            raise UpstreamFailure("timeout", f"{upstream.tier} tier timed out: {e!r}") from e
        if isinstance(e, httpx.HTTPError):
            raise UpstreamFailure(
                "connect_error", f"{upstream.tier} tier unreachable: {e!r}"
            ) from e
        raise  # cancelled (the request timed out, the client left)
    result = Attempt(upstream, response, response.aiter_raw())
    try:
        if response.status_code >= 500:
            raise UpstreamFailure(
                f"http_{response.status_code}",
                f"{upstream.tier} tier answered HTTP {response.status_code}",
            )
        if stream and response.status_code == 200:
            result.first_chunk = await anext(result.chunks)
            if not _looks_like_sse(result.first_chunk):
                raise UpstreamFailure(
                    "malformed_response", f"{upstream.tier} tier sent a stream that is not SSE"
                )
        else:
            await response.aread()
            if response.status_code == 200:
                result.data = _json_object(response.content, upstream.tier)
    except (httpx.HTTPError, StopAsyncIteration) as e:
        await result.close()
        cause = "timeout" if isinstance(e, httpx.TimeoutException) else "broken_response"
        raise UpstreamFailure(cause, f"{upstream.tier} tier broke off: {e!r}") from e
    except BaseException:
        await result.close()
        raise
    return result


def _looks_like_sse(chunk: bytes) -> bool:
    """Whether a stream's first chunk begins as SSE does (or is too short to tell)."""
    start = chunk.lstrip()
    return bool(_SSE_START.match(start)) or any(f.startswith(start) for f in _SSE_FIELDS)


def _json_object(content: bytes, tier: Tier) -> dict[str, Any]:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise UpstreamFailure("malformed_response", f"{tier} tier sent an answer that is not JSON")
    return data


def upstream_payload(body: dict[str, Any], model: str) -> bytes:
    """The client's body for a tier: its model name, and usage always requested on streams
    (so every request's tokens are counted; the gateway drops the extra usage event)."""
    body = dict(body, model=model)
    if body.get("stream"):
        body["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError as e:  # e.g. an integer beyond 64 bits
        raise APIError(400, f"The request body cannot be forwarded: {e}") from e


def client_wants_usage(body: dict[str, Any]) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


@dataclass
class RequestRecord:
    """The accounting of one logical request: whichever attempts it took, it is counted once,
    by the tier that answered and its outcome, in the metrics and in one log line."""

    request_id: str
    endpoint: str
    decision: Decision
    metrics: GatewayMetrics
    arrival: float = field(default_factory=time.perf_counter)
    fallback_from: Tier | None = None
    usage: dict[str, int] | None = None
    client: str | None = None  # the API key's id or the client's address, for the log
    # Called once when the request ends: the admission slot, the rate-limit settlement.
    on_finish: list[Callable[["RequestRecord"], None]] = field(default_factory=list)
    _finished: bool = False

    def fell_back(self, failure: UpstreamFailure) -> None:
        to = other_tier(self.decision.tier)
        self.metrics.fallbacks.labels(self.decision.tier, to, failure.cause).inc()
        self.fallback_from = self.decision.tier
        self.decision = self.decision.moved(to, "fallback")

    def annotation(self) -> dict[str, Any]:
        """Which tier answered and why: the `tierserve` field of whole responses."""
        info: dict[str, Any] = {
            "tier": self.decision.tier,
            "policy": self.decision.policy,
            "reason": self.decision.reason,
            "score": self.decision.score,
        }
        if self.fallback_from is not None:
            info["fallback_from"] = self.fallback_from
        return info

    def headers(self) -> dict[str, str]:
        headers = {
            "X-Tierserve-Tier": self.decision.tier,
            "X-Tierserve-Policy": self.decision.policy,
            "X-Tierserve-Reason": self.decision.reason,
        }
        if self.decision.score is not None:
            headers["X-Tierserve-Score"] = f"{self.decision.score:.4f}"
        if self.fallback_from is not None:
            headers["X-Tierserve-Fallback-From"] = self.fallback_from
        return headers

    def finish(self, outcome: str, status: int) -> None:
        """Count the request; later calls (a stream closing after its outcome) do nothing."""
        if self._finished:
            return
        self._finished = True
        tier = self.decision.tier
        latency = time.perf_counter() - self.arrival
        self.metrics.requests.labels(tier, outcome).inc()
        self.metrics.e2e_latency.labels(tier).observe(latency)
        if self.usage:
            self.metrics.usage(tier, self.usage)
        for callback in self.on_finish:
            callback(self)
        usage = self.usage or {}
        log.info(
            "%s %s %d",
            self.endpoint,
            outcome,
            status,
            extra={
                "request_id": self.request_id,
                "endpoint": self.endpoint,
                "client": self.client,
                "tier": tier,
                "policy": self.decision.policy,
                "reason": self.decision.reason,
                "score": self.decision.score,
                "fallback_from": self.fallback_from,
                "status": status,
                "outcome": outcome,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "latency_ms": round(1000 * latency, 1),
            },
        )


def reasoning_renamed(upstream: Upstream, content: bytes) -> bytes:
    """A vLLM tier's answer (a whole one, or whole SSE events) with vLLM's `reasoning` field
    renamed `reasoning_content`: vLLM names the reasoning it splits off `reasoning` (0.32; older
    versions said `reasoning_content`), where the gateway's API, as `tierserve engine`, says
    `reasoning_content`, so a client reads one field whichever tier answered. `"reasoning":`
    with its closing quote bare can only end an object key in JSON (a quote inside a string is
    escaped), so the rename touches keys, never text. An embedded tier is left as it is."""
    if upstream.config.engine == "embedded" or _REASONING_KEY not in content:
        return content
    return content.replace(_REASONING_KEY, b'"reasoning_content":')


def annotated(content: bytes, annotation: dict[str, Any]) -> bytes:
    """The tier's JSON object with one more field, its own bytes otherwise untouched."""
    return content.rstrip()[:-1] + b', "tierserve": ' + orjson.dumps(annotation) + b"}"


def _account_usage(events: bytes, record: RequestRecord, strip_usage: bool) -> bytes:
    """Whole events with the usage event read (and dropped if only the gateway wanted it)."""
    kept = []
    for event in events.split(b"\n\n")[:-1]:
        if _USAGE_EVENT.search(event) and event.startswith(b"data: "):
            data = orjson.loads(event[6:])
            record.usage = data["usage"]
            if strip_usage and not data.get("choices"):
                continue
        kept.append(event + b"\n\n")
    return b"".join(kept)


async def relay(
    attempt: Attempt, record: RequestRecord, strip_usage: bool, deadline: float
) -> AsyncIterator[bytes]:
    """The tier's SSE stream, passed on as each chunk arrives (whole events only), until the
    request's deadline (on the event loop's clock). Only a chunk that mentions usage is taken
    apart into events; the rest pass as they are (vLLM's `reasoning` key renamed). A tier that
    breaks off, or a stream past its deadline, ends with an OpenAI error event and `[DONE]`."""
    buffer = attempt.first_chunk
    tier = record.decision.tier
    try:
        while True:
            last = buffer.rfind(b"\n\n")
            end = last + 2 if last >= 0 else 0  # whole events end here
            events, buffer = buffer[:end], buffer[end:]
            if b'"usage"' in events:
                events = _account_usage(events, record, strip_usage)
            events = reasoning_renamed(attempt.upstream, events)
            if events:
                yield events
            try:
                async with asyncio.timeout_at(deadline):
                    buffer += await anext(attempt.chunks)
            except StopAsyncIteration:
                break
        if buffer:
            yield reasoning_renamed(attempt.upstream, buffer)
        record.finish("success", 200)
    except (httpx.HTTPError, TimeoutError) as e:
        timed_out = isinstance(e, TimeoutError)
        cause = "request_timeout" if timed_out else "broken_stream"
        record.metrics.upstream_errors.labels(tier, cause).inc()
        message = (
            f"The request exceeded its time limit on the {tier} tier."
            if timed_out
            else f"The {tier} tier broke off the stream: {e!r}"
        )
        code = "request_timeout" if timed_out else "upstream_error"
        error = APIError(504 if timed_out else 502, message, type="server_error", code=code)
        yield (sse(error_json(error)) + SSE_DONE).encode()
        record.finish("error", error.status_code)
    finally:
        await attempt.close()
        record.finish("cancelled", 499)  # the client left mid-stream


class RelayResponse(SSEResponse):
    """The relayed stream as a response. Its attempt is closed and its record finished when
    the response ends, even if the stream was never iterated (the client left first)."""

    def __init__(
        self, result: Attempt, record: RequestRecord, strip_usage: bool, deadline: float
    ) -> None:
        super().__init__(relay(result, record, strip_usage, deadline), headers=record.headers())
        self.attempt, self.record = result, record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.attempt.close()
            self.record.finish("cancelled", 499)
