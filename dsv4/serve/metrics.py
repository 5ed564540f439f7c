"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own.

Latency histograms are observed when a request finishes, from the engine's own timestamps (`RequestMetrics`);
gauges are set by the engine thread after every step; counters only go up. Throughput is a counter's rate:
`rate(dsv4_prefill_tokens_total[1m])` is prefill tokens per second, `rate(dsv4_generation_tokens_total[1m])` decode.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 320)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    2.5,
    5,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 3600)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "dsv4_time_to_first_token_seconds", "Arrival to first generated token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "dsv4_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "dsv4_e2e_request_latency_seconds", "Arrival to the request's end", buckets=E2E_BUCKETS, registry=r
        )
        self.running = Gauge("dsv4_num_requests_running", "Requests holding a slot and KV pages", registry=r)
        self.waiting = Gauge("dsv4_num_requests_waiting", "Requests queued (new or preempted)", registry=r)
        self.kv_pages_used = Gauge("dsv4_kv_pages_used", "KV cache pages in use", registry=r)
        self.kv_pages_free = Gauge("dsv4_kv_pages_free", "KV cache pages free", registry=r)
        self.kv_pages_total = Gauge("dsv4_kv_pages_total", "Usable KV cache pages", registry=r)
        self.prefill_tokens = Counter(
            "dsv4_prefill_tokens", "Prompt tokens prefilled (recomputation included)", registry=r
        )
        self.generation_tokens = Counter("dsv4_generation_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("dsv4_num_preemptions", "Preemptions of finished requests", registry=r)
        self.steps = Counter("dsv4_engine_steps", "Engine steps run", registry=r)
        self.requests = Counter("dsv4_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter(
            "dsv4_requests_rejected", "Requests refused with an error status", ["status"], registry=r
        )

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the text exposition format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
