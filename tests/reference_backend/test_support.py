"""reference_backend/support.py: what the CPU backend can run, decided from the EngineConfig alone, and the dtypes it
holds weights and KV in."""
from __future__ import annotations

import json
import shutil

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.executor_factory import check_supported
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.reference_backend import support
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import make_engine

NO_VECTOR = {"sse4_2", "avx"}  # neither AVX2 + FMA nor AVX-512: the C kernels do not vectorize bfloat16


def _reference(**kw) -> EngineConfig:
    return EngineConfig(execution_backend="reference", **kw)


def test_dtype_takes_vllms_names_and_the_cpu_backend_runs_float32_and_bfloat16(tiny_model_dir, monkeypatch):
    """--dtype as vLLM / FastDeploy users type it: aliases normalized, unknown names refused; 'float32' ('auto') and
    'bfloat16' run the reference backend (bfloat16 weights, half the bytes), and bfloat16 is refused on a CPU whose
    flags show neither AVX2 + FMA nor AVX-512, where the C kernels that read it do not vectorize."""
    assert EngineConfig(dtype="float", execution_backend="reference").dtype == "float32"
    assert EngineConfig(dtype="half", execution_backend="kernels").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        EngineConfig(dtype="fp8")
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        check_supported(EngineConfig(dtype=dtype, execution_backend="reference"))
        engine = make_engine(tiny_model_dir, dtype=dtype, execution_backend="reference")
        engine.add_request("a", [5, 17, 9], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        model = engine.model
        sizes[dtype] = sum(b.numel().item() * b.element_size() for b in model.buffers())
        engine.close()
    assert sizes["bfloat16"] * 2 == sizes["float32"]  # every serving-layout weight at half the bytes
    monkeypatch.setattr(support, "cpu_flags", lambda: NO_VECTOR)
    with pytest.raises(ValueError, match="dtype='bfloat16' is not supported on this CPU.*AVX2 \\+ FMA or AVX-512"):
        check_supported(EngineConfig(dtype="bfloat16", execution_backend="reference"))


def test_dtype_auto_on_the_cpu_is_the_checkpoints_bfloat16_where_the_kernels_run_it(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """--dtype auto on the reference backend, as vLLM-CPU's: a checkpoint that declares bfloat16 (HF's torch_dtype, or
    transformers 5's dtype; the real ERNIE-4.5 ones do) is held in bfloat16 on an AVX2 + FMA / AVX-512 CPU, in float32
    on one without; a float32 checkpoint stays float32, and an explicit --dtype wins."""
    bf16_dir = tmp_path / "bf16"
    shutil.copytree(tiny_model_dir, bf16_dir)
    cfg = json.loads((bf16_dir / "config.json").read_text())
    cfg.pop("dtype", None)
    (bf16_dir / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    assert ErnieModelConfig.from_pretrained(bf16_dir).checkpoint_dtype == "bfloat16"
    assert ErnieModelConfig.from_pretrained(tiny_model_dir).checkpoint_dtype == "float32"

    def bits(model_dir, **kw):
        engine = make_engine(model_dir, execution_backend="reference", **kw)
        try:
            return engine.model.layers[0].self_attn.qkv_proj.bits
        finally:
            engine.close()

    vector = support._vector_cpu()
    assert bits(bf16_dir) == (16 if vector else 32)
    assert bits(tiny_model_dir) == 32
    assert bits(bf16_dir, dtype="float32") == 32
    assert support.resolve_auto_dtype("float16") == "float32"
    monkeypatch.setattr(support, "cpu_flags", lambda: NO_VECTOR)
    assert support.resolve_auto_dtype("bfloat16") == "float32"


@pytest.mark.parametrize("flags", [{"avx2", "fma"}, {"avx512f"}, set()], ids=["avx2+fma", "avx512", "unknown"])
def test_a_supported_config_gives_no_reasons(flags, monkeypatch):
    """The defaults and both dtypes it holds; bfloat16 wherever the kernels vectorize it, or where /proc/cpuinfo cannot
    tell (the kernels then run as built rather than the server refusing to start)."""
    monkeypatch.setattr(support, "cpu_flags", lambda: flags)
    for dtype in ("auto", "float32", "bfloat16"):
        assert support.unsupported(_reference(dtype=dtype)) == []
    assert support.unsupported(_reference(kv_cache_memory=1 << 28, num_gpu_blocks_override=64, swap_space=0.01)) == []


REFUSALS = [  # (the flag, its value, what the message must say to use instead)
    ("gpu_memory_utilization", 0.5, "size its pool with kv_cache_memory (bytes) or num_gpu_blocks_override"),
    ("use_cudagraph", True, "use execution_backend='kernels'"),
    ("dtype", "float16", "in float32 ('auto', 'float32') or bfloat16 ('bfloat16')"),
]


@pytest.mark.parametrize("name,value,instead", REFUSALS, ids=[f"{n}={v}" for n, v, _ in REFUSALS])
def test_each_refusal_names_the_flag_and_what_to_use_instead(name, value, instead):
    reasons = support.unsupported(_reference(**{name: value}))
    assert len(reasons) == 1
    assert reasons[0].startswith(f"{name}={value!r} is not supported")
    assert instead in reasons[0]


def test_bfloat16_is_refused_on_a_cpu_without_avx2_and_fma_or_avx512(monkeypatch):
    """AVX2 without FMA is not enough: vec16.h's bfloat16 path needs both."""
    for flags in (NO_VECTOR, {"avx2"}, {"fma"}):
        monkeypatch.setattr(support, "cpu_flags", lambda flags=flags: flags)
        reasons = support.unsupported(_reference(dtype="bfloat16"))
        assert len(reasons) == 1, flags
        assert reasons[0].startswith("dtype='bfloat16' is not supported on this CPU")
        assert "AVX2 + FMA or AVX-512" in reasons[0] and "use dtype 'float32'" in reasons[0]
        assert support.unsupported(_reference(dtype="float32")) == []


def test_every_reason_is_given_at_once_and_float16_is_not_also_called_a_cpu_problem(monkeypatch):
    monkeypatch.setattr(support, "cpu_flags", lambda: NO_VECTOR)
    reasons = support.unsupported(_reference(gpu_memory_utilization=0.8, use_cudagraph=True, dtype="float16"))
    assert [r.split(" is not supported")[0] for r in reasons] == [
        "gpu_memory_utilization=0.8", "use_cudagraph=True", "dtype='float16'"]


def test_weight_bits_follow_the_dtype_and_the_kv_cache_follows_the_weights():
    assert support.weight_bits(_reference(dtype="float32")) == 32
    assert support.weight_bits(_reference(dtype="bfloat16")) == 16
    assert support.weight_bits(_reference(dtype="auto")) == 32  # unresolved 'auto': float32 (resolve_auto_dtype first)
    assert support.kv_dtype(16) == "bfloat16"
    assert support.kv_dtype(32) == "float32"


@pytest.mark.parametrize("flags,want", [({"avx2", "fma"}, "bfloat16"), ({"avx512f"}, "bfloat16"),
                                        (NO_VECTOR, "float32")], ids=["avx2+fma", "avx512", "no-vector"])
def test_auto_resolves_to_a_bfloat16_checkpoints_dtype_only_where_the_kernels_vectorize_it(flags, want, monkeypatch):
    monkeypatch.setattr(support, "cpu_flags", lambda: flags)
    assert support.resolve_auto_dtype("bfloat16") == want
    assert support.resolve_auto_dtype("float32") == "float32"
