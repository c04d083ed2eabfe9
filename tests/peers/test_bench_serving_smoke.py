"""scripts/bench_serving.py without servers: its trace, aiperf's export as the script reads it (recorded
exports in data/), the offline metrics under aiperf's definitions, and the table.

The live part (both servers and the offline engine on two small load points, a few minutes) runs only
with ERNIE_PEER_TESTS=1 and .peers/vllm + .peers/aiperf present (scripts/setup_peers.sh vllm aiperf).
"""
from __future__ import annotations

import io
import json
import os
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_serving  # noqa: E402  (puts scripts/peers on sys.path)
import serving_trace  # noqa: E402
from aiperf_run import Arrivals, LoadPoint, PointMetrics, aiperf_command, percentile, read_export  # noqa: E402

C2 = LoadPoint("c2", 4, concurrency=2)


@pytest.fixture(scope="module")
def tokenizer():
    from ernie_serve.demo.tiny_model import ensure_tiny_model
    from ernie_serve.tokenizer.tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(ensure_tiny_model())


def _export_dir(tmp_path: Path, name: str) -> Path:
    (tmp_path / "profile_export_aiperf.json").write_text((DATA / name).read_text())
    return tmp_path


def test_aiperf_export_is_read_into_the_reported_metrics(tmp_path):
    # recorded: our shim, bench checkpoint, 4 requests of 128 + 32 tokens at concurrency 2
    m = read_export(_export_dir(tmp_path, "aiperf_profile_export.json"))
    assert (m.requests, m.errors, m.prompt_tokens, m.output_tokens) == (4, 0, (128, 128), (32, 32))
    assert (m.ttft_p50_ms, m.itl_p50_ms, m.output_tok_s, m.duration_s) == (1037.98, 105.62, 15.27, 8.376)
    assert (m.ttft_avg_ms, m.itl_avg_ms) == (949.57, 103.49)
    assert m.ttft_p99_ms >= m.ttft_p50_ms and m.itl_p99_ms >= m.itl_p50_ms
    assert m.problems(C2, prompt_len=128, output_len=32) == []


def test_requests_without_text_are_reported_as_problems(tmp_path):
    # recorded: vllm serve without allowed_token_ids streams ids beyond the 4096-piece tokenizer as empty
    # text, so aiperf fails the requests that never carried any (2 of 4); prompts of 16..265 tokens, 8 out
    m = read_export(_export_dir(tmp_path, "aiperf_profile_export_vllm_unmasked.json"))
    assert (m.requests, m.errors) == (2, 2)
    problems = m.problems(C2, prompt_len=128, output_len=8)
    assert problems[:2] == ["2 requests failed", "2 of 4 requests completed"]
    assert "the server tokenized the text differently" in problems[2]


def test_percentiles_interpolate_linearly_as_aiperf_does():
    # the same export's TTFT: min 1526.343175, max 1779.328746 over two requests, p99 1776.79889029
    assert percentile([1779.328746, 1526.343175], 99) == pytest.approx(1776.79889029)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


def test_offline_metrics_follow_aiperf_definitions():
    # two requests: TTFT 0.1 / 0.3 s, latency 1.0 / 2.1 s, 10 output tokens each, over 3 s
    m = PointMetrics.from_samples([0.1, 0.3], [1.0, 2.1], [128, 128], [10, 10], duration_s=3.0)
    assert m.itl_p50_ms == pytest.approx(((0.9 / 9) + (1.8 / 9)) / 2 * 1000, abs=0.01) == m.itl_avg_ms
    assert (m.ttft_p50_ms, m.output_tok_s, m.requests, m.output_tokens) == (200.0, pytest.approx(6.67), 2, (10, 10))


def test_load_point_needs_exactly_one_of_rate_and_concurrency():
    with pytest.raises(ValueError, match="exactly one of concurrency and request_rate"):
        LoadPoint("x", 4)
    with pytest.raises(ValueError, match="exactly one of concurrency and request_rate"):
        LoadPoint("x", 4, concurrency=2, request_rate=1.0)


def test_open_loop_arrivals_are_evenly_spaced_whatever_finishes():
    arrivals = Arrivals(LoadPoint("r", 4, request_rate=2.0))
    assert arrivals.due(0.0) == [0.0] and arrivals.due(0.9) == [0.5] and arrivals.next_send() == 1.0
    arrivals.finished(1.2)
    assert arrivals.due(5.0) == [1.0, 1.5] and arrivals.next_send() is None


