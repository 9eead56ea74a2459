"""Prometheus metrics for operators, on an optional HTTP port bound to 127.0.0.1 (--metrics-port).

Names follow vLLM's where vLLM has one (vllm:time_to_first_token_seconds -> pagedserve_time_to_first_token_seconds):

    pagedserve_requests_total{interface,outcome}   requests by how they ended (OUTCOMES), interface grpc or http:
                                                   stop, length, abort (finished); cancelled (by the client);
                                                   invalid_argument, unauthenticated, not_found, too_large,
                                                   resource_exhausted, unavailable (refused); internal (failed).
                                                   gRPC: each Generate call. HTTP (sidecar/http_metrics.py): each
                                                   engine request (one per prompt), and each answer >= 400 that
                                                   reached no engine (by its status), whatever the route but
                                                   /health and /metrics
    pagedserve_time_to_first_token_seconds         histogram, arrival -> first token (engine clock)
    pagedserve_time_per_output_token_seconds       histogram, (last token - first token) / (tokens - 1), sample 0
    pagedserve_e2e_request_latency_seconds         histogram, the RPC's arrival -> its last message
    pagedserve_prompt_tokens_total, pagedserve_generation_tokens_total
    pagedserve_num_requests_running / _waiting     gauges: in the engine now; waiting = the queue length
    pagedserve_kv_cache_usage_perc                 gauge: KV blocks in use / blocks in the pool, in [0, 1]
    pagedserve_kv_cache_token_slot_utilization     gauge: tokens held / token slots of the blocks in use
    pagedserve_num_preemptions_total               counter
    pagedserve_prefix_cache_queries_total / _hits_total   counters of prompt tokens looked up / found cached
    pagedserve_prefix_cache_hit_rate               gauge: hits / queries since start
    pagedserve_memory_budget_bytes                 gauge: the engine's memory budget (runtime/worker/memory_budget.py);
                                                   compare with process_resident_memory_bytes, exported too
    pagedserve_tenant_requests_total{tenant,outcome}, pagedserve_tenant_tokens_total{tenant,kind}
                                                   with a tenants file: per tenant; `tenant` is only ever a name
                                                   from the file or "default" (bounded), never an API key

Engine figures are read at scrape time through AsyncEngine's read API: the worker's published snapshot
(AsyncEngine.stats, an EngineStats) and a few live counters, never live engine state. ENGINE_METRICS below
is the table of named engine metrics and the EngineStats fields each stands for. Any other numeric field of
EngineStats is exported as pagedserve_engine_<field>, so a figure appears as soon as it is added to
EngineStats; give it a named row in ENGINE_METRICS when it settles. NOT_METRICS names the fields left out.
tests/sidecar/test_stats_schema.py fails when a field is none of these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from pagedserve.runtime.engine.async_engine import AsyncEngine
from pagedserve.runtime.outputs import EngineStats

# vLLM's buckets, cut to what a small CPU/GPU sidecar sees.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0)


# The outcome label's values: a fixed set (nothing a client sends becomes a label).
OUTCOMES = ("stop", "length", "abort", "cancelled", "invalid_argument", "unauthenticated", "not_found", "too_large",
            "resource_exhausted", "unavailable", "internal")
INTERFACES = ("grpc", "http")


@dataclass(frozen=True)
class EngineMetric:
    """A named engine metric: its value from the engine's read API and stats snapshot, read at scrape time."""

    name: str  # a counter's without _total (prometheus_client adds it)
    kind: Literal["gauge", "counter"]
    doc: str
    value: Callable[[AsyncEngine, EngineStats], float]
    covers: tuple[str, ...] = ()  # the EngineStats fields it stands for (none: a live figure outside EngineStats)


