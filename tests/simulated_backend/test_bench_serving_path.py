"""scripts/bench_serving_path.py's arithmetic on the simulated device's counters: stretch, the modeled token rate, the
cores a host needs at it, inter-response gaps, and which time scale counts as carried."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_serving_path as bench  # noqa: E402


def _result(path="grpc", stretch_gap=0.5, streams=64) -> "bench.PathResult":
    device = {"simulated_modeled_seconds": 2.0, "simulated_busy_gap_seconds": stretch_gap,
              "simulated_busy_modeled_seconds": 10.0, "simulated_overshoot_seconds": 0.0, "simulated_steps": 100.0}
    procs = {"ernie_moe": {"cpu_ms_per_token": 0.05, "busiest_thread_ms_per_token": 0.03},
             "tritonserver": {"cpu_ms_per_token": 0.02, "busiest_thread_ms_per_token": 0.01}}
    return bench.PathResult("wint8", streams, 4.0, path, tokens=20000, seconds=10.0, responses=10000, itl_ms=None,
                            device=device, processes=procs, client=None).finish()


def test_stretch_rate_and_cores_come_from_the_device_counters():
    r = _result()
    assert r.step_stretch == pytest.approx(0.05)  # 0.5 s of host gaps over 10 s of scaled modeled steps
    assert r.modeled_tok_per_s == pytest.approx(10000.0)  # 20,000 tokens over 2 modeled (unscaled) seconds
    assert r.processes["ernie_moe"]["cores_at_modeled_rate"] == pytest.approx(0.5)  # 0.05 ms x 10k tok/s
    assert r.processes["ernie_moe"]["busiest_thread_cores_at_modeled_rate"] == pytest.approx(0.3)
    assert r.serving_cores_at_modeled_rate == pytest.approx(0.7)
    assert r.tok_per_s == pytest.approx(2000.0)
    r.finish(target_tok_per_s=20000.0)  # the offline run's modeled rate: full batches
    assert r.modeled_tok_per_s == pytest.approx(10000.0) and r.serving_cores_at_modeled_rate == pytest.approx(1.4)


def test_a_scale_is_carried_only_when_every_path_keeps_the_stretch_within_the_limit():
    runs = [_result("offline", 0.1), _result("grpc", 0.4), _result("shim", 0.6), _result("grpc", 2.0, streams=256)]
    assert not bench.carried(runs, 64, 0.05)  # the shim's 6%
    assert bench.carried(runs[:2], 64, 0.05)
    assert not bench.carried(runs, 8, 0.05)  # no run at that stream count


def test_inter_response_gaps_are_taken_within_each_stream():
    arrivals = bench.Arrivals(2)
    arrivals.times = [[0.0, 0.010, 0.030], [5.0, 5.001]]
    assert sorted(arrivals.gaps_ms().round(6).tolist()) == [1.0, 10.0, 20.0] and arrivals.responses == 5
    assert bench.itl_figures(arrivals)["p50"] == pytest.approx(10.0)


def test_the_busiest_thread_is_read_from_proc():
    with bench.ThreadWindow({"me": os.getpid()}) as window:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    name, seconds = window.busiest("me")
    assert seconds > 0 and name


def test_an_offline_only_run_writes_its_json_with_the_models_constants(tmp_path, capsys):
    import json

    out = tmp_path / "run.json"
    bench.main(["--paths", "offline", "--streams", "2", "--max-tokens", "4", "--scales", "1",
                "--quantizations", "wint8", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["constants"]["memory_efficiency"] == 0.70 and data["gpu"]["name"] == "h200"
    assert data["model"]["moe_num_experts"] == 64 and data["commit"]
    (run,) = data["runs"]
    assert (run["path"], run["streams"], run["tokens"]) == ("offline", 2, 8) and run["device"]["simulated_steps"] > 0
    assert "wint8/2" in data["carried_scale"] and "offline" in capsys.readouterr().out
