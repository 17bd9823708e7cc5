"""One tier as the gateway sees it: an OpenAI-compatible server behind a pooled httpx client,
its health state and how many of the gateway's requests it is serving now.

A tier is ready when its /health answers 200, which for vLLM and for `tierserve engine` means
it serves at full speed; a `tierserve engine` still compiling its decode steps answers 503
with its warm-up progress, which the gateway reports (`TierState.WARMING`) but routes nothing
to."""

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

from router.policy import Tier
from serving.gateway.config import FallbackConfig, RemoteTier, SupervisedTier


class TierState(StrEnum):
    STARTING = "starting"  # started, not answering /health yet
    WARMING = "warming"  # answering /health with 503 and its warm-up progress
    HEALTHY = "healthy"  # ready: /health answers 200
    UNHEALTHY = "unhealthy"  # running (or remote) but failing its health check
    RESTARTING = "restarting"  # the process died; waiting out the backoff
    STOPPED = "stopped"


class Probe(StrEnum):
    """What one health check found."""

    READY = "ready"
    WARMING = "warming"
    DOWN = "down"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remapped(e: httpx.ConnectTimeout) -> httpx.HTTPError:
    """httpx-aiohttp reports every aiohttp connection error as ConnectTimeout; a refused or a
    dropped connection is not a timeout (the gateway's metrics and messages say which)."""
    cause = e.__cause__
    if cause is None or isinstance(cause, asyncio.TimeoutError):
        return e
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(cause))
    return httpx.RemoteProtocolError(str(cause))


class _RemappedStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.stream:
                yield chunk
        except httpx.ConnectTimeout as e:
            raise _remapped(e) from e.__cause__

    async def aclose(self) -> None:
        await self.stream.aclose()


class TierTransport(AiohttpTransport):
    """httpx's API (and its test transports) over aiohttp's connection pool and C HTTP parser:
    the hop of a whole answer costs less than through httpx's own pool
    (`loadtests/bench_gateway.py` measures the hop)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await super().handle_async_request(request)
        except httpx.ConnectTimeout as e:
            raise _remapped(e) from e.__cause__
        response.stream = _RemappedStream(response.stream)
        return response


@dataclass
class Upstream:
    tier: Tier
    config: SupervisedTier | RemoteTier
    server_root: str  # e.g. http://127.0.0.1:8101, where /health lives
    api_root: str  # e.g. http://127.0.0.1:8101/v1
    client: httpx.AsyncClient  # health checks, metrics; builds the forwarded requests
    transport: httpx.AsyncBaseTransport  # the client's connection pool, which sends them
    state: TierState = TierState.STARTING
    in_flight: int = 0
    restarts: int = 0
    pid: int | None = None
    standby_pid: int | None = None  # the process kept ready to replace it (`supervisor`)
    standby_ready: bool = False  # that process is past its imports
    last_error: str | None = field(default=None)
    warmup: dict[str, Any] | None = None  # the tier's last warm-up progress, while warming
    started_at: float | None = None  # when its process was (re)started, monotonic
    ready_s: float | None = None  # from that start to its first 200 from /health
    # Told whenever `in_flight` changes (the supervisor holds its standbys under a lone request).
    on_in_flight: Callable[[], None] | None = None
    _urls: dict[str, httpx.URL] = field(default_factory=dict)

    def add_in_flight(self, n: int) -> None:
        """A request sent to the tier (1) or done with (-1)."""
        self.in_flight += n
        if self.on_in_flight is not None:
            self.on_in_flight()

    def url(self, address: str) -> httpx.URL:
        """The parsed URL of an address on this tier (parsing one costs more than sending)."""
        url = self._urls.get(address)
        if url is None:
            url = self._urls[address] = httpx.URL(address)
        return url

    @property
    def model(self) -> str:
        return self.config.model_name

    @property
    def available(self) -> bool:
        return self.state == TierState.HEALTHY

    @property
    def health_url(self) -> str:
        path = self.config.health_path if isinstance(self.config, RemoteTier) else "/health"
        return self.server_root + path

    @property
    def metrics_url(self) -> str:
        path = self.config.metrics_path if isinstance(self.config, RemoteTier) else "/metrics"
        return self.server_root + path

    async def probe(self, timeout_s: float) -> Probe:
        """READY on a 2xx; WARMING on a 503 that carries warm-up progress; DOWN otherwise.
        The progress is kept in `warmup`, also a ready tier's while its larger graphs are
        still compiled apart."""
        try:
            response = await self.client.get(self.health_url, timeout=timeout_s)
        except httpx.HTTPError as e:
            self.last_error = f"health check: {type(e).__name__}"
            return Probe.DOWN
        self.warmup = _warmup_of(response)
        if response.is_success:
            return Probe.READY
        if response.status_code == 503 and self.warmup is not None:
            return Probe.WARMING
        self.last_error = f"health check: HTTP {response.status_code}"
        return Probe.DOWN

    def describe(self) -> dict[str, object]:
        """The tier's entry in the gateway's /health."""
        info: dict[str, object] = {
            "state": str(self.state),
            "engine": self.config.engine,
            "model": self.model,
            "url": self.api_root,
            "metrics_url": self.metrics_url,
            "in_flight": self.in_flight,
        }
        if isinstance(self.config, SupervisedTier):
            info |= {"pid": self.pid, "standby_pid": self.standby_pid,
                     "standby_ready": self.standby_ready, "restarts": self.restarts,
                     "ready_s": self.ready_s}  # fmt: skip
        if self.warmup is not None:
            info["warmup"] = self.warmup
        if self.last_error and self.state != TierState.HEALTHY:
            info["last_error"] = self.last_error
        return info


def _warmup_of(response: httpx.Response) -> dict[str, Any] | None:
    """The warm-up progress in a tier's /health (`serving/api_server/api_server.py`): in a 503
    while it warms, in a 200 while graphs it is ready without still compile."""
    if response.status_code not in (200, 503):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    warmup = body.get("warmup") if isinstance(body, dict) else None
    return warmup if isinstance(warmup, dict) else None


def make_upstream(
    tier: Tier,
    config: SupervisedTier | RemoteTier,
    fallback: FallbackConfig,
    max_connections: int,
    keepalive_s: float,
) -> Upstream:
    """The upstream of one configured tier; a tier the gateway starts without a port gets a
    free one."""
    if isinstance(config, SupervisedTier):
        root = f"http://127.0.0.1:{config.port or free_port()}"
        api_root, api_key = root + "/v1", config.api_key
    else:
        api_root = str(config.base_url).rstrip("/")
        root, api_key = api_root.removesuffix("/v1"), config.api_key
    # Uncompressed answers, so streams pass through as the raw bytes they arrive as.
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    transport = TierTransport(
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=keepalive_s,
        )
    )
    client = httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(fallback.read_timeout_s, connect=fallback.connect_timeout_s),
        transport=transport,
    )
    return Upstream(tier, config, root, api_root, client, transport)
