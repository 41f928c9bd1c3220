"""Prometheus metrics on a per-app registry: requests, latency, time to first token,
tokens, queue gauges, the engine's KV memory and the speculative-decoding counters vLLM and
llama.cpp export (drafts, draft tokens, accepted tokens, accepted tokens per draft position)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mtplx.prefix_cache import PrefixCacheStats
from mtplx.request import GenerationStats
from server.engine_bridge import KVUsage

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    """All metrics of one app. A fresh registry per app keeps tests independent."""

    def __init__(
        self,
        queue_depth: Callable[[], float] | None = None,
        active: Callable[[], float] | None = None,
        running_sequences: Callable[[], float] | None = None,
        slow_readers: Callable[[], float] | None = None,
        prefix_cache: Callable[[], PrefixCacheStats | None] | None = None,
        kv: Callable[[], KVUsage | None] | None = None,
    ) -> None:
        """Every metric, registered on a fresh registry. The callables are read at each
        scrape: the bridge's queue and batch gauges, the engine's prefix cache and KV (None:
        the metric stays at 0, or absent for the collectors)."""
        self.registry = CollectorRegistry()
        if prefix_cache is not None:
            self.registry.register(PrefixCacheCollector(prefix_cache))
        if kv is not None:
            self.registry.register(KVCollector(kv))
        self._define_request_metrics()
        self._define_token_metrics()
        self._define_speculative_metrics()
        self._define_engine_metrics()
        for gauge, read in (
            (self.queue_depth, queue_depth),
            (self.running, active),
            (self.sequences_running, running_sequences),
            (self.slow_readers, slow_readers),
        ):
            if read is not None:
                gauge.set_function(read)

    def _define_request_metrics(self) -> None:
        """Per HTTP request, by endpoint: count by status, latency, time to first token."""
        r = self.registry
        self.requests = Counter(
            "mtplx_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "mtplx_request_duration_seconds", "Request latency, arrival to last byte",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "mtplx_time_to_first_token_seconds", "Arrival to first generated token",
            ["endpoint"], buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip

    def _define_token_metrics(self) -> None:
        """Prompt tokens processed and generated tokens sent."""
        r = self.registry
        self.prompt_tokens = Counter("mtplx_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("mtplx_generation_tokens", "Tokens generated", registry=r)

    def _define_speculative_metrics(self) -> None:
        """The speculative-decoding counters, named as vLLM's: cycles, drafts, draft and
        accepted tokens, and both per draft position."""
        r = self.registry
        self.cycles = Counter("mtplx_spec_decode_cycles", "Verify forwards", registry=r)
        self.drafts = Counter(
            "mtplx_spec_decode_num_drafts", "Cycles that verified draft tokens", registry=r
        )
        self.draft_tokens = Counter(
            "mtplx_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            "mtplx_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_position = Counter(
            "mtplx_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position", ["position"], registry=r,
        )  # fmt: skip
        self.drafted_per_position = Counter(
            "mtplx_spec_decode_num_draft_tokens_per_pos",
            "Draft tokens proposed at each draft position", ["position"], registry=r,
        )  # fmt: skip

    def _define_engine_metrics(self) -> None:
        """The engine's queue and batch gauges (set to read the bridge in ``__init__``) and
        what each of its steps ran: rows, tokens committed, seconds."""
        r = self.registry
        self.queue_depth = Gauge("mtplx_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("mtplx_requests_running", "Requests the engine is running", registry=r)
        self.sequences_running = Gauge(
            "mtplx_sequences_running", "Sequences (batch rows) the engine is decoding", registry=r
        )
        self.slow_readers = Gauge(
            "mtplx_slow_reader_cancellations",
            "Requests cancelled because their client stopped reading", registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "mtplx_batch_size", "Rows per engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.step_tokens = Histogram(
            "mtplx_tokens_per_step", "Tokens committed per engine step (all rows)",
            buckets=_STEP_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "mtplx_step_duration_seconds", "Seconds per engine step",
            buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip

    def observe_step(self, rows: int, tokens: int, seconds: float) -> None:
        """One engine step: its batch rows, the tokens it committed, its duration."""
        self.batch_size.observe(rows)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        """One finished HTTP request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.latency.labels(endpoint=endpoint).observe(seconds)

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        """Time from arrival to the first generated token."""
        self.ttft.labels(endpoint=endpoint).observe(seconds)

    def observe_generation(self, prompt_tokens: int, stats: Sequence[GenerationStats]) -> None:
        """Prompt and speculative counters of one request's finished choices (generated
        tokens are counted as they are sent: ``observe_sent_tokens``)."""
        self.prompt_tokens.inc(prompt_tokens)
        for s in stats:
            self.cycles.inc(s.num_cycles)
            self.drafts.inc(s.num_drafts)
            self.draft_tokens.inc(s.num_draft_tokens)
            self.accepted_tokens.inc(s.num_accepted_tokens)
            for position, count in enumerate(s.accepted_per_position):
                self.accepted_per_position.labels(position=str(position)).inc(count)
            for position, count in enumerate(s.drafted_per_position):
                self.drafted_per_position.labels(position=str(position)).inc(count)

    def observe_sent_tokens(self, count: int = 1) -> None:
        """Generated tokens that reached the client (a stream's as they go out)."""
        self.generation_tokens.inc(count)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class PrefixCacheCollector(Collector):
    """The engine's prefix-cache counters, read at each scrape (none while it loads, or
    when the cache is off)."""

    def __init__(self, read: Callable[[], PrefixCacheStats | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """Hits, misses, tokens served, evictions; bytes and blocks held, the budget."""
        stats = self._read()
        if stats is None:
            return
        for name, documentation, value in (
            ("hits", "Prompts that reused cached prefix blocks", stats.hits),
            ("misses", "Prompts that found no cached prefix block", stats.misses),
            ("hit_tokens", "Prompt tokens served from the prefix cache", stats.hit_tokens),
            ("evictions", "Prefix cache blocks evicted", stats.evictions),
        ):
            yield CounterMetricFamily(f"mtplx_prefix_cache_{name}", documentation, value)
        for name, documentation, value in (
            ("bytes", "Bytes held by cached prefix blocks", stats.num_bytes),
            ("blocks", "Cached prefix blocks", stats.num_blocks),
            ("max_bytes", "The prefix cache's byte budget", stats.max_bytes),
        ):
            yield GaugeMetricFamily(f"mtplx_prefix_cache_{name}", documentation, value)


class KVCollector(Collector):
    """The engine's KV memory, read at each scrape (none while it loads): the bytes its
    stores hold and, where there is one, the bound admission keeps new requests under."""

    def __init__(self, read: Callable[[], KVUsage | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        """``mtplx_kv_bytes``; ``mtplx_kv_max_bytes`` when bounded."""
        usage = self._read()
        if usage is None:
            return
        yield GaugeMetricFamily(
            "mtplx_kv_bytes", "Bytes of KV memory the engine's stores hold", usage.bytes
        )
        if usage.max_bytes is not None:
            yield GaugeMetricFamily(
                "mtplx_kv_max_bytes",
                "KV memory bound of admission (max_kv_bytes): a request starts when its "
                "prompt's KV fits under it",
                usage.max_bytes,
            )
