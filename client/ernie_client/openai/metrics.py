"""The shim's own Prometheus metrics (its own registry, so /metrics shows only these)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` timestamp series next to every counter
        r = self.registry = CollectorRegistry()
        p = "ernie_openai:"
        self.requests = Counter(p + "requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "generation requests being served", registry=r)
        self.rejected = Counter(p + "requests_rejected", "requests refused over --max-concurrency: at once (429) "
                                "or after --max-waiting-time for a slot (408)", ["status"], registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests waiting for a slot (--max-waiting-time)", registry=r)
        self.disconnects = Counter(p + "client_disconnects", "streams whose client left before the end; "
                                   "their Triton requests were cancelled", registry=r)
        self.timeouts = Counter(p + "request_timeouts", "requests cancelled at --request-timeout", registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "request latency, first byte in to last byte out",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "time to the first generated text",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens reported by Triton", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens reported by Triton",
                                         registry=r)
        self.cached_tokens = Counter(p + "cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
