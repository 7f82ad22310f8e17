"""The server's Prometheus series, in a registry of its own (``GET /metrics``).

Requests ended by finish reason, prompt / cached / generated tokens and the time to first token
are counted as requests end (:meth:`ServerMetrics.observe`); requests running and waiting and the
preemptions so far are read from the runtime at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from engine.runtime.engine_loop import EngineLoop
from engine.runtime.request import RuntimeRequest


class ServerMetrics:
    """The server's Prometheus series (its own registry)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvscope_server_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvscope_server_prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.cached_tokens = Counter("kvscope_server_cached_prompt_tokens", "Prompt tokens the prefix cache served", registry=r)
        self.generation_tokens = Counter("kvscope_server_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "kvscope_server_time_to_first_token_seconds", "Arrival to first token", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )  # fmt: skip
        runtime = loop.runtime
        Gauge("kvscope_server_requests_running", "Requests holding cache leases", registry=r).set_function(lambda: len(runtime.running))
        Gauge("kvscope_server_requests_waiting", "Requests queued", registry=r).set_function(lambda: len(runtime.waiting))
        r.register(_PreemptionCollector(lambda: runtime.num_preemptions))

    def observe(self, r: RuntimeRequest, finish_reason: str, generated: int) -> None:
        """Count an ended request: its finish reason, prompt tokens, the prompt tokens the cache
        served (its report's recoverable tokens), ``generated`` tokens and, when it generated
        any, its time to first token in seconds."""
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(len(r.prompt_token_ids))
        self.generation_tokens.inc(generated)
        if r.report is not None:
            self.cached_tokens.inc(r.report.recoverable_tokens)
        if r.ttft_seconds is not None and generated:
            self.ttft.observe(r.ttft_seconds)


class _PreemptionCollector(Collector):
    """``kvscope_server_preemptions_total``: a counter read from the runtime's running total at
    scrape time (prometheus_client's ``Counter`` cannot be backed by a function)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("kvscope_server_preemptions", "Requests preempted by recompute since start", value=self._read())