def test_closed_loop_arrivals_refill_a_freed_slot_at_the_next_tick_one_per_tick():
    arrivals = Arrivals(LoadPoint("c", 5, concurrency=2))  # ticks 20 ms apart
    assert arrivals.due(1.0) == [0.0, 0.02]  # both slots at once, one per tick; then none free
    assert arrivals.next_send() is None and arrivals.due(5.0) == []
    arrivals.finished(0.333)
    arrivals.finished(0.333)
    assert arrivals.next_send() == pytest.approx(0.34)
    assert arrivals.due(0.35) == [pytest.approx(0.34)] and arrivals.due(1.0) == [pytest.approx(0.36)]
    arrivals.finished(2.0)
    assert arrivals.due(3.0) == [pytest.approx(2.0)] and arrivals.next_send() is None


def test_aiperf_command_sends_the_trace_in_order_with_server_token_counts(tmp_path):
    rate = aiperf_command(Path("aiperf"), "http://127.0.0.1:1", "ernie", tmp_path, tmp_path / "in.jsonl",
                          LoadPoint("r", 16, request_rate=1.0), {"ignore_eos": True}, tmp_path / "a", 600)
    conc = aiperf_command(Path("aiperf"), "http://127.0.0.1:1", "ernie", tmp_path, tmp_path / "in.jsonl",
                          C2, {"ignore_eos": True}, tmp_path / "a", 600)
    for cmd in (rate, conc):
        assert cmd[cmd.index("--dataset-sampling-strategy") + 1] == "sequential"
        assert "--use-server-token-count" in cmd and "--streaming" in cmd and "--no-server-metrics" in cmd
        assert json.loads(cmd[cmd.index("--extra-inputs") + 1]) == {"ignore_eos": True}
    assert rate[rate.index("--request-rate") + 1] == "1" and "--concurrency" not in rate
    # concurrency with a 50/s tick: aiperf's plain concurrency mode spins a core's half away
    assert conc[conc.index("--concurrency") + 1] == "2" and conc[conc.index("--request-rate") + 1] == "50"
    for cmd in (rate, conc):
        assert cmd[cmd.index("--arrival-pattern") + 1] == "constant"


def test_only_vllm_is_sent_the_tokenizer_mask():
    ours, vllm = bench_serving.extra_inputs("ours", 4096), bench_serving.extra_inputs("vllm", 4096)
    assert ours == {"ignore_eos": True, "temperature": 0}
    assert vllm["allowed_token_ids"] == list(range(4096)) and {k: vllm[k] for k in ours} == ours


def test_trace_prompts_are_exactly_prompt_len_tokens_and_survive_a_round_trip(tokenizer, tmp_path):
    trace = serving_trace.make_trace(tokenizer, 6, 48, 8, 16, seed=0)
    assert trace == serving_trace.make_trace(tokenizer, 6, 48, 8, 16, seed=0)
    assert trace["tokenizer_size"] == len(tokenizer)
    for r in trace["requests"]:
        assert len(r["prompt_token_ids"]) == 48 and tokenizer.encode(r["text"]) == r["prompt_token_ids"]
        assert not set(r["prompt_token_ids"]) & tokenizer.all_special_ids and r["max_tokens"] == 8
    lines = serving_trace.write_aiperf_input(trace, tmp_path / "in.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"text": r["text"], "output_length": 8} for r in trace["requests"]]


def test_a_peer_tokenizer_that_differs_is_named_by_request(tokenizer):
    trace = serving_trace.make_trace(tokenizer, 3, 16, 4, 16, seed=0)
    encoded = [r["prompt_token_ids"] for r in trace["requests"]]
    encoded[1] = encoded[1][:-1]
    assert serving_trace.tokenizer_disagreements(trace, encoded) == [1]


def test_word_ids_decode_to_visible_text(tokenizer):
    ids = serving_trace.word_ids(tokenizer)
    sample = random.Random(0).sample(ids, 50)
    assert all(tokenizer.decode([i]).strip() and "\ufffd" not in tokenizer.decode([i]) for i in sample)
    assert not set(ids) & tokenizer.all_special_ids


def _point_result(metrics: PointMetrics, share: float, load: float) -> dict:
    return {"metrics": metrics.to_json(), "cpu_ms_per_token": 40.0, "server_cpu_share": share,
            "load_after": [load, 0.0, 0.0], "problems": []}


def test_table_has_a_row_per_system_and_point_and_the_ratio_rows(tmp_path):
    ours = read_export(_export_dir(tmp_path, "aiperf_profile_export.json"))
    slower = PointMetrics(**{**ours.to_json(), "ttft_p50_ms": ours.ttft_p50_ms * 2, "output_tok_s": ours.output_tok_s / 2})
    systems = {"ours": {"points": {"c2": _point_result(ours, 0.9, 3.0)}},
               "vllm": {"points": {"c2": _point_result(slower, 0.8, 3.5)}},
               "offline": {"points": {"c2": _point_result(ours, 0.5, 3.1)}}}
    lines = bench_serving.format_table(systems, [C2, LoadPoint("c9", 9, concurrency=9)]).splitlines()
    assert lines[0].split()[:4] == ["load", "point", "system", "TTFT"]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] if r[0] in ("ours", "vllm", "offline", "ours/vllm", "ours/offline") else r[3] for r in rows] == \
        ["ours", "vllm", "offline", "ours/vllm", "ours/offline"]
    ratio_vllm, ratio_offline = rows[3], rows[4]
    assert ratio_vllm[1] == "0.50x" and ratio_vllm[5] == "2.00x"  # TTFT p50 half of vllm's, twice its tok/s
    assert ratio_offline[1:6] == ["1.00x"] * 5


