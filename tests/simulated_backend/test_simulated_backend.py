"""The simulated execution backend is a benchmark instrument, not a model: these tests pin its step model's arithmetic
against figures worked out by hand, its replay's determinism, its refusals, and that it always says it is a
simulation. No correctness test of the engine or the serving path relies on it."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.executor_factory import check_supported, resolve_backend
from ernie_serve.engine.llm_engine import LLMEngine
from ernie_serve.sampling_params import SamplingParams
from ernie_serve.simulated_backend.logits import ReplayLogits
from ernie_serve.simulated_backend.step_model import StepModel, experts_hit, kv_pool_blocks, total_weight_bytes
from ernie_serve.simulated_backend.targets import GPUS, MODELS, Target
from ernie_serve.step_contract import LogitEdits
from fake_metrics import FakePb

H200_21B = dict(execution_backend="simulated", simulated_gpu="h200", simulated_model="ernie-4.5-21b-a3b")

# ERNIE-4.5-21B-A3B by hand (config: H 2560, 28 layers, 20/4 heads of 128, dense FFN 12288 in layer 0, 27 MoE layers
# of 64 experts of 1536, top-6, 2 shared experts, vocabulary 103424, tied embeddings):
ATTENTION = 28 * (2 * 2560 * 2560 + 2 * 2560 * 512)  # 440,401,920
DENSE_FFN = 3 * 2560 * 12288  # 94,371,840
SHARED = 27 * 2 * 3 * 2560 * 1536  # 637,009,920
ROUTER_BYTES = 27 * 2560 * 64 * 4  # 17,694,720 (fp32)
LM_HEAD_BYTES = 103424 * 2560 * 2  # 529,530,880 (bf16)
EXPERT = 3 * 2560 * 1536  # 11,796,480
KV_TOKEN = 2 * 28 * 4 * 128 * 2  # 57,344


def h200_21b(quantization=None, tp=1) -> Target:
    return Target(GPUS["h200"], MODELS["ernie-4.5-21b-a3b"], quantization, tp)


def test_decode_step_is_weights_touched_plus_kv_read_over_bandwidth_plus_the_fixed_cost():
    """wint8, 64 sequences at 2,048 tokens of context: every expert of a layer is almost surely hit."""
    hit = 64 * (1 - (58 / 64) ** 64)
    weights = ATTENTION + DENSE_FFN + SHARED + ROUTER_BYTES + LM_HEAD_BYTES + 27 * hit * EXPERT  # 1 byte a weight
    kv = (64 * 2048 + 64) * KV_TOKEN  # read every context token, write the new ones
    expected = (weights + kv) / (4.8e12 * 0.70) + 300e-6
    cost = StepModel(h200_21b("wint8")).cost(64, 64, np.full(64, 2048))
    assert cost.experts_hit == pytest.approx(hit) and hit == pytest.approx(63.88, abs=0.01)
    assert cost.weight_bytes == pytest.approx(weights) and cost.kv_bytes == pytest.approx(kv)
    assert cost.seconds == pytest.approx(expected)
    assert cost.seconds == pytest.approx(9.0e-3, rel=0.02)  # the roofline DESIGN.md quotes: ~10 ms


def test_the_step_model_gives_design_md_roofline_figures_for_bf16():
    """DESIGN.md: ~15 ms a step at batch 64 and ~21 ms at 256 (2k context) in bf16; wint8 ~16 ms at 256."""
    bf16, wint8 = StepModel(h200_21b()), StepModel(h200_21b("wint8"))
    assert bf16.cost(64, 64, np.full(64, 2048)).seconds == pytest.approx(15.5e-3, rel=0.03)
    assert bf16.cost(256, 256, np.full(256, 2048)).seconds == pytest.approx(22.2e-3, rel=0.03)
    assert wint8.cost(256, 256, np.full(256, 2048)).seconds == pytest.approx(15.8e-3, rel=0.03)


def test_few_tokens_hit_few_experts_and_one_token_hits_top_k():
    assert experts_hit(64, 6, 1) == pytest.approx(6.0)
    assert experts_hit(64, 6, 4) == pytest.approx(64 * (1 - (58 / 64) ** 4))
    one = StepModel(h200_21b()).cost(1, 1, np.array([100]))
    assert one.weight_bytes == pytest.approx(2 * (ATTENTION + DENSE_FFN + SHARED) + ROUTER_BYTES + LM_HEAD_BYTES
                                             + 27 * 6 * 2 * EXPERT)


def test_a_prefill_is_compute_bound_at_two_flops_a_weight_a_token():
    active = ATTENTION + DENSE_FFN + 27 * (6 * EXPERT + 2 * EXPERT + 2560 * 64) + 103424 * 2560
    assert active == 3_352_002_560  # "A3B"
    cost = StepModel(h200_21b()).cost(2048, 1, np.array([2048]))
    flops = 2 * (active - 103424 * 2560) * 2048 + 2 * 103424 * 2560 * 1
    assert cost.compute_seconds == pytest.approx(flops / (989e12 * 0.60))
    assert cost.compute_seconds > cost.memory_seconds
    assert cost.seconds == pytest.approx(cost.compute_seconds + 300e-6)


def test_weights_and_kv_pool_are_sized_like_the_target_gpu():
    linear = ATTENTION + DENSE_FFN + 27 * (64 * EXPERT + 2 * EXPERT)
    assert total_weight_bytes(h200_21b()) == pytest.approx(2 * linear + ROUTER_BYTES + LM_HEAD_BYTES)
    assert total_weight_bytes(h200_21b()) == pytest.approx(43.6e9, rel=0.01)
    wint8 = linear + ROUTER_BYTES + LM_HEAD_BYTES  # 22,103,326,720
    activations = 2 * 2**30 + 8192 * 2560 * 2 * 16 + 64 * 103424 * 4
    blocks = int((0.9 * 141e9 - wint8 - activations) // (64 * KV_TOKEN))
    assert blocks == 27779
    assert kv_pool_blocks(h200_21b("wint8"), 0.9, 64, 64, 8192) == blocks
    m300 = MODELS["ernie-4.5-300b-a47b"]
    assert m300.active_params == pytest.approx(47e9, rel=0.01)
    assert total_weight_bytes(Target(GPUS["h200"], m300, None)) / 2 == pytest.approx(300e9, rel=0.01)
    halves = total_weight_bytes(h200_21b(tp=2))
    assert halves == pytest.approx(total_weight_bytes(h200_21b()) / 2)


def _engine(model_dir, **kw) -> LLMEngine:
    opts = dict(model=str(model_dir), max_model_len=1024, block_size=16, max_num_seqs=16,
                disable_progress_bar=True, simulated_time_scale=0.01, **H200_21B)
    opts.update(kw)
    return LLMEngine(EngineConfig(**opts))


def _generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return done


def test_replayed_streams_survive_preemption_and_end_with_eos(tiny_model_dir):
    """A row's ids depend on its request and position only: a pool too small for every request preempts and
    recomputes some, and each request's output is the one it gets with room to spare; each ends at its
    document's EOS ('stop') and holds the thinking shape."""
    prompts = [[5 + i, 40 + i, 77, 300 + 3 * i, 9, 1000 + i, 12] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=900)
    roomy = _generate(_engine(tiny_model_dir), prompts, params)
    tight_engine = _engine(tiny_model_dir, num_gpu_blocks_override=80)
    tight = _generate(tight_engine, prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert {k: v.token_ids for k, v in tight.items()} == {k: v.token_ids for k, v in roomy.items()}
    assert {o.finish_reason for o in roomy.values()} == {"stop"}
    assert len({len(o.token_ids) for o in roomy.values()}) > 1  # several documents replayed
    assert all("</think>" in o.text for o in roomy.values())


def test_sampling_requests_take_the_replay_and_their_generators_still_run(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompts = [[11, 12, 13, 14]]
    greedy = _generate(engine, prompts, SamplingParams(temperature=0, max_tokens=40))
    sampled = _generate(engine, prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=3,
                                                        logprobs=2))
    assert sampled["r0"].token_ids == greedy["r0"].token_ids
    # a certain replay: logprob 0, rank 1 for each replayed id
    assert all(lp[tok].logprob == 0.0 and lp[tok].rank == 1
               for lp, tok in zip(sampled["r0"].logprobs, sampled["r0"].token_ids))


def test_a_masked_replay_id_gives_way_to_the_lowest_allowed_one():
    logits = ReplayLogits(np.array([7, 2, 5]), vocab_size=10)
    logits.edit(LogitEdits(rows=np.array([1, 1]), tokens=np.array([2, 0]), bias=np.zeros(2, np.float32),
                           repetition=np.ones(2, np.float32), subtract=np.zeros(2, np.float32),
                           masked=np.array([True, True])))  # min_tokens holding EOS (2) back, and id 0
    bias = np.full((1, 10), -np.inf, np.float32)
    bias[0, 4] = 0.0  # a grammar allowing only id 4
    logits.add_rows(np.array([2]), bias)
    ids, row_max = logits.argmax()
    assert ids.tolist() == [7, 1, 4] and np.isfinite(row_max).all()


def test_without_a_tokenizer_a_fixed_id_pattern_ends_in_eos(tiny_model_dir):
    engine = _engine(tiny_model_dir, skip_tokenizer_init=True)
    out = _generate(engine, [[20, 21, 22]], SamplingParams(temperature=0, max_tokens=400))["r0"]
    assert out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids
    assert len(out.token_ids) == 256 and min(out.token_ids[:-1]) >= 2048  # the tiny vocabulary's upper half


def test_steps_sleep_for_the_scaled_modeled_time_and_count_the_host_gaps(tiny_model_dir):
    engine = _engine(tiny_model_dir, simulated_time_scale=0.5)
    _generate(engine, [[30, 31, 32]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s = engine.stats()
    assert s["simulated_steps"] == 20 and s["simulated_time_scale"] == 0.5
    assert s["simulated_slept_seconds"] == pytest.approx(0.5 * s["simulated_modeled_seconds"])
    assert s["simulated_execute_seconds"] >= s["simulated_slept_seconds"]
    assert s["simulated_busy_gaps"] == 19  # every decode step continues the one before
    assert s["simulated_step_stretch"] == pytest.approx(s["simulated_busy_gap_seconds"]
                                                        / s["simulated_busy_modeled_seconds"])
    assert "h200" in s["simulated_target"]


@pytest.mark.parametrize("fields,message", [
    (dict(simulated_gpu="b200"), "simulated_gpu='b200' is not supported: the simulated backend knows h200, h100, "
                                 "h800, a800"),
    (dict(simulated_model="llama"), "simulated_model='llama' is not supported: the simulated backend knows "
                                    "ernie-4.5-21b-a3b, ernie-4.5-300b-a47b"),
    (dict(simulated_model="ernie-4.5-300b-a47b"), "does not fit simulated_gpu='h200': 599.0 GB of weights"),
    (dict(speculative_config={"method": "ngram"}), "drafts nothing"),
    (dict(splitwise_role="prefill", engine_worker_queue_port=9000), "splitwise_role='prefill' is not supported"),
    (dict(kv_cache_memory=1 << 30), "kv_cache_memory=1073741824 is not supported"),
    (dict(dtype="float32"), "dtype='float32' is not supported"),
])
def test_what_it_cannot_model_is_refused_at_start_up_naming_the_flag(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_supported(EngineConfig(**{**H200_21B, **fields}))


def test_the_300b_shape_fits_eight_gpus_quantized():
    check_supported(EngineConfig(**{**H200_21B, "simulated_model": "ernie-4.5-300b-a47b"}, quantization="wint4",
                                 tensor_parallel_size=8))


@pytest.mark.parametrize("fields,message", [
    (dict(simulated_gpu="h200"), "simulated_gpu='h200' is not supported with execution_backend='auto'"),
    (dict(execution_backend="reference", simulated_time_scale=4.0), "simulated_time_scale=4.0 is not supported with"),
    (dict(execution_backend="simulated", simulated_model="ernie-4.5-21b-a3b"), "needs simulated_gpu"),
    (dict(**H200_21B, simulated_time_scale=0), "simulated_time_scale must be > 0"),
])
def test_simulated_fields_belong_to_the_simulated_backend_alone(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


@pytest.mark.parametrize("gpu", [True, False])
def test_auto_never_picks_the_simulated_backend(monkeypatch, gpu):
    import ernie_serve.devices

    monkeypatch.setattr(ernie_serve.devices, "gpu_visible", lambda: gpu)
    monkeypatch.setattr(ernie_serve.devices, "unusable_gpu_reason", lambda: None)
    assert resolve_backend(EngineConfig()) == ("kernels" if gpu else "reference")


def test_the_server_flags_reach_the_config_and_unknown_names_stop_it_before_starting(capsys):
    from ernie_serve.cli.serve import build_parser, main

    args = build_parser().parse_args(["--execution-backend", "simulated", "--simulated-gpu", "h100",
                                      "--simulated-model", "ernie-4.5-21b-a3b", "--simulated-time-scale", "3"])
    assert (args.simulated_gpu, args.simulated_model, args.simulated_time_scale) == ("h100", "ernie-4.5-21b-a3b", "3")
    assert main(["--execution-backend", "simulated", "--simulated-gpu", "x1", "--simulated-model",
                 "ernie-4.5-21b-a3b"]) == 2
    assert "simulated_gpu='x1' is not supported" in capsys.readouterr().err


def test_it_logs_and_exports_that_it_is_a_simulation(tiny_model_dir, caplog):
    from ernie_serve.serving.metrics import EngineMetrics

    with caplog.at_level(logging.WARNING, logger="ernie_serve.simulated_backend"):
        engine = _engine(tiny_model_dir)
    assert "SIMULATED execution backend: no model runs" in caplog.text
    pb = FakePb()
    metrics = EngineMetrics(pb, {"model": "ernie_moe"})
    _generate(engine, [[40, 41]], SamplingParams(temperature=0, max_tokens=5))
    metrics.update(engine.stats(), force=True)
    device = pb.metrics["ernie:simulated_device"][0]
    assert device.value == 1 and "h200" in device.labels["target"]
    assert pb.metrics["ernie:simulated_steps_total"][0].value == engine.stats()["simulated_steps"]


def test_the_model_figures_for_a_gpu_check_come_out_as_json(capsys):
    import json

    from ernie_serve.simulated_backend.__main__ import main

    main(["--gpu", "h200", "--quantization", "wint8", "--batch", "64,256", "--context", "2048"])
    out = json.loads(capsys.readouterr().out)
    step = StepModel(h200_21b("wint8")).cost(256, 256, np.full(256, 2048))
    assert out["decode_steps"]["256"]["seconds"] == pytest.approx(step.seconds)
    assert out["decode_steps"]["64"]["tok_per_s"] == pytest.approx(64 / StepModel(h200_21b("wint8")).cost(
        64, 64, np.full(64, 2048)).seconds)
    assert out["gpu"]["hbm_bandwidth"] == 4.8e12 and out["constants"]["memory_efficiency"] == 0.70
