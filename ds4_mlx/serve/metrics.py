"""`GET /metrics`: the server's counters in Prometheus' text format, through `prometheus-client`.

Each server has its own registry (two servers in one process, as in the tests, do not share counters). Counters
and histograms are updated on the event loop as answers end; the queue, the running request and the checkpoint
stores are read when scraped, from values their owners keep as plain numbers (no lock is taken, nothing is walked).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..events import Done, Event, ReasoningDelta, TextDelta, ToolCallStart

if TYPE_CHECKING:
    from ..engine import Engine
    from .worker import Worker

PREFIX = "ds4"
RATE_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 200, 500, 1000, 2000, 4000, 8000, float("inf"))
"""Tokens a second: decode runs ~10-150 a stream, prefill hundreds to thousands."""
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, float("inf"))
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Stores(Collector):
    """What the engine's checkpoint stores hold and have dropped, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ram = self.engine.checkpoints
        yield GaugeMetricFamily(f"{PREFIX}_checkpoint_bytes", "Bytes the in-memory checkpoints hold.",
                                value=ram.held_bytes)
        yield CounterMetricFamily(f"{PREFIX}_checkpoint_evictions", "In-memory checkpoints dropped for the budget.",
                                  value=ram.evictions)
        disk = self.engine.kv_store
        if disk is not None:
            yield GaugeMetricFamily(f"{PREFIX}_disk_cache_bytes", "Bytes of the disk KV cache's checkpoint files.",
                                    value=disk.disk_bytes)
            yield CounterMetricFamily(f"{PREFIX}_disk_cache_evictions", "Disk checkpoints deleted for the budget.",
                                      value=disk.evictions)


class Metrics:
    """The server's metrics: requests, tokens, speeds, first-token times, prefix reuse, queue and stores."""

    def __init__(self, worker: Worker) -> None:
        engine = worker.engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests answered, by API and status code.",
                                ["api", "status"], registry=r)
        Gauge(f"{PREFIX}_queue_length", "Generation requests waiting for a free lane.",
              registry=r).set_function(lambda: worker.queued)
        Gauge(f"{PREFIX}_running_sessions", "Generations running now, one a lane (--parallel at most).",
              registry=r).set_function(lambda: worker.running)
        self.prompt = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations.", ["api"], registry=r)
        self.cached = Counter(f"{PREFIX}_cached_tokens", "Prompt tokens reused instead of prefilled.", ["api"],
                              registry=r)
        self.generated = Counter(f"{PREFIX}_generated_tokens", "Tokens generated (reasoning included).", ["api"],
                                 registry=r)
        self.prefill_seconds = Counter(f"{PREFIX}_prefill_seconds", "Seconds spent prefilling.", registry=r)
        self.decode_seconds = Counter(f"{PREFIX}_decode_seconds", "Seconds spent decoding.", registry=r)
        self.prefill_rate = Histogram(f"{PREFIX}_prefill_tokens_per_second", "Prefill speed of each request.",
                                      buckets=RATE_BUCKETS, registry=r)
        self.decode_rate = Histogram(f"{PREFIX}_decode_tokens_per_second", "Decode speed of each request.",
                                     buckets=RATE_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "From the request's arrival to its first generated token.", buckets=TTFT_BUCKETS,
                              registry=r)
        self.finishes = Counter(f"{PREFIX}_finished", "Generations by finish reason.", ["api", "finish_reason"],
                                registry=r)
        self.reuse = Counter(f"{PREFIX}_prompt_reuse", "Prompts by where their reused prefix came from (live "
                             "session, ram checkpoint, disk, none).", ["source"], registry=r)
        self.checkpoint_lookups = Counter(f"{PREFIX}_checkpoint_lookups", "Prompts that did not extend the live "
                                          "session, by whether an in-memory checkpoint served them.", ["result"],
                                          registry=r)
        self.disk_lookups = Counter(f"{PREFIX}_disk_cache_lookups", "Prompts that did not extend the live session, "
                                    "by whether a disk checkpoint served them (with --kv-disk-dir).", ["result"],
                                    registry=r)
        self.disk_on = engine.kv_store is not None
        r.register(_Stores(engine))

    def answered(self, api: str, status: int) -> None:
        self.requests.labels(api, str(status)).inc()

    async def watch(self, api: str, arrived: float, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """Passes a job's events on, timing the first generated token and counting the end."""
        first = True
        async for event in events:
            if first and isinstance(event, (TextDelta, ReasoningDelta, ToolCallStart)):
                first = False
                self.ttft.observe(time.monotonic() - arrived)
            elif isinstance(event, Done):
                self._done(api, event)
            yield event

    def _done(self, api: str, done: Done) -> None:
        usage = done.usage
        self.prompt.labels(api).inc(usage.prompt_tokens)
        self.cached.labels(api).inc(usage.cached_tokens)
        self.generated.labels(api).inc(usage.completion_tokens)
        self.finishes.labels(api, done.finish_reason).inc()
        self.prefill_seconds.inc(done.prefill_seconds)
        self.decode_seconds.inc(done.decode_seconds)
        if usage.cache_write_tokens and done.prefill_seconds > 0:
            self.prefill_rate.observe(usage.cache_write_tokens / done.prefill_seconds)
        if usage.completion_tokens and done.decode_seconds > 0:
            self.decode_rate.observe(usage.completion_tokens / done.decode_seconds)
        if done.reuse is not None:
            source = done.reuse.source
            self.reuse.labels(source).inc()
            if source != "live":
                self.checkpoint_lookups.labels("hit" if source == "ram" else "miss").inc()
                if self.disk_on:
                    self.disk_lookups.labels("hit" if source == "disk" else "miss").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
