"""triton_python_backend_utils' metrics, as far as serving/metrics.EngineMetrics uses them, recording what each metric
was sent and how often (each call is a round trip to tritonserver in the real python backend)."""
from __future__ import annotations


class FakeMetric:
    def __init__(self, labels: dict[str, str]):
        self.labels, self.value, self.calls = labels, 0.0, 0

    def set(self, v: float) -> None:
        self.value, self.calls = v, self.calls + 1

    def increment(self, v: float) -> None:
        self.value, self.calls = self.value + v, self.calls + 1

    def observe(self, v: float) -> None:
        self.value, self.calls = v, self.calls + 1


class FakePb:
    """The module EngineMetrics is given: `metrics[name]` lists the metrics made in family `name`."""

    def __init__(self):
        self.metrics: dict[str, list[FakeMetric]] = {}
        pb = self

        class MetricFamily:
            GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels, buckets=None):  # noqa: N802 (Triton's spelling)
                m = FakeMetric(labels)
                pb.metrics.setdefault(self.name, []).append(m)
                return m

        self.MetricFamily = MetricFamily
