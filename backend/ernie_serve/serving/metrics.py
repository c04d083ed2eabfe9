"""ernie:* metrics on Triton's metrics port (pb_utils.MetricFamily), named as vLLM / FastDeploy do.

The engine reports cumulative totals in stats(); counters move by the difference since the last
update. Updates are throttled on the engine thread (each metric call is a message to the server),
and flushed whenever the engine goes idle, so a scrape after a request always sees it counted.
"""
from __future__ import annotations

import threading
import time
from typing import Any

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]

# name, kind, description, stats key (gauges and counters fed from engine.stats())
STAT_METRICS = [
    ("ernie:num_requests_running", "GAUGE", "Requests in the running batch", "num_running"),
    ("ernie:num_requests_waiting", "GAUGE", "Requests waiting to be scheduled", "num_waiting"),
    ("ernie:kv_cache_usage_perc", "GAUGE", "Fraction of KV cache blocks in use (0-1)", "kv_cache_usage"),
    ("ernie:kv_cache_free_blocks", "GAUGE", "KV cache blocks free (cached-but-unreferenced included)",
     "num_free_blocks"),
    ("ernie:kv_cache_total_blocks", "GAUGE", "KV cache blocks in the pool", "num_total_blocks"),
    ("ernie:prefix_cache_hit_rate", "GAUGE", "Prefix cache hit rate over queried tokens (0-1)",
     "prefix_cache_hit_rate"),
    ("ernie:num_preemptions_total", "COUNTER", "Preemptions since start", "num_preemptions"),
    ("ernie:prompt_tokens_total", "COUNTER", "Prompt tokens accepted", "prompt_tokens"),
    ("ernie:generation_tokens_total", "COUNTER", "Tokens generated", "generation_tokens"),
    ("ernie:prefix_cache_hit_tokens_total", "COUNTER", "Prompt tokens served from the prefix cache",
     "prefix_cache_hit_tokens"),
    ("ernie:spec_decode_num_drafts_total", "COUNTER", "Verification steps that carried draft tokens", "spec_drafts"),
    ("ernie:spec_decode_num_draft_tokens_total", "COUNTER", "Draft tokens proposed (MTP / ngram)",
     "spec_draft_tokens"),
    ("ernie:spec_decode_num_accepted_tokens_total", "COUNTER", "Draft tokens accepted by the target model",
     "spec_accepted_tokens"),
    ("ernie:spec_decode_draft_acceptance_rate", "GAUGE", "Accepted / proposed draft tokens since start (0-1)",
     "spec_acceptance_rate"),
    ("ernie:stream_responses_held_total", "COUNTER", "Stream responses held until the detokenizer caught up "
     "(their tokens went out with the stream's next response)", "stream_responses_held"),
]
HISTOGRAMS = [
    ("ernie:time_to_first_token_seconds", "Time from arrival to the first generated token", LATENCY_BUCKETS),
    ("ernie:time_per_output_token_seconds", "Mean time per output token after the first", LATENCY_BUCKETS),
    ("ernie:e2e_request_latency_seconds", "Time from arrival to the final token", E2E_BUCKETS),
]
FINISH_REASONS = ("stop", "length", "abort", "error")
# A simulated device (execution_backend='simulated') says so: ernie:simulated_device{target=...} 1, and its step
# figures (engine stats 'simulated_*'), so no scrape mistakes its throughput for a model's.
SIMULATION_METRICS = [
    ("ernie:simulated_steps_total", "COUNTER", "Steps the simulated device ran", "simulated_steps"),
    ("ernie:simulated_modeled_seconds_total", "COUNTER", "Modeled step time of the simulated target, before the "
     "time scale", "simulated_modeled_seconds"),
    ("ernie:simulated_busy_gap_seconds_total", "COUNTER", "Host time from a step's end to the next step's start "
     "while requests kept running: simulated device idle time", "simulated_busy_gap_seconds"),
    ("ernie:simulated_busy_modeled_seconds_total", "COUNTER", "Scaled modeled time of the steps before those gaps",
     "simulated_busy_modeled_seconds"),
    ("ernie:simulated_overshoot_seconds_total", "COUNTER", "Step wall time beyond the scaled modeled time (sleeps "
     "waking late): left out of the stretch", "simulated_overshoot_seconds"),
    ("ernie:simulated_step_stretch", "GAUGE", "Busy gap time over modeled step time since start: the device idle "
     "time the host causes", "simulated_step_stretch"),
    ("ernie:simulated_time_scale", "GAUGE", "The simulated device runs this many times slower than the modeled "
     "target", "simulated_time_scale"),
]