ENGINE_METRICS: tuple[EngineMetric, ...] = (
    EngineMetric("pagedserve_num_requests_running", "gauge", "Requests running in the engine",
                 lambda e, s: s.num_running, ("num_running",)),
    # Live, and counting requests still on their way into the engine: the queue a new request joins.
    EngineMetric("pagedserve_num_requests_waiting", "gauge", "Requests waiting to be scheduled (the queue length)",
                 lambda e, s: e.num_waiting, ("num_waiting",)),
    EngineMetric("pagedserve_kv_cache_usage_perc", "gauge", "KV cache blocks in use / blocks in the pool",
                 lambda e, s: s.kv_block_usage, ("num_kv_blocks_used", "num_kv_blocks_total")),
    EngineMetric("pagedserve_kv_cache_token_slot_utilization", "gauge",
                 "Tokens held / token slots of the blocks in use",
                 lambda e, s: s.kv_token_slot_utilization, ("kv_token_slot_utilization",)),
    EngineMetric("pagedserve_num_preemptions", "counter", "Running requests preempted to free KV blocks",
                 lambda e, s: s.num_preemptions, ("num_preemptions",)),
    EngineMetric("pagedserve_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
                 lambda e, s: e.prefix_cache_counts()[0]),
    EngineMetric("pagedserve_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache",
                 lambda e, s: e.prefix_cache_counts()[1]),
    EngineMetric("pagedserve_prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries since start",
                 lambda e, s: s.prefix_cache_hit_rate, ("prefix_cache_hit_rate",)),
    EngineMetric("pagedserve_memory_budget_bytes", "gauge", "The engine's memory budget at start",
                 lambda e, s: e.memory_budget_bytes),
)
# EngineStats fields with no metric, and why.
NOT_METRICS: dict[str, str] = {
    "kv_transfer": "disaggregated-serving counters: on the wire (GetServerStats) and in the logs",
    "spec_method": "a name, not a number: on the wire and in the logs",
    "tenants": "per tenant: pagedserve_tenant_num_requests_running / _waiting, pagedserve_tenant_tokens_served",
}
TENANT_METRICS = (  # (name, help, kind, TenantStats field)
    ("pagedserve_tenant_num_requests_running", "Requests running, by tenant", "gauge", "num_running"),
    ("pagedserve_tenant_num_requests_waiting", "Requests queued, by tenant", "gauge", "num_waiting"),
    ("pagedserve_tenant_tokens_served", "Prompt + generated tokens computed, by tenant", "counter", "tokens_served"),
)
_COVERED = frozenset(name for m in ENGINE_METRICS for name in m.covers)


def generic_stat_fields(stats: EngineStats) -> tuple[str, ...]:
    """The fields of `stats` exported as pagedserve_engine_<field>: those neither named nor left out."""
    return tuple(f.name for f in dataclasses.fields(stats) if f.name not in _COVERED and f.name not in NOT_METRICS)


class ServerMetrics:
    """The sidecar's metrics: request counters and histograms fed by the servicer, engine gauges read
    at scrape time."""

    def __init__(self, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedserve_requests", "Requests by interface and outcome", ["interface", "outcome"],
                                registry=r)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.tenant_requests = Counter("pagedserve_tenant_requests", "Generate requests by tenant and outcome",
                                       ["tenant", "outcome"], registry=r)
        self.tenant_tokens = Counter("pagedserve_tenant_tokens", "Prompt and generated tokens by tenant",
                                     ["tenant", "kind"], registry=r)
        r.register(_EngineCollector(get_engine))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, open fds, CPU seconds
        self._http = None

    def count_request(self, interface: str, outcome: str) -> None:
        assert interface in INTERFACES, interface
        # The labels stay bounded: a name outside OUTCOMES (a new finish reason not added there) is "internal".
        outcome = outcome if outcome in OUTCOMES else "internal"
        self.requests.labels(interface=interface, outcome=outcome).inc()

    def observe_request(self, outcome: str, e2e_s: float, ttft_s: float | None = None, tpot_s: float | None = None,
                        prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        """A gRPC Generate call: its outcome and its figures."""
        self.count_request("grpc", outcome)
        self.observe_timings(e2e_s, ttft_s, tpot_s, prompt_tokens, generation_tokens)

    def observe_timings(self, e2e_s: float, ttft_s: float | None = None, tpot_s: float | None = None,
                        prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        """A request's latencies and token counts (its outcome is counted apart: count_request)."""
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def observe_tenant(self, tenant: str, outcome: str, prompt_tokens: int, generation_tokens: int) -> None:
        """`tenant` comes from the tenants file (or is "default"), never from what a caller sent."""
        outcome = outcome if outcome in OUTCOMES else "internal"
        self.tenant_requests.labels(tenant=tenant, outcome=outcome).inc()
        self.tenant_tokens.labels(tenant=tenant, kind="prompt").inc(prompt_tokens)
        self.tenant_tokens.labels(tenant=tenant, kind="generation").inc(generation_tokens)

    def serve(self, port: int) -> int:
        """Start the HTTP endpoint on 127.0.0.1:port (0 = any free port); returns the port bound."""
        self._http, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return self._http.server_address[1]

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _EngineCollector(Collector):
    def __init__(self, get_engine: Callable[[], AsyncEngine | None]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterator:
        engine = self._get_engine()
        if engine is None:  # still loading: no engine figures yet
            return
        s = engine.stats
        for m in ENGINE_METRICS:
            yield (_counter if m.kind == "counter" else _gauge)(m.name, m.doc, m.value(engine, s))
        for name in generic_stat_fields(s):
            value = getattr(s, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield _gauge(f"pagedserve_engine_{name}", f"EngineStats.{name}", value)
        # Labelled only by the tenants file's names and "default": bounded, nothing a client sends.
        for name, doc, kind, field in TENANT_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=["tenant"])
            for row in s.tenants:
                family.add_metric([row.name], getattr(row, field))
            yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
