"""/metrics: Prometheus text from a registry of this app's own (no process-global state).

Request-level series are observed here (TTFT and request histograms by mode, requests by route
and status); the rest is read from the service when scraped: store lookups by tier and result,
corrupt blobs, tier faults, tokens reused and recomputed, the queue, the scheduler's batches and KV budget, cached prompt heads.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)


class Metrics:
    def __init__(self, service, scheduler):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("ragcache_ttft_seconds", "Time to first token, retrieval included", ["mode"],
                              registry=self.registry, buckets=_BUCKETS)
        self.request = Histogram("ragcache_request_seconds", "Whole request, to the last token", ["mode"],
                                 registry=self.registry, buckets=_BUCKETS)
        self.requests = Counter("ragcache_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.registry.register(_ServiceCollector(service, scheduler))

    def observe(self, result: dict) -> None:
        t = result["timings_ms"]
        self.ttft.labels(result["mode"]).observe(t["ttft"] / 1000)
        self.request.labels(result["mode"]).observe(t["total"] / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServiceCollector:
    def __init__(self, service, scheduler):
        self.service, self.scheduler = service, scheduler

    def collect(self):
        svc = self.service
        lookups = CounterMetricFamily("ragcache_chunk_lookups", "Chunk KV lookups per tier", labels=["tier", "result"])
        corrupt = CounterMetricFamily("ragcache_kv_corrupt", "Blobs that failed their checksum (dropped)")
        errors = CounterMetricFamily("ragcache_store_errors", "Faults of a store tier (the request went on)",
                                     labels=["tier"])
        if svc.loaded("store"):
            stats = svc.store.stats()
            for t in stats["tiers"]:
                lookups.add_metric([t["name"], "hit"], t["hits"])
                lookups.add_metric([t["name"], "miss"], t["misses"])
                errors.add_metric([t["name"]], t["errors"])
            corrupt.add_metric([], stats["corrupt_dropped"])
        else:
            corrupt.add_metric([], 0)
        yield from (lookups, corrupt, errors)
        tokens = svc.generation.totals.tokens
        yield CounterMetricFamily("ragcache_recomputed_tokens", "Prompt tokens recomputed", value=tokens["recomputed"])
        yield CounterMetricFamily("ragcache_reused_tokens", "Prompt tokens served from cached KV",
                                  value=tokens["reused"])
        yield CounterMetricFamily("ragcache_chunks_prefilled", "Chunks no tier held, prefilled for a request",
                                  value=svc.generation.totals.chunks["prefilled"])
        yield GaugeMetricFamily("ragcache_queue_depth", "Requests waiting for the model", value=self.scheduler.waiting)
        yield GaugeMetricFamily("ragcache_running", "Requests admitted to the model (prefilling or decoding)",
                                value=self.scheduler.running)
        yield GaugeMetricFamily("ragcache_kv_budget_bytes", "RAGCACHE_KV_BUDGET_BYTES", value=self.scheduler.kv_budget)
        yield GaugeMetricFamily("ragcache_kv_in_use_bytes", "KV budget reserved by admitted requests",
                                value=self.scheduler.kv_in_use)
        yield GaugeMetricFamily("ragcache_prompt_heads_bytes", "Cached custom system prompts' KV, inside the budget",
                                value=svc.generation.prefixes.nbytes)
        stats = self.scheduler.stats
        yield GaugeMetricFamily("ragcache_kv_peak_bytes", "The most KV budget reserved at once", value=stats.kv_peak)
        for name, doc, tally in (
                ("ragcache_decode_batch_size", "Sequences per batched decode step", stats.decode_batch),
                ("ragcache_prefill_batch_size", "Requests per batched prefill (recompute)", stats.prefill_batch),
                ("ragcache_queue_wait_seconds", "Submitted to admitted (retrieval and KV loading included)",
                 stats.queue_wait)):
            yield HistogramMetricFamily(name, doc, buckets=tally.cumulative(), sum_value=tally.sum)
