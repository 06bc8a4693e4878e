"""Prometheus metrics of the HTTP service, on the service's own CollectorRegistry.

Counters and histograms are updated by the request handlers; scheduler state (queue
depth, KV blocks, slot states, finished requests by reason) is read from
``Scheduler.stats()`` at scrape time, so it is never stale. The monitor's gauges
(temperature, power, thermal state, energy) are registered on the same registry by
``MonitorMetrics``.

Service metrics (prefix ``edge_``):

* ``requests_total{endpoint,status}``; ``requests_in_flight``
* ``requests_finished_total{endpoint,reason}`` (stop, length, cancelled, error)
* ``prompt_tokens_total``, ``cached_prompt_tokens_total``, ``generated_tokens_total``
* ``time_to_first_token_seconds`` (arrival to first token, as the client sees it),
  ``time_per_output_token_seconds``, ``request_duration_seconds`` (histograms)
* ``queue_depth``, ``kv_blocks{state=used|cached|evictable|free}``, ``kv_blocks_total``,
  ``slots{state=idle|prefilling|ready|decoding}``, ``scheduler_requests_finished_total{reason}``,
  ``scheduler_alive``, ``scheduler_heartbeat_age_seconds``, ``model_ready``
* ``speculative_steps_total``, ``speculative_proposed_tokens_total``,
  ``speculative_accepted_tokens_total`` (finished speculative requests; accepted per step
  is their ratio), ``speculative_acceptance_rate`` (accepted / proposed, all time)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

SLOT_STATES = ("idle", "prefilling", "ready", "decoding")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _SchedulerCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None], ready: Callable[[], bool]) -> None:
        self._stats = stats
        self._ready = ready

    def collect(self) -> Iterator[Any]:
        ready = GaugeMetricFamily("edge_model_ready", "1 once the model is loaded and warmed up")
        ready.add_metric([], 1.0 if self._ready() else 0.0)
        yield ready
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the engine is in trouble
            stats = None
        if not stats:
            return
        g = GaugeMetricFamily("edge_queue_depth", "Requests waiting for a slot")
        g.add_metric([], float(stats.get("queue_depth", 0)))
        yield g
        kv = GaugeMetricFamily("edge_kv_blocks", "KV-cache blocks by state", labels=["state"])
        for state in ("used", "cached", "evictable", "free"):
            v = stats.get(f"kv_blocks_{state}")
            if v is not None:
                kv.add_metric([state], float(v))
        yield kv
        if stats.get("kv_blocks_total") is not None:
            t = GaugeMetricFamily("edge_kv_blocks_total", "KV-cache blocks in the pool")
            t.add_metric([], float(stats["kv_blocks_total"]))
            yield t
        slots = GaugeMetricFamily("edge_slots", "Scheduler slots by state", labels=["state"])
        counts = dict.fromkeys(SLOT_STATES, 0)
        for slot in stats.get("slots", []) or []:
            state = str(slot.get("state", "idle"))
            counts[state] = counts.get(state, 0) + 1
        for state, n in counts.items():
            slots.add_metric([state], float(n))
        yield slots
        fin = CounterMetricFamily(
            "edge_scheduler_requests_finished", "Requests the scheduler finished, by reason", labels=["reason"]
        )
        for reason, n in sorted((stats.get("requests_finished") or {}).items()):
            fin.add_metric([str(reason)], float(n))
        yield fin
        yield from _speculative_metrics(stats.get("speculative") or {})
        alive = GaugeMetricFamily("edge_scheduler_alive", "1 while the engine loop runs")
        alive.add_metric([], 1.0 if stats.get("alive") else 0.0)
        yield alive
        hb = stats.get("last_heartbeat")
        if hb is not None:
            age = GaugeMetricFamily("edge_scheduler_heartbeat_age_seconds", "Seconds since the engine loop's heartbeat")
            age.add_metric([], max(0.0, time.monotonic() - float(hb)))
            yield age


def _speculative_metrics(spec: dict[str, Any]) -> Iterator[Any]:
    for key, name, doc in (
        ("steps", "edge_speculative_steps", "Verify steps of speculative requests"),
        ("proposed_tokens", "edge_speculative_proposed_tokens", "Speculative tokens proposed"),
        ("accepted_tokens", "edge_speculative_accepted_tokens", "Speculative tokens accepted"),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(spec.get(key) or 0))
        yield c
    rate = spec.get("acceptance_rate")
    if rate is not None:
        g = GaugeMetricFamily("edge_speculative_acceptance_rate", "Accepted / proposed speculative tokens")
        g.add_metric([], float(rate))
        yield g


class ServiceMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], dict[str, Any] | None],
        ready: Callable[[], bool],
    ) -> None:
        self.registry = registry
        r = registry
        self.requests = Counter("edge_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.in_flight = Gauge("edge_requests_in_flight", "Generation requests being served", registry=r)
        self.finished = Counter("edge_requests_finished", "Generation requests finished, by reason",
                                ["endpoint", "reason"], registry=r)
        self.prompt_tokens = Counter("edge_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("edge_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("edge_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("edge_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("edge_time_per_output_token_seconds", "Time between output tokens",
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("edge_request_duration_seconds", "Request arrival to last token",
                                  buckets=DURATION_BUCKETS, registry=r)
        registry.register(_SchedulerCollector(stats, ready))
