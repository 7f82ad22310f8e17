"""The server's Prometheus series, in a registry of its own (``GET /metrics``; docs/serving.md
lists each one with the vLLM metric it corresponds to).

Every series has a ``model_name`` label (the served model name, vLLM's label). What the server
counts as it streams (:class:`ServerMetrics`):

* at a request's first token (its prefill done; :meth:`ServerMetrics.prefilled`): its prompt
  tokens, the prefix cache's query, hash-hit, recoverable and per-form usable tokens, its time to
  first token;
* per token (:meth:`ServerMetrics.token`): one generated token and, from the second on, the
  inter-token latency;
* at its end (:meth:`ServerMetrics.finished`): its finish reason and end-to-end latency.

Requests running and waiting and the preemptions so far are read from the runtime at scrape
time; the cache usage per form from the last :class:`~engine.runtime.engine_snapshot.EngineSnapshot`
(the server takes one on the engine thread before each scrape). No ``_created`` series are
exported (:class:`_WithoutCreated`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.runtime.engine_loop import EngineLoop, Token
from engine.runtime.engine_snapshot import EngineSnapshot
from engine.runtime.request import RuntimeRequest

TTFT_BUCKETS_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's buckets of ``vllm:time_to_first_token_seconds``, so dashboards compare."""
ITL_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""vLLM's buckets of ``vllm:inter_token_latency_seconds``."""
E2E_BUCKETS_SECONDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets of ``vllm:e2e_request_latency_seconds``."""
LEGACY_TTFT_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""The buckets ``kvscope_server_time_to_first_token_seconds`` always had."""


