"""Prometheus metrics of one tier server, named like vLLM's under a `tierserve_` prefix.

Each server gets its own CollectorRegistry, so several (tiers, tests) coexist in one process.
Latencies come from the engine's RequestOutput timestamps (`time.monotonic`); queue lengths
and KV cache usage are read from the engine when Prometheus scrapes, so they are never stale.
"""

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.engine.llm_engine import LLMEngine
from serving.engine.outputs import RequestOutput
from speculative.speculator import Speculator

PREFIX = "tierserve_"
# vLLM's buckets, so dashboards written for vLLM read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class _EngineGauges(Collector):
    """Running and waiting requests and KV cache usage, read from the engine at scrape time."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # The engine thread mutates these; copying a list is atomic under the GIL.
        scheduler = self.engine.scheduler
        gauges = (
            ("num_requests_running", "Requests in model execution batches.", scheduler.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", scheduler.waiting),
        )
        for name, doc, seqs in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], len({s.request_id for s in list(seqs)}))
            yield gauge
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc", "KV cache usage (1 = full).", labels=["model_name"]
        )
        usage.add_metric([self.model_name], self.engine.blocks.usage)
        yield usage
        blocks = self.engine.blocks
        used = GaugeMetricFamily(
            PREFIX + "kv_cache_used_blocks",
            "KV cache blocks held by live sequences (0 when idle: nothing leaked).",
            labels=["model_name"],
        )
        used.add_metric([self.model_name], blocks.num_blocks - blocks.num_free_blocks)
        yield used


class _SpecDecodeCounters(Collector):
    """Speculative decoding totals (vLLM's spec_decode_* counters), read at scrape time."""

    def __init__(self, speculator: Speculator, model_name: str) -> None:
        self.speculator = speculator
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.speculator.stats
        totals = (
            ("num_drafts", "Verification steps with drafts.", stats.num_drafts),
            ("num_draft_tokens", "Draft tokens proposed.", stats.num_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens),
        )
        for name, doc, value in totals:
            counter = CounterMetricFamily(
                PREFIX + "spec_decode_" + name, doc, labels=["model_name"]
            )
            counter.add_metric([self.model_name], value)
            yield counter
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the draft.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(stats.accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], value)
        yield per_position


class ServerMetrics:
    """The metrics of one server; `track()` one per engine request."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's token steps.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduling.", REQUEST_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.")
        self._request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by why they finished (stop, length or abort).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineGauges(engine, model_name))
        if engine.speculator:
            self.registry.register(_SpecDecodeCounters(engine.speculator, model_name))

    def finished(self, reason: str) -> None:
        self._request_success.labels(self.model_name, reason).inc()

    def track(self) -> "RequestMetrics":
        return RequestMetrics(self)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class RequestMetrics:
    """One engine request: observe each output delta as it reaches the server, then either
    the final delta or `abort()` closes it. A request is counted by its first sequence's
    finish reason (n > 1 sequences share one request)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._last_token_time: float | None = None
        self._reason: str | None = None
        self._closed = False

    def observe(self, out: RequestOutput) -> None:
        m, now = self.metrics, time.monotonic()
        new_tokens = sum(len(o.token_ids) for o in out.outputs)
        if new_tokens and self._last_token_time is None:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.first_token_time is not None:
                m.time_to_first_token.observe(out.first_token_time - out.arrival_time)
            if out.first_scheduled_time is not None:
                m.request_queue_time.observe(out.first_scheduled_time - out.arrival_time)
        elif new_tokens:
            m.inter_token_latency.observe(now - self._last_token_time)
        if new_tokens:
            self._last_token_time = now
            m.generation_tokens.inc(new_tokens)
        for o in out.outputs:
            if o.index == 0 and o.finish_reason is not None:
                self._reason = o.finish_reason
        if out.finished and not self._closed:
            self._closed = True
            m.e2e_request_latency.observe(now - out.arrival_time)
            m.finished(self._reason or "stop")

    def abort(self) -> None:
        """The request ended before finishing (client gone, engine failure)."""
        if not self._closed:
            self._closed = True
            self.metrics.finished("abort")
