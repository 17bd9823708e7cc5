"""Forwarding one request to a tier: the upstream attempt (which fails over only before the
first byte), the SSE relay that passes a stream through event by event, and the one
accounting record each logical request leaves.

A stream is committed to its tier once the tier's first chunk has arrived; until then every
failure (refused connection, timeout, 5xx, a connection cut before any body) is retryable.
After it, a broken upstream ends the client's stream with an OpenAI error event: a stream
that has begun is never restarted, since the client has already seen part of an answer.
"""

import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from router.policy import Decision, Tier, other_tier
from serving.gateway_metrics import GatewayMetrics
from serving.openai_serving import SSE_DONE, APIError, error_json, sse
from serving.upstream import Upstream

log = logging.getLogger("tierserve.requests")
_USAGE_EVENT = re.compile(rb'"usage":\s*\{')


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
    _closed: bool = False

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.upstream.in_flight -= 1
            await self.response.aclose()


async def attempt(
    upstream: Upstream, address: str, payload: bytes, headers: dict[str, str], stream: bool
) -> Attempt:
    """Send one request to a tier; raise UpstreamFailure if it fails before its first byte.
    A whole (non-stream) response is read completely. The request goes straight to the
    connection pool: a proxy needs none of the client's redirects, auth flows or cookies."""
    upstream.in_flight += 1
    try:
        url = upstream.url(address)
        request = upstream.client.build_request("POST", url, content=payload, headers=headers)
        response = await upstream.transport.handle_async_request(request)
    except httpx.TimeoutException as e:
        upstream.in_flight -= 1
        raise UpstreamFailure("timeout", f"{upstream.tier} tier timed out: {e!r}") from e
    except httpx.HTTPError as e:
        upstream.in_flight -= 1
        raise UpstreamFailure("connect_error", f"{upstream.tier} tier unreachable: {e!r}") from e
    result = Attempt(upstream, response, response.aiter_raw())
    try:
        if response.status_code >= 500:
            raise UpstreamFailure(
                f"http_{response.status_code}",
                f"{upstream.tier} tier answered HTTP {response.status_code}",
            )
        if stream and response.status_code == 200:
            result.first_chunk = await anext(result.chunks)
        else:
            await response.aread()
    except (httpx.HTTPError, StopAsyncIteration) as e:
        await result.close()
        cause = "timeout" if isinstance(e, httpx.TimeoutException) else "broken_response"
        raise UpstreamFailure(cause, f"{upstream.tier} tier broke off: {e!r}") from e
    except UpstreamFailure:
        await result.close()
        raise
    return result


def upstream_payload(body: dict[str, Any], model: str) -> bytes:
    """The client's body for a tier: its model name, and usage always requested on streams
    (so every request's tokens are counted; the gateway drops the extra usage event)."""
    body = dict(body, model=model)
    if body.get("stream"):
        body["stream_options"] = dict(body.get("stream_options") or {}, include_usage=True)
    return orjson.dumps(body)


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
            "X-Request-Id": self.request_id,
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
        log.info(
            "request %s %s tier=%s policy=%s reason=%s score=%s fallback_from=%s status=%d "
            "outcome=%s prompt_tokens=%s completion_tokens=%s latency_ms=%.1f",
            self.request_id,
            self.endpoint,
            tier,
            self.decision.policy,
            self.decision.reason,
            "-" if self.decision.score is None else f"{self.decision.score:.4f}",
            self.fallback_from or "-",
            status,
            outcome,
            (self.usage or {}).get("prompt_tokens", "-"),
            (self.usage or {}).get("completion_tokens", "-"),
            1000 * latency,
        )


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


async def relay(attempt: Attempt, record: RequestRecord, strip_usage: bool) -> AsyncIterator[bytes]:
    """The tier's SSE stream, passed on as each chunk arrives (whole events only). Only a
    chunk that mentions usage is taken apart into events; the rest pass as they are."""
    buffer = attempt.first_chunk
    try:
        while True:
            last = buffer.rfind(b"\n\n")
            end = last + 2 if last >= 0 else 0  # whole events end here
            events, buffer = buffer[:end], buffer[end:]
            if b'"usage"' in events:
                events = _account_usage(events, record, strip_usage)
            if events:
                yield events
            try:
                buffer += await anext(attempt.chunks)
            except StopAsyncIteration:
                break
        if buffer:
            yield buffer
        record.finish("success", 200)
    except httpx.HTTPError as e:
        record.metrics.upstream_errors.labels(record.decision.tier, "broken_stream").inc()
        error = APIError(502, f"The {record.decision.tier} tier broke off the stream: {e!r}",
                         type="server_error")  # fmt: skip
        yield (sse(error_json(error)) + SSE_DONE).encode()
        record.finish("error", 502)
    finally:
        await attempt.close()
        record.finish("cancelled", 499)  # the client left mid-stream
