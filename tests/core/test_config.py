"""Every engine flag either works or is refused at start-up with a message saying what is supported."""
from __future__ import annotations

import pytest

from ernie_serve.cli.serve import build_parser, main
from ernie_serve.config import EngineConfig
from ernie_serve.engine.executor_factory import check_supported, resolve_backend
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import make_engine

REFUSED = [
    ("data_parallel_size", 2, "ernie-serve --data-parallel-size N"),
    ("enable_expert_parallel", True, "it needs tensor_parallel_size > 1"),
    ("gpu_memory_utilization", 0.5, "kv_cache_memory"),
    ("kv_cache_ratio", 0.5, "V0 scheduler"),
    ("load_choices", "default", "only 'default_v1'"),
    ("use_cudagraph", True, "CUDA graphs replay the kernels backend's decode steps"),
    ("dtype", "float16", "in float32 ('auto', 'float32') or bfloat16 ('bfloat16')"),
]


@pytest.mark.parametrize("name,value,hint", REFUSED, ids=[f"{n}={v}" for n, v, _ in REFUSED])
def test_unbuilt_flags_are_refused_naming_the_flag_and_what_is_supported(name, value, hint):
    """By the config itself, or by the backend's own support check (what an engine runs before it loads)."""
    with pytest.raises(ValueError) as e:
        check_supported(EngineConfig(**{name: value}, execution_backend="reference"))
    assert f"{name}={value!r} is not supported" in str(e.value) and hint in str(e.value)


def test_a_backend_gives_every_reason_at_once_and_an_engine_checks_before_loading(tiny_model_dir):
    config = EngineConfig(execution_backend="reference", use_cudagraph=True, dtype="float16")
    with pytest.raises(ValueError, match="use_cudagraph=True is not supported.*; dtype='float16' is not supported"):
        check_supported(config)
    with pytest.raises(ValueError, match="use_cudagraph=True is not supported"):
        make_engine(tiny_model_dir, use_cudagraph=True)
    check_supported(EngineConfig(execution_backend="reference"))


def test_the_kernels_backend_runs_several_ranks_but_not_yet_their_cuda_graphs():
    check_supported(EngineConfig(execution_backend="kernels", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="use_cudagraph=True is not supported: CUDA graphs with tensor_parallel_size=2"):
        check_supported(EngineConfig(execution_backend="kernels", tensor_parallel_size=2, use_cudagraph=True))


def test_execution_backend_names_are_checked_and_auto_follows_the_gpu():
    from ernie_serve.devices import gpu_visible

    with pytest.raises(ValueError, match="execution_backend must be one of auto, reference, kernels"):
        EngineConfig(execution_backend="cuda")
    assert EngineConfig().execution_backend == "auto"  # a config probes no device; the engine's factory resolves it
    assert resolve_backend(EngineConfig()) == ("kernels" if gpu_visible() else "reference")
    assert resolve_backend(EngineConfig(execution_backend="reference")) == "reference"


@pytest.mark.parametrize("flags", [["--use-cudagraph", "--execution-backend", "reference"],
                                   ["--kv-cache-ratio", "0.5"], ["--enable-expert-parallel"],
                                   ["--dtype", "float16", "--execution-backend", "reference"]])
def test_the_server_refuses_them_before_starting_anything(flags, capsys):
    assert main(flags) == 2
    assert "is not supported" in capsys.readouterr().err


@pytest.mark.parametrize("kw,hint", [
    (dict(splitwise_role="decode"), "needs innode_prefill_ports"),
    (dict(splitwise_role="prefill"), "needs engine_worker_queue_port"),
    (dict(splitwise_role="decode", innode_prefill_ports="81a"), "comma-separated TCP ports"),
    (dict(innode_prefill_ports="8182"), "is for splitwise_role='decode'"),
    (dict(engine_worker_queue_port=8182), "a mixed server has none"),
    (dict(splitwise_role="decode", innode_prefill_ports="8182", engine_worker_queue_port=8182), "its own"),
])
def test_disaggregation_flags_are_checked_at_start_up(kw, hint):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    assert hint in str(e.value)


def test_defaults_of_the_refused_flags_are_accepted():
    EngineConfig(tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False, splitwise_role="mixed",
                 gpu_memory_utilization=0.9, kv_cache_ratio=0.75, load_choices="default_v1",
                 execution_backend="reference", use_cudagraph=False)


def test_unknown_options_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine option.*known: "):
        EngineConfig.from_kwargs(tensor_paralel_size=2)
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_kwargs(extra={"anything": 1})  # no catch-all field swallows options


def test_every_engine_field_is_a_server_flag():
    flags = {a.dest for a in build_parser()._actions}
    from dataclasses import fields

    assert {f.name for f in fields(EngineConfig)} <= flags


def test_enable_logprob_false_refuses_requests_that_ask_for_logprobs(tiny_model_dir):
    engine = make_engine(tiny_model_dir, enable_logprob=False)
    with pytest.raises(ValueError, match="--enable-logprob"):
        engine.add_request("x", [40, 41], SamplingParams(logprobs=2))
    engine.add_request("y", [40, 41], SamplingParams(max_tokens=2))  # without logprobs it serves
    while engine.has_unfinished_requests():
        engine.step()


def test_guided_decoding_backend_off_refuses_structured_output_requests(tiny_model_dir):
    from ernie_serve.sampling_params import GuidedDecodingParams

    with pytest.raises(ValueError, match="'xgrammar' is not available: structured outputs run on llguidance"):
        EngineConfig(guided_decoding_backend="xgrammar", execution_backend="reference")
    with pytest.raises(ValueError, match="guided_decoding_backend must be one of auto, guidance, off"):
        EngineConfig(guided_decoding_backend="outlines", execution_backend="reference")
    engine = make_engine(tiny_model_dir, guided_decoding_backend="off")
    with pytest.raises(ValueError, match="--guided-decoding-backend auto"):
        engine.add_request("x", [40, 41], SamplingParams(guided_decoding=GuidedDecodingParams(regex="[0-9]+")))
    engine = make_engine(tiny_model_dir, guided_decoding_backend="guidance")
    engine.add_request("y", [40, 41],
                       SamplingParams(max_tokens=3, guided_decoding=GuidedDecodingParams(regex="[0-9]+")))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("spec,hint", [
    ({"method": "eagle", "num_speculative_tokens": 1}, "supported: 'ngram', 'mtp'"),
    ({"method": "mtp", "num_speculative_tokens": 1, "max_ngram": 2}, "known for 'mtp': method, model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/ckpt/mtp"}, "unknown key(s) model"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "in [1, 5]"),
    ({"method": "ngram", "min_ngram": 3, "max_ngram": 2}, "min_ngram <= max_ngram"),
])
def test_speculative_config_is_checked_at_start_up(spec, hint):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=spec)
    assert hint in str(e.value)


