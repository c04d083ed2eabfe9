"""ernie_moe's Prometheus metrics (serving/metrics.py): what reaches tritonserver, and how often. Each set or
increment of a python-backend metric is a round trip to tritonserver, so unchanged values are not sent again."""
from __future__ import annotations

from ernie_serve.serving.metrics import EngineMetrics


class _CountingMetric:
    def __init__(self):
        self.value, self.calls = 0.0, 0

    def set(self, v):
        self.value, self.calls = v, self.calls + 1

    def increment(self, v):
        self.value, self.calls = self.value + v, self.calls + 1

    def observe(self, v):
        self.calls += 1


class _Pb:
    """triton_python_backend_utils' MetricFamily, as far as EngineMetrics uses it."""

    def __init__(self):
        self.metrics: dict[str, _CountingMetric] = {}
        pb = self

        class MetricFamily:
            GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, buckets=None):  # noqa: N802 (Triton's spelling)
                return pb.metrics.setdefault(f"{self.name}{sorted(labels.items())}", _CountingMetric())

        self.MetricFamily = MetricFamily

    def metric(self, name: str) -> _CountingMetric:
        return next(m for key, m in self.metrics.items() if key.startswith(name + "["))


def test_a_gauge_is_sent_when_it_moves_and_not_again_while_it_stays():
    pb = _Pb()
    metrics = EngineMetrics(pb, {"model": "ernie_moe"}, min_interval=0)
    stats = {"num_running": 3, "num_waiting": 0, "num_total_blocks": 100, "num_free_blocks": 90}
    metrics.update(stats, force=True)
    running, total = pb.metric("ernie:num_requests_running"), pb.metric("ernie:kv_cache_total_blocks")
    sent = running.calls
    for _ in range(5):
        metrics.update(stats, force=True)
    assert running.calls == sent and running.value == 3  # five unchanged updates: nothing sent
    metrics.update({**stats, "num_running": 4}, force=True)
    assert running.calls == sent + 1 and running.value == 4
    assert total.calls == 1 and total.value == 100  # the pool's size never moves: sent once
