"""The shim's own Prometheus metrics (its own registry, so /metrics shows only these).

With `--workers N > 1` every worker process writes its values to files in PROMETHEUS_MULTIPROC_DIR (prometheus_client's
multiprocess mode, a private directory the supervisor makes) and /metrics, whichever worker answers it, shows the
whole shim: counters and histograms summed over the workers, the in-flight and waiting gauges summed over the live
ones, and `ernie_openai:worker_requests_admitted{pid}` per worker (how the kernel spread the connections)."""
from __future__ import annotations

import glob
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_PREFIX = "ernie_openai:"


class Metrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: the PROMETHEUS_MULTIPROC_DIR shared by the shim's workers (this process must have
        been started with it in its environment); None: one process, its own registry."""
        disable_created_metrics()  # no `*_created` timestamp series next to every counter
        r = self.registry = CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
        p = _PREFIX
        self.requests = Counter(p + "requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "generation requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.rejected = Counter(p + "requests_rejected", "requests refused over --max-concurrency: at once (429) "
                                "or after --max-waiting-time for a slot (408)", ["status"], registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests waiting for a slot (--max-waiting-time)", registry=r,
                             multiprocess_mode="livesum")
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
        self.worker_admitted: Gauge | None = None
        self._exposed = r
        if multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self.worker_admitted = Gauge(p + "worker_requests_admitted", "generation requests each worker "
                                         "admitted (a series per live worker pid; --workers > 1)", registry=r,
                                         multiprocess_mode="liveall")
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=multiprocess_dir)

    def admitted(self) -> None:
        """A generation request got a slot in this worker (counted per worker with --workers > 1)."""
        if self.worker_admitted is not None:
            self.worker_admitted.inc()

    def shim_totals(self) -> tuple[int, int] | None:
        """(requests in flight, requests waiting for a slot) over all the shim's live workers, read from the
        multiprocess files; None in a single process, where the caller's own counts are the shim's."""
        if self.multiprocess_dir is None:
            return None
        from prometheus_client.multiprocess import MultiProcessCollector

        files = glob.glob(os.path.join(self.multiprocess_dir, "gauge_livesum_*.db"))
        totals = {_PREFIX + "requests_in_flight": 0.0, _PREFIX + "requests_waiting": 0.0}
        for metric in MultiProcessCollector.merge(files, accumulate=True):
            for sample in metric.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return int(totals[_PREFIX + "requests_in_flight"]), int(totals[_PREFIX + "requests_waiting"])

    def render(self) -> bytes:
        return generate_latest(self._exposed)