def test_a_swap_space_beyond_host_memory_is_refused_naming_the_flag_and_both_figures() -> None:
    from ernie_serve.config import host_memory_bytes

    total, _ = host_memory_bytes()
    too_big = 2 * total / (1 << 30)
    with pytest.raises(ValueError, match=r"swap_space \(--swap-space\) is .* GiB but this host has .* GiB of memory"):
        EngineConfig(swap_space=too_big)
    EngineConfig(swap_space=0.5)  # within it: accepted


def test_enable_v1_kvcache_scheduler_is_accepted_at_1_and_refused_otherwise(monkeypatch) -> None:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_SCHEDULER", "1")
    EngineConfig()
    monkeypatch.setenv("ENABLE_V1_KVCACHE_SCHEDULER", "0")
    with pytest.raises(ValueError, match=r"ENABLE_V1_KVCACHE_SCHEDULER='0' is not supported: .*only the V1"):
        EngineConfig()


@pytest.mark.parametrize("kw,hint", [
    (dict(cache_queue_port=8183), "cache_queue_port is a prefill or decode server's own queue port"),
    (dict(splitwise_role="decode", innode_prefill_ports="8182", engine_worker_queue_port=8186,
          cache_queue_port=8186), "must differ"),
    (dict(splitwise_role="prefill", engine_worker_queue_port=8182, cache_queue_port=8182), "must differ"),
    (dict(splitwise_role="prefill", engine_worker_queue_port=8182, cache_queue_port=70000), "must be a TCP port"),
])
def test_queue_ports_are_a_prefill_or_decode_servers_own_and_are_checked(kw, hint):
    with pytest.raises(ValueError, match=hint):
        EngineConfig(**kw)
    EngineConfig(splitwise_role="prefill", engine_worker_queue_port=8182, cache_queue_port=8183)
    # the seeds' decode side: its own queue ports, as FastDeploy's instances each have
    EngineConfig(splitwise_role="decode", innode_prefill_ports="8182", engine_worker_queue_port=8186,
                 cache_queue_port=8187)


def test_the_kernels_backend_takes_its_own_dtype_and_refuses_the_others():
    from ernie_serve.kernels_backend.loading import check_runtime

    class Ops:
        name = "torch"

        def __init__(self, on_gpu: bool):
            self.on_gpu = on_gpu
            self.act_dtype = "bfloat16" if on_gpu else "float32"

        def device_count(self) -> int:
            return 1

    gpu, interpreted = Ops(True), Ops(False)
    check_runtime(gpu, EngineConfig(execution_backend="kernels", dtype="bfloat16"))
    check_runtime(gpu, EngineConfig(execution_backend="kernels", dtype="auto"))
    with pytest.raises(ValueError, match="dtype='float16' is not supported: the kernels backend computes in "
                                         "bfloat16 on a GPU"):
        check_runtime(gpu, EngineConfig(execution_backend="kernels", dtype="half"))
    with pytest.raises(ValueError, match="computes in float32 in triton's CPU interpreter"):
        check_runtime(interpreted, EngineConfig(execution_backend="kernels", dtype="bfloat16"))
