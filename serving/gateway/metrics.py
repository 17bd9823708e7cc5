"""Prometheus metrics of the gateway, under `tierserve_gateway_`.

Routing, fallbacks and upstream errors are counted as they happen; each logical request is
counted exactly once, by the tier that answered it and its outcome, when it ends.
"""

import logging
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from router.policy import Decision, Tier
from serving.api_server.metrics import REQUEST_BUCKETS
from serving.gateway.upstream import Upstream

log = logging.getLogger("tierserve.requests")
PREFIX = "tierserve_gateway_"
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
SCORE_BUCKETS = tuple(i / 20 for i in range(1, 21))


class _TierGauges(Collector):
    """Each tier's health and in-flight requests, read when Prometheus scrapes."""

    def __init__(self, upstreams: Mapping[Tier, Upstream]) -> None:
        self.upstreams = upstreams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(PREFIX + "tier_up", "1 if the tier is healthy.", labels=["tier"])
        in_flight = GaugeMetricFamily(
            PREFIX + "requests_in_flight", "Requests the tier serves now.", labels=["tier"]
        )
        for tier, upstream in self.upstreams.items():
            up.add_metric([tier], float(upstream.available))
            in_flight.add_metric([tier], upstream.in_flight)
        yield up
        yield in_flight


class GatewayMetrics:
    def __init__(self, upstreams: Mapping[Tier, Upstream]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        self.requests = counter(
            "requests", "Logical requests by the tier that answered and their outcome.",
            "tier", "outcome",
        )  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens, per tier.", "tier")
        self.generation_tokens = counter("generation_tokens", "Generated tokens, per tier.", "tier")
        self.upstream_errors = counter(
            "upstream_errors", "Failed upstream attempts (connect, timeout, 5xx, broken stream).",
            "tier", "cause",
        )  # fmt: skip
        self.decisions = counter(
            "routing_decisions", "Routing decisions by policy, reason and chosen tier.",
            "policy", "reason", "tier",
        )  # fmt: skip
        self.fallbacks = counter(
            "fallbacks", "Requests retried on the other tier before their first byte.",
            "from_tier", "to_tier", "cause",
        )  # fmt: skip
        self.cascade_escalations = counter(
            "cascade_escalations",
            "Highspeed answers that failed validation and went to the full tier.",
            "cause",
        )
        self.rejections = counter(
            "rejections",
            "Requests refused before reaching a tier (overload, rate limit, size limits).",
            "reason",
        )
        self.router_score = Histogram(
            PREFIX + "router_score", "Router scores.", ["policy"], buckets=SCORE_BUCKETS, registry=r
        )
        self.overhead = Histogram(
            PREFIX + "overhead_seconds",
            "Time the gateway itself spends on a request (parse, route, annotate).",
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a request's arrival to its last byte, per answering tier.",
            ["tier"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        r.register(_TierGauges(upstreams))

    def routed(self, decision: Decision) -> None:
        self.decisions.labels(decision.policy, decision.reason, decision.tier).inc()
        if decision.score is not None:
            self.router_score.labels(decision.policy).observe(decision.score)

    def rejected(self, reason: str, request_id: str | None, client: str | None) -> None:
        """Count a refused request and log it (it has no RequestRecord)."""
        self.rejections.labels(reason).inc()
        log.info(
            "rejected: %s",
            reason,
            extra={"request_id": request_id, "client": client, "outcome": "rejected",
                   "reason": reason},
        )  # fmt: skip

    def usage(self, tier: Tier, usage: Mapping[str, int]) -> None:
        self.prompt_tokens.labels(tier).inc(usage.get("prompt_tokens") or 0)
        self.generation_tokens.labels(tier).inc(usage.get("completion_tokens") or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