@dataclass(slots=True)
class ServerTotals:
    """Running sums of what the counters count (tokens), which the stats line takes differences
    of (a counter's value is not public in prometheus_client)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_recoverable_tokens: int = 0


class ServerMetrics:
    """The server's Prometheus series for ``loop``'s runtime served as ``model_name``.

    ``registry`` is what ``/metrics`` exposes (no ``_created`` series); :attr:`totals` are the
    token sums of the stats line. Call the observing methods from the event loop's thread.
    """

    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        inner = CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(_WithoutCreated(inner))
        self.totals = ServerTotals()
        self.model_name = model_name
        self.snapshot: EngineSnapshot | None = None
        """The last snapshot of the engine (None before the first one); read at scrape time."""
        m = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, m, registry=inner)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, registry=inner, buckets=buckets)

        self.requests = Counter("kvscope_server_requests", "Requests ended, by finish reason", [*m, "finish_reason"], registry=inner)
        self.prompt_tokens = counter("kvscope_server_prompt_tokens", "Prompt tokens of requests whose prefill finished").labels(model_name)
        self.cached_tokens = counter("kvscope_server_cached_prompt_tokens", "Prompt tokens the prefix cache served (recoverable tokens)").labels(model_name)
        self.generation_tokens = counter("kvscope_server_generation_tokens", "Tokens generated (streamed to clients)").labels(model_name)
        self.prefix_queries = counter("kvscope_prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(model_name)
        self.prefix_hits = counter("kvscope_prefix_cache_hits", "Prompt tokens whose block hashes the prefix index matched (a hash hit; not all reusable)").labels(model_name)
        self.prefix_recoverable = counter("kvscope_prefix_cache_recoverable_tokens", "Prompt tokens resumed from cached state instead of computed (L* minus Tail-Replay)").labels(model_name)
        self.form_usable = Counter(
            "kvscope_prefix_cache_usable_tokens", "Per form: prompt tokens that form alone could resume from exactly", [*m, "form"], registry=inner
        )  # fmt: skip
        self.ttft = histogram("kvscope_time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS_SECONDS).labels(model_name)
        self.legacy_ttft = histogram(
            "kvscope_server_time_to_first_token_seconds", "Arrival to first token (kvscope_time_to_first_token_seconds with the older buckets)",
            LEGACY_TTFT_BUCKETS_SECONDS,
        ).labels(model_name)  # fmt: skip
        self.itl = histogram("kvscope_inter_token_latency_seconds", "Between consecutive tokens of one request", ITL_BUCKETS_SECONDS).labels(model_name)
        self.e2e = histogram("kvscope_e2e_request_latency_seconds", "Arrival to the end of a request", E2E_BUCKETS_SECONDS).labels(model_name)
        runtime = loop.runtime
        running = Gauge("kvscope_server_requests_running", "Requests holding cache leases", m, registry=inner)
        running.labels(model_name).set_function(lambda: len(runtime.running))
        waiting = Gauge("kvscope_server_requests_waiting", "Requests queued", m, registry=inner)
        waiting.labels(model_name).set_function(lambda: len(runtime.waiting))
        inner.register(_EngineCollector(self, loop))

    def prefilled(self, r: RuntimeRequest, *, first_token: bool) -> None:
        """``r``'s prefill finished (its first token came, or it ended without one): its prompt
        tokens and the prefix cache's tokens from the report of its first admission; with
        ``first_token``, its time to first token in seconds (``r.ttft_seconds``). A request
        never admitted (no report) counts nothing."""
        report = r.report
        if report is None:
            return
        self.prompt_tokens.inc(report.prompt_tokens)
        self.cached_tokens.inc(report.recoverable_tokens)
        self.prefix_queries.inc(report.prompt_tokens)
        self.prefix_hits.inc(report.hash_hit_tokens)
        self.prefix_recoverable.inc(report.recoverable_tokens)
        for f in report.forms:
            self.form_usable.labels(self.model_name, str(f.form)).inc(f.usable_tokens)
        t = self.totals
        t.prompt_tokens += report.prompt_tokens
        t.prefix_queries_tokens += report.prompt_tokens
        t.prefix_hits_tokens += report.hash_hit_tokens
        t.prefix_recoverable_tokens += report.recoverable_tokens
        if first_token and r.ttft_seconds is not None:
            self.ttft.observe(r.ttft_seconds)
            self.legacy_ttft.observe(r.ttft_seconds)

    def token(self, update: Token, previous: Token | None) -> None:
        """One generated token; after the request's first (``previous``), the inter-token
        latency ``update.sampled_at − previous.sampled_at`` in seconds."""
        self.generation_tokens.inc()
        self.totals.generation_tokens += 1
        if previous is not None:
            self.itl.observe(update.sampled_at - previous.sampled_at)

    def finished(self, finish_reason: str, e2e_seconds: float | None) -> None:
        """A request ended with ``finish_reason`` (``stop``, ``length``, ``abort``) after
        ``e2e_seconds`` from arrival (None: a client gone, not timed)."""
        self.requests.labels(self.model_name, finish_reason).inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)


class _EngineCollector(Collector):
    """Read at scrape time: ``kvscope_server_preemptions_total`` from the runtime's running total
    (prometheus_client's ``Counter`` cannot be backed by a function) and, per form, the cache
    usage and occupancy ratios of the last engine snapshot."""

    def __init__(self, metrics: ServerMetrics, loop: EngineLoop) -> None:
        self._metrics = metrics
        self._loop = loop

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        name = self._metrics.model_name
        preemptions = CounterMetricFamily("kvscope_server_preemptions", "Requests preempted by recompute since start", labels=["model_name"])
        preemptions.add_metric([name], self._loop.runtime.num_preemptions)
        yield preemptions
        snapshot = self._metrics.snapshot
        if snapshot is None:
            return
        usage = GaugeMetricFamily(
            "kvscope_cache_usage_ratio", "Per form: leased blocks / blocks of its fullest device pool, 0..1 (vLLM's kv_cache_usage_perc)", labels=["model_name", "form"]
        )  # fmt: skip
        occupancy = GaugeMetricFamily(
            "kvscope_cache_occupancy_ratio", "Per form: blocks holding state (leased or cached) / blocks of its fullest device pool, 0..1", labels=["model_name", "form"]
        )  # fmt: skip
        for f in snapshot.forms:
            usage.add_metric([name, str(f.form)], f.usage_ratio)
            occupancy.add_metric([name, str(f.form)], f.occupancy_ratio)
        yield usage
        yield occupancy


class _WithoutCreated(Collector):
    """``inner``'s series without the ``_created`` samples prometheus_client adds to counters and
    histograms (its switch, ``disable_created_metrics``, is process-wide)."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
