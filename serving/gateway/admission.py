"""Backpressure: admission of requests to the tiers, as vLLM's and LiteLLM's front ends do.

Each tier takes a bounded number of requests at once through this gateway; the next ones
wait in a bounded FIFO queue. When both are full (or a queued request waits past the queue
timeout) the client gets a 429 with Retry-After at once: overload is said politely, never
by a hang or a 5xx. A routed request whose tier is full spills to the other tier first,
when that one has room and the client did not name the tier. Streams also count against a
global cap, since each one holds a connection for its whole answer.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.policy import TIERS, Decision, Tier, other_tier
from serving.api_server.serving_engine import APIError
from serving.gateway.config import LimitsConfig, TierLimits

PREFIX = "tierserve_gateway_"


class Overloaded(APIError):
    """A 429 for a request the gateway has no room for; `reason` is a metric label."""

    def __init__(
        self, reason: str, message: str, retry_after_s: int, tier: Tier | None = None
    ) -> None:
        headers = {"Retry-After": str(retry_after_s)}
        if tier is not None:
            headers["X-Tierserve-Tier"] = tier  # the tier that had no room
        super().__init__(429, message, type="overloaded", code=reason, headers=headers)
        self.reason = reason


@dataclass
class TierQueue:
    """A tier's slots and its queue. A freed slot passes straight to the longest waiter, so
    a newcomer never overtakes the queue."""

    limits: TierLimits
    running: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    @property
    def load(self) -> int:
        """Requests admitted or waiting: what load-aware spill compares."""
        return self.running + len(self.waiters)

    @property
    def has_room(self) -> bool:
        return self.running < self.limits.max_in_flight or len(self.waiters) < self.limits.max_queue

    async def acquire(self, timeout_s: float) -> None:
        """Take a slot, waiting in the queue up to `timeout_s` (TimeoutError after it)."""
        if self.running < self.limits.max_in_flight and not self.waiters:
            self.running += 1
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append(future)
        try:
            async with asyncio.timeout(timeout_s):
                await future
        except BaseException:  # timed out, or the client left while queued
            if future.done() and not future.cancelled():
                self.release()  # a slot was handed over as we gave up: pass it on
            with contextlib.suppress(ValueError):
                self.waiters.remove(future)
            raise

    def release(self) -> None:
        while self.waiters:
            future = self.waiters.popleft()
            if not future.done():
                future.set_result(None)  # the slot passes on: `running` is unchanged
                return
        self.running -= 1


@dataclass
class Ticket:
    """An admitted request's slot (and stream) until `release`, which may be called twice."""

    queue: TierQueue
    on_release: Callable[[], None]
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.queue.release()
            self.on_release()


class Admission(Collector):
    """The tiers' queues and the stream cap; also the Prometheus collector of their gauges."""

    def __init__(self, config: LimitsConfig, available: Callable[[Tier], bool]) -> None:
        self.config = config
        self.available = available
        self.queues: dict[Tier, TierQueue] = {t: TierQueue(getattr(config, t)) for t in TIERS}
        self.streams = 0

    def loads(self) -> dict[Tier, int]:
        return {tier: q.load for tier, q in self.queues.items()}

    def _refuse(self, reason: str, message: str, tier: Tier | None = None) -> Overloaded:
        return Overloaded(reason, message, self.config.retry_after_s, tier)

    async def admit(self, decision: Decision, stream: bool) -> tuple[Decision, Ticket]:
        """Admit a request to its tier (or, when that one is full, a routed request to the
        other), waiting in its queue if needed; raise Overloaded when there is no room."""
        if stream and self.streams >= self.config.max_concurrent_streams:
            raise self._refuse(
                "too_many_streams",
                f"The gateway is serving its maximum of {self.config.max_concurrent_streams} "
                "streams; retry later.",
            )
        queue = self.queues[decision.tier]
        other = other_tier(decision.tier)
        if (
            not queue.has_room
            and decision.policy != "override"
            and self.queues[other].has_room
            and self.available(other)
        ):
            decision = decision.moved(other, "spill")
            queue = self.queues[other]
        if not queue.has_room:
            raise self._refuse(
                "queue_full",
                f"The {decision.tier} tier is at capacity and its queue is full; retry later.",
                decision.tier,
            )
        try:
            await queue.acquire(self.config.queue_timeout_s)
        except TimeoutError:
            raise self._refuse(
                "queue_timeout",
                f"The request waited {self.config.queue_timeout_s:g} s for the "
                f"{decision.tier} tier without being served; retry later.",
                decision.tier,
            ) from None
        if stream:
            self.streams += 1
        return decision, Ticket(queue, self._stream_ended if stream else lambda: None)

    def _stream_ended(self) -> None:
        self.streams -= 1

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily(
            PREFIX + "queue_depth", "Requests waiting for a slot at a tier.", labels=["tier"]
        )
        admitted = GaugeMetricFamily(
            PREFIX + "admitted_requests", "Requests holding a slot at a tier.", labels=["tier"]
        )
        for tier, queue in self.queues.items():
            depth.add_metric([tier], len(queue.waiters))
            admitted.add_metric([tier], queue.running)
        streams = GaugeMetricFamily(PREFIX + "active_streams", "Streams being served.")
        streams.add_metric([], self.streams)
        yield from (depth, admitted, streams)
