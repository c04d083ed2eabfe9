"""ernie_moe's Prometheus metrics (serving/metrics.py): what reaches tritonserver, and how often. Each set or
increment of a python-backend metric is a round trip to tritonserver, so unchanged values are not sent again."""
from __future__ import annotations

from ernie_serve.serving.metrics import EngineMetrics
from fake_metrics import FakePb


def test_a_gauge_is_sent_when_it_moves_and_not_again_while_it_stays():
    pb = FakePb()
    metrics = EngineMetrics(pb, {"model": "ernie_moe"}, min_interval=0)
    stats = {"num_running": 3, "num_waiting": 0, "num_total_blocks": 100, "num_free_blocks": 90}
    metrics.update(stats, force=True)
    running, total = pb.metrics["ernie:num_requests_running"][0], pb.metrics["ernie:kv_cache_total_blocks"][0]
    sent = running.calls
    for _ in range(5):
        metrics.update(stats, force=True)
    assert running.calls == sent and running.value == 3  # five unchanged updates: nothing sent
    metrics.update({**stats, "num_running": 4}, force=True)
    assert running.calls == sent + 1 and running.value == 4
    assert total.calls == 1 and total.value == 100  # the pool's size never moves: sent once
