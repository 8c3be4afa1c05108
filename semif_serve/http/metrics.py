"""Prometheus metrics for one server process: requests, rejections, latency, model lifecycle,
and each loaded model's state-prefix cache.

Counters are fed by the HTTP middleware (requests) and by the runtime's event hook (loads,
unloads, evictions, retirements); per-model gauges are read from the runtime at scrape time, so a
scrape reserves nothing and resets no timer. Each app has its own registry (no global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

STATES = ("unloaded", "loading", "ready", "reconfiguring", "unloading")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
BATCH_TOKEN_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 1 << 24)
CONTENT_TYPE = CONTENT_TYPE_LATEST
ABANDONED = "client_closed_request"  # the error code of a request dropped because its client left


class Metrics:
    def __init__(
        self, model_status: Callable[[], list[dict[str, Any]]], in_flight: Callable[[], int]
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "semif_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "semif_rejections",
            "Requests refused, by error code",
            ["reason"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "semif_request_seconds",
            "Request duration in seconds",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.model_events = Counter(
            "semif_model_events",
            "Model lifecycle events (load, load_failed, unload, evict, retire)",
            ["model", "event"],
            registry=self.registry,
        )
        self.abandoned = Counter(
            "semif_requests_abandoned",
            "Requests dropped unscored because their client closed the connection while waiting",
            registry=self.registry,
        )
        self.replies_undelivered = Counter(
            "semif_replies_undelivered",
            "Replies the client did not take within SEMIF_WRITE_TIMEOUT_S, or reset before taking",
            registry=self.registry,
        )
        self.batch_rows = Histogram(
            "semif_batch_rows",
            "Rows per forward of a batched engine call (SEMIF_MAX_BATCH_ROWS > 1), as it ran",
            ["model"],
            buckets=BATCH_ROW_BUCKETS,
            registry=self.registry,
        )
        self.batch_tokens = Histogram(
            "semif_batch_tokens",
            "Tokens per forward of a batched engine call: rows x width as it ran, buckets included",
            ["model"],
            buckets=BATCH_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.batch_padding = Counter(
            "semif_batch_padding_tokens",
            "Padding tokens in the forwards of batched engine calls (less the prompts' own tokens)",
            ["model"],
            registry=self.registry,
        )
        self.registry.register(_RuntimeCollector(model_status, in_flight))

    def observe_request(self, route: str, status: int, seconds: float, error: str | None) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)
        if error is not None:
            self.rejections.labels(reason=error).inc()
        if error == ABANDONED:
            self.abandoned.inc()

    def batch(self, model_id: str, forwards: list[Any]) -> None:
        """The forwards one batched engine call ran (`scoring.inputs.Forward`: rows, tokens,
        the prompts' own tokens), each observed once."""
        for forward in forwards:
            self.batch_rows.labels(model=model_id).observe(forward.rows)
            self.batch_tokens.labels(model=model_id).observe(forward.tokens)
            self.batch_padding.labels(model=model_id).inc(forward.tokens - forward.real_tokens)

    def reply_undelivered(self) -> None:
        self.replies_undelivered.inc()

    def model_event(self, model_id: str, event: str) -> None:
        self.model_events.labels(model=model_id, event=event).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _prefix_cache_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """The state-prefix cache's figures per loaded model, keyed by their name in its stats."""
    return {
        "hits": CounterMetricFamily(
            "semif_prefix_cache_hits",
            "Calls that resumed all of their state prefix from a stored one",
            labels=["model"],
        ),
        "partial_hits": CounterMetricFamily(
            "semif_prefix_cache_partial_hits",
            "Calls that resumed the start of their state prefix (a grown or edited state)",
            labels=["model"],
        ),
        "reused_tokens": CounterMetricFamily(
            "semif_prefix_cache_reused_tokens",
            "State-prefix tokens resumed from stored prefixes",
            labels=["model"],
        ),
        "prefilled_tokens": CounterMetricFamily(
            "semif_prefix_cache_prefilled_tokens",
            "State-prefix tokens prefilled by calls that looked the cache up",
            labels=["model"],
        ),
        "misses": CounterMetricFamily(
            "semif_prefix_cache_misses", "Lookups of a state prefix not stored", labels=["model"]
        ),
        "evictions": CounterMetricFamily(
            "semif_prefix_cache_evictions", "Stored prefixes evicted for room", labels=["model"]
        ),
        "bytes": GaugeMetricFamily(
            "semif_prefix_cache_bytes", "Tensor bytes of stored prefixes", labels=["model"]
        ),
        "entries": GaugeMetricFamily(
            "semif_prefix_cache_entries", "Stored state prefixes", labels=["model"]
        ),
        "checkpoints": GaugeMetricFamily(
            "semif_prefix_cache_checkpoints",
            "Linear-attention state checkpoints kept inside stored prefixes (hybrid models)",
            labels=["model"],
        ),
    }


def _queue_families() -> dict[str, CounterMetricFamily]:
    """Each model's queue figures (`runtime.pace.FIGURES`), keyed by their name there."""
    counters = {
        "waits": ("semif_queue_waits", "Requests whose wait in the model's queue ended"),
        "waited_s": ("semif_queue_wait_seconds", "Seconds requests waited in the model's queue"),
        "estimated_waits": (
            "semif_queue_estimated_waits",
            "Waits that were given an estimate as they queued (the model's pace was measured)",
        ),
        "estimated_s": (
            "semif_queue_estimated_wait_seconds",
            "The estimates those waits were given, in seconds (compare with the next)",
        ),
        "estimated_waited_s": (
            "semif_queue_estimated_waited_seconds",
            "Seconds those same waits took",
        ),
    }
    return {
        key: CounterMetricFamily(name, text, labels=["model"])
        for key, (name, text) in counters.items()
    }


class _RuntimeCollector:
    """Per-model gauges, read from the runtime's status at scrape time."""

    def __init__(self, model_status, in_flight):
        self._model_status = model_status
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "semif_model_state", "1 for the model's current state", labels=["model", "state"]
        )
        queued = GaugeMetricFamily(
            "semif_model_queued_requests", "Requests waiting for the model", labels=["model"]
        )
        active = GaugeMetricFamily("semif_model_active_slots", "Slots in use", labels=["model"])
        cache = _prefix_cache_families()
        waits = _queue_families()
        estimate = GaugeMetricFamily(
            "semif_queue_estimate_seconds",
            "A request queued now would wait this long, at the model's recent pace (what a "
            "refusal's Retry-After says); absent until a call has been measured",
            labels=["model"],
        )
        abandoned = CounterMetricFamily(
            "semif_model_requests_abandoned",
            "Requests whose client left before (queued) or while (scoring) their engine call ran",
            labels=["model", "stage"],
        )
        for status in self._model_status():
            queue = status["queue"]
            for name, family in waits.items():
                family.add_metric([status["id"]], queue[name])
            if queue["estimated_wait_s"] is not None:
                estimate.add_metric([status["id"]], queue["estimated_wait_s"])
            for stage in ("queued", "scoring"):
                abandoned.add_metric([status["id"], stage], queue[f"abandoned_{stage}"])
            for name in STATES:
                state.add_metric([status["id"], name], 1.0 if status["state"] == name else 0.0)
            queued.add_metric([status["id"]], status["queued_requests"])
            active.add_metric([status["id"]], status["active_slots"])
            for name, family in cache.items():
                if status.get("prefix_cache") is not None:
                    family.add_metric([status["id"]], status["prefix_cache"][name])
        yield state
        yield queued
        yield active
        yield from cache.values()
        yield from waits.values()
        yield estimate
        yield abandoned
        in_flight = GaugeMetricFamily(
            "semif_requests_in_progress", "Scoring POSTs admitted (queued + scoring)"
        )
        in_flight.add_metric([], self._in_flight())
        yield in_flight

    def describe(self) -> list:
        return []
