"""Prometheus `/metrics` for `ferrollm serve`, under vLLM's metric names: the scheduler's
running and waiting requests, KV-cache usage and prefix-cache tokens (read from the core at
scrape time), and per-request histograms of time to first token, inter-token latency and
end-to-end latency, plus token and finished-request counters (recorded by `AsyncLLM`'s step
thread through `StatLogger`).

Each app gets its own registry, so several servers (or tests) in one process never clash.
Cost: a few dict updates per request per step, on the step thread.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (seconds), trimmed.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class _CoreCollector:
    """Reads the core's counters at scrape time (no bookkeeping between scrapes)."""

    def __init__(self, core: Any, model_name: str):
        self.core = core
        self.labels = {"model_name": model_name}

    def collect(self):
        s = self.core.stats()
        for name, doc, value in (("vllm:num_requests_running", "Requests in model execution batches.", s["num_running"]),
                                 ("vllm:num_requests_waiting", "Requests waiting to be processed.", s["num_waiting"]),
                                 ("vllm:kv_cache_usage_perc", "KV-cache usage (1 means 100 percent).", s["kv_cache_usage"])):
            g = GaugeMetricFamily(name, doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), float(value))
            yield g
        for name, doc, value in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s["prefix_cache_queried_tokens"]),
                                 ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s["prefix_cache_hit_tokens"]),
                                 ("vllm:num_preemptions", "Preemptions by the scheduler.", s["num_preemptions"])):
            c = CounterMetricFamily(name, doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), float(value))
            yield c


class StatLogger:
    """The server's metrics.

    Args:
        core: The engine core (`stats()` is read at scrape time).
        model_name: The `model_name` label.
    """

    def __init__(self, core: Any, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_CoreCollector(core, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def on_tokens(self, num_new: int, since_arrival: float, since_last: float | None, num_prompt: int) -> None:
        """One step's new tokens for a request; `since_last` is None for its first tokens."""
        self.generation_tokens.inc(num_new)
        if since_last is None:
            self.ttft.observe(since_arrival)
            self.prompt_tokens.inc(num_prompt)
        elif num_new:
            self.itl.observe(since_last / num_new)

    def on_finished(self, finish_reasons: list[str | None], since_arrival: float) -> None:
        self.e2e.observe(since_arrival)
        for reason in finish_reasons:
            self.success.labels(self.model_name, reason or "abort").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
