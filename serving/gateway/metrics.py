"""Prometheus metrics of the gateway, under `tierserve_gateway_`, and the engine metrics of
its vllm tiers (`vllm:`), scraped from each when the gateway is scraped.

Routing, fallbacks and upstream errors are counted as they happen; each logical request is
counted exactly once, by the tier that answered it and its outcome, when it ends.
"""

import asyncio
import logging
from collections.abc import Iterable, Iterator, Mapping

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from router.policy import Decision, Tier
from serving.api_server.metrics import REQUEST_BUCKETS
from serving.gateway.config import VllmTier
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


VLLM_PREFIX = "vllm:"
# A scrape of the gateway waits this long for a vllm tier's metrics, then goes without them
# (its `tier_up` gauge says why).
SCRAPE_TIMEOUT_S = 2.0


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def relabeled(texts: Mapping[Tier, str]) -> bytes:
    """The `vllm:` families of each tier's exposition text, each sample labelled with its
    tier (`tier="full"`), merged into one family per name so that two vllm tiers' metrics
    sit side by side as one metric. A child's process and Python metrics are left out: they
    describe that process, not the serving, and stay at `/metrics/tiers/{tier}`."""
    families: dict[str, Metric] = {}
    for tier, text in texts.items():
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(VLLM_PREFIX):
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type
                )
            merged.samples += [s._replace(labels=s.labels | {"tier": tier}) for s in family.samples]
    if not families:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


async def _scrape(upstream: Upstream) -> str | None:
    try:
        response = await upstream.client.get(upstream.metrics_url, timeout=SCRAPE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return response.text if response.is_success else None


async def vllm_tier_metrics(upstreams: Mapping[Tier, Upstream]) -> bytes:
    """The vllm tiers' engine metrics for the gateway's /metrics, scraped now, side by side:
    a tier the gateway starts listens on a local port that Prometheus cannot reach, so the
    gateway's one scrape target carries them. A tier that does not answer is left out."""
    tiers = [t for t, u in upstreams.items() if isinstance(u.config, VllmTier)]
    texts = await asyncio.gather(*(_scrape(upstreams[t]) for t in tiers))
    try:
        return relabeled({t: text for t, text in zip(tiers, texts, strict=True) if text})
    except ValueError as e:  # an exposition the parser refuses: the gateway's own still count
        logging.getLogger(__name__).warning("tier metrics unparsable: %s", e)
        return b""