class EngineMetrics:
    """Owns the metric objects of one engine instance; `pb` is triton_python_backend_utils."""

    def __init__(self, pb: Any, labels: dict[str, str], min_interval: float = 0.05):
        self.labels = dict(labels)
        self.min_interval = min_interval
        self._lock = threading.Lock()
        kinds = {"GAUGE": pb.MetricFamily.GAUGE, "COUNTER": pb.MetricFamily.COUNTER,
                 "HISTOGRAM": pb.MetricFamily.HISTOGRAM}
        # Families must outlive their metrics; keep references to both.
        self._families = []
        self._stat = {}
        for name, kind, desc, key in STAT_METRICS:
            fam = pb.MetricFamily(name=name, description=desc, kind=kinds[kind])
            self._families.append(fam)
            self._stat[key] = (kind, fam.Metric(labels=self.labels))
        self._hist = {}
        for name, desc, buckets in HISTOGRAMS:
            fam = pb.MetricFamily(name=name, description=desc, kind=kinds["HISTOGRAM"])
            self._families.append(fam)
            self._hist[name] = fam.Metric(labels=self.labels, buckets=buckets)
        fam = pb.MetricFamily(name="ernie:request_success_total", description="Finished requests by reason",
                              kind=kinds["COUNTER"])
        self._families.append(fam)
        self._finished = {r: fam.Metric(labels={**self.labels, "finished_reason": r}) for r in FINISH_REASONS}
        fam = pb.MetricFamily(name="ernie:engine_healthy", description="1 while the engine step loop runs",
                              kind=kinds["GAUGE"])
        self._families.append(fam)
        self._healthy = fam.Metric(labels=self.labels)
        self._healthy.set(1)
        self._pb, self._kinds = pb, kinds
        self._simulated: dict | None = None  # the simulation's metrics, made at the first simulated stats
        self._last_totals: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}
        self._last_update = 0.0
        self._was_idle = True

    def update(self, stats: dict, force: bool = False) -> None:
        """Called after each engine step (and after aborts) with engine.stats()."""
        now = time.monotonic()
        idle = not stats.get("num_running") and not stats.get("num_waiting")
        with self._lock:
            # The throttle never hides a transition between idle and busy: a scrape right after a
            # request starts (or ends) must see it, however soon after the previous update it came.
            changed = idle != self._was_idle
            if not (force or idle or changed or now - self._last_update >= self.min_interval):
                return
            self._last_update = now
            self._was_idle = idle
            if self._simulated is None and "simulated_target" in stats:
                self._simulated = self._simulation_metrics(str(stats["simulated_target"]))
            for key, (kind, metric) in (self._stat | (self._simulated or {})).items():
                value = float(stats.get(key) or 0)
                if kind == "GAUGE":
                    # each set is a round trip to tritonserver: most gauges (the pool's size, most of a step's
                    # counts) do not move from one update to the next
                    if self._last_gauges.get(key) != value:
                        metric.set(value)
                        self._last_gauges[key] = value
                else:
                    delta = value - self._last_totals.get(key, 0.0)
                    if delta > 0:
                        metric.increment(delta)
                    self._last_totals[key] = value

    def _simulation_metrics(self, target: str) -> dict:
        """ernie:simulated_device{target} = 1 and SIMULATION_METRICS, as stats key -> (kind, metric)."""
        fam = self._pb.MetricFamily(name="ernie:simulated_device", description="1: the engine runs on a SIMULATED "
                                    "device (a benchmark instrument; outputs are replayed text)",
                                    kind=self._kinds["GAUGE"])
        self._families.append(fam)
        self._simulated_device = fam.Metric(labels={**self.labels, "target": target})
        self._simulated_device.set(1)
        out = {}
        for name, kind, desc, key in SIMULATION_METRICS:
            fam = self._pb.MetricFamily(name=name, description=desc, kind=self._kinds[kind])
            self._families.append(fam)
            out[key] = (kind, fam.Metric(labels=self.labels))
        return out

    def request_finished(self, finish_reason: str | None, num_output_tokens: int, metrics: Any) -> None:
        """Latency histograms and the finish counter for one finished request (RequestMetrics)."""
        reason = finish_reason if finish_reason in self._finished else "abort"
        self._finished[reason].increment(1)
        if metrics is None or metrics.finished_time is None:
            return
        if metrics.first_token_time is not None:
            self._hist["ernie:time_to_first_token_seconds"].observe(metrics.first_token_time - metrics.arrival_time)
            if num_output_tokens > 1:
                self._hist["ernie:time_per_output_token_seconds"].observe(
                    (metrics.finished_time - metrics.first_token_time) / (num_output_tokens - 1))
        self._hist["ernie:e2e_request_latency_seconds"].observe(metrics.finished_time - metrics.arrival_time)

    def set_healthy(self, healthy: bool) -> None:
        self._healthy.set(1 if healthy else 0)