@pytest.mark.skipif(os.environ.get("ERNIE_PEER_TESTS") != "1",
                    reason="set ERNIE_PEER_TESTS=1 (needs scripts/setup_peers.sh vllm aiperf)")
def test_both_servers_and_the_offline_engine_do_the_trace_work_on_small_points(tmp_path):
    for path in (bench_serving.AIPERF, bench_serving.VLLM_PYTHON):
        if not path.exists():
            pytest.skip(f"{path} missing: run scripts/setup_peers.sh vllm aiperf")
    from bench_offline import bench_checkpoint

    points = [LoadPoint("c2", 4, concurrency=2), LoadPoint("rate2", 4, request_rate=2.0)]
    model = bench_checkpoint()
    trace, warmup = bench_serving.build_traces(model, tmp_path, 4, 64, 8, 16)
    assert bench_serving.check_peer_tokenizer(model, trace)["requests_with_other_ids"] == []
    systems = {s: bench_serving.run_served(s, model, tmp_path / s, trace, warmup, points, 16, 2) for s in ("ours", "vllm")}
    bench_serving.run_offline(model, trace, warmup, tmp_path / "offline.json", points, 16, 2)
    systems["offline"] = json.loads((tmp_path / "offline.json").read_text())
    for name, result in systems.items():
        for point in points:
            r = result["points"][point.name]
            assert r["problems"] == [], (name, point.name, r["problems"])
            assert PointMetrics.from_json(r["metrics"]).prompt_tokens == (64, 64)
    assert len(bench_serving.format_table(systems, points).splitlines()) == 2 + 2 * 5


def test_engine_histogram_means_are_taken_between_two_scrapes(monkeypatch):
    scrapes = iter([
        'ernie:time_to_first_token_seconds_sum{model="ernie_moe",version="1"} 1.5\n'
        'ernie:time_to_first_token_seconds_count{model="ernie_moe",version="1"} 3\n'
        'ernie:time_per_output_token_seconds_sum{model="ernie_moe",version="1"} 0.3\n'
        'ernie:time_per_output_token_seconds_count{model="ernie_moe",version="1"} 3\n',
        'ernie:time_to_first_token_seconds_sum{model="ernie_moe",version="1"} 2.5\n'
        'ernie:time_to_first_token_seconds_count{model="ernie_moe",version="1"} 5\n'
        'ernie:time_per_output_token_seconds_sum{model="ernie_moe",version="1"} 0.3\n'
        'ernie:time_per_output_token_seconds_count{model="ernie_moe",version="1"} 3\n'])

    monkeypatch.setattr(bench_serving.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(next(scrapes).encode()))
    before, after = bench_serving.engine_histograms("m"), bench_serving.engine_histograms("m")
    # two requests in between, 1.0 s of TTFT between them; no per-token observation in between
    assert bench_serving.engine_means(before, after) == {"engine_ttft_avg_ms": 500.0, "engine_itl_avg_ms": None}


def test_overhead_table_puts_the_three_views_of_our_averages_side_by_side(tmp_path):
    ours = read_export(_export_dir(tmp_path, "aiperf_profile_export.json"))
    served = {**_point_result(ours, 0.9, 3.0), "engine_ttft_avg_ms": 400.0, "engine_itl_avg_ms": 90.0}
    systems = {"ours": {"points": {"c2": served}}, "offline": {"points": {"c2": _point_result(ours, 0.5, 3.1)}}}
    row = bench_serving.format_overhead(systems, [C2]).splitlines()[2].split()
    assert row[3:] == ["949.6", "400.0", "949.6", "103.5", "90.0", "103.5"]


def test_the_table_takes_each_points_least_disturbed_round():
    def point(share):
        return {"metrics": {}, "server_cpu_share": share}

    rounds = [{"points": {"c2": point(0.4), "c9": point(0.9)}}, {"points": {"c2": point(0.8), "c9": point(0.5)}}]
    picked = bench_serving.least_disturbed(rounds, [C2, LoadPoint("c9", 9, concurrency=9)])
    assert (picked["points"]["c2"]["round"], picked["points"]["c9"]["round"]) == (1, 0)
    assert picked["rounds"] == rounds
