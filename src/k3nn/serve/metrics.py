"""Prometheus metrics of ``k3nn serve`` (``GET /metrics``), in a registry of their own.

Per request, observed by the HTTP side when a request ends:

* ``k3nn_requests_total{outcome}``: generation requests by outcome — ``stop`` / ``length`` (the first choice's
  finish reason), ``abort`` (the client went away, or shutdown), ``error`` (failed inside the engine),
  ``rejected`` (refused before anything was queued: bad input, or the engine not ready; a 401 is not counted);
* ``k3nn_time_to_first_token_seconds``, ``k3nn_time_per_output_token_seconds`` (per choice: arrival → first
  token; (last − first token) / (tokens − 1)), ``k3nn_e2e_request_latency_seconds`` (arrival → last token);
* ``k3nn_prompt_tokens_total``, ``k3nn_generation_tokens_total``.

From the engine, read on its thread at scrape time (``Engine.metrics()`` and its queues):
``k3nn_num_requests_running``, ``k3nn_num_requests_waiting``, ``k3nn_prefix_cache_hit_rate`` (token hit rate of
the prefix cache), ``k3nn_num_preemptions_total``, ``k3nn_engine_steps_total``, ``k3nn_warmup_seconds`` and, with a
drafter, ``k3nn_spec_decode_acceptance_rate`` / ``k3nn_spec_decode_acceptance_length`` /
``k3nn_spec_decode_num_draft_tokens_total`` / ``k3nn_spec_decode_num_accepted_tokens_total``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServeMetrics", "engine_stats", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)

OUTCOMES = ("stop", "length", "abort", "error", "rejected")


def engine_stats(engine) -> dict[str, Any]:
    """What ``/metrics`` reads from the engine: ``Engine.metrics()`` plus the queue lengths. Run it on the engine
    thread (:meth:`k3nn.serve.AsyncEngine.call`)."""
    m = dict(engine.metrics())
    m["running"] = len(engine.running)
    m["waiting"] = len(engine.waiting)
    return m


class _EngineCollector(Collector):
    def __init__(self):
        self.stats: dict[str, Any] = {}

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("k3nn_num_requests_running", "Engine requests holding a running row",
                                value=s.get("running", 0))
        yield GaugeMetricFamily("k3nn_num_requests_waiting", "Engine requests waiting for admission",
                                value=s.get("waiting", 0))
        yield CounterMetricFamily("k3nn_num_preemptions", "Requests preempted (recomputed later) by the scheduler",
                                  value=s.get("preemptions", 0))
        yield CounterMetricFamily("k3nn_engine_steps", "Engine steps run", value=s.get("steps", 0))
        yield GaugeMetricFamily("k3nn_warmup_seconds", "Seconds Engine.warmup() took at startup",
                                value=s.get("warmup_s", 0.0))
        if "cache_hit_rate" in s:
            yield GaugeMetricFamily("k3nn_prefix_cache_hit_rate",
                                    "Fraction of prompt tokens served from the prefix cache", value=s["cache_hit_rate"])
        if "spec_drafted" in s:
            yield GaugeMetricFamily("k3nn_spec_decode_acceptance_rate", "Accepted / drafted tokens",
                                    value=s.get("spec_acceptance_rate", 0.0))
            yield GaugeMetricFamily("k3nn_spec_decode_acceptance_length",
                                    "Tokens emitted per verify window (accepted drafts + 1)",
                                    value=s.get("spec_acceptance_length", 0.0))
            yield CounterMetricFamily("k3nn_spec_decode_num_draft_tokens", "Drafted tokens", value=s["spec_drafted"])
            yield CounterMetricFamily("k3nn_spec_decode_num_accepted_tokens", "Accepted draft tokens",
                                      value=s.get("spec_accepted", 0))


class ServeMetrics:
    """The server's metrics (one :class:`prometheus_client.CollectorRegistry` per server)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("k3nn_requests", "Generation requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.ttft = Histogram("k3nn_time_to_first_token_seconds", "Arrival to first token, per choice",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("k3nn_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per choice", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("k3nn_e2e_request_latency_seconds", "Arrival to the last token, per request",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("k3nn_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("k3nn_generation_tokens", "Tokens generated", registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def observe_request(self, outcome: str, arrival: float, end: float | None,
                        choices: list[tuple[float | None, float | None, int]]) -> None:
        """One request ended: its ``outcome`` (:data:`OUTCOMES`), arrival and last-token times
        (``time.perf_counter()``), and per choice (first token time, last token time, tokens)."""
        self.requests.labels(outcome).inc()
        for first, last, n in choices:
            if first is not None:
                self.ttft.observe(max(0.0, first - arrival))
                if last is not None and n > 1:
                    self.tpot.observe(max(0.0, (last - first) / (n - 1)))
            self.generation_tokens.inc(n)
        if end is not None and outcome in ("stop", "length"):
            self.e2e.observe(max(0.0, end - arrival))

    def render(self, stats: dict[str, Any] | None) -> bytes:
        """The Prometheus text exposition, with the engine's ``stats`` (:func:`engine_stats`; None: unchanged)."""
        if stats is not None:
            self._engine.stats = stats
        return generate_latest(self.registry)
