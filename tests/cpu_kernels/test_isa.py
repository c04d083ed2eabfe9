"""ERNIE_CPU_ISA's tiers (cpu_kernels/isa.py): which a CPU runs, what is refused, how a capped library is built, that
each library runs the tier it was built for, and end to end, under each tier this CPU has, the greedy tokens of a
parity checkpoint equal transformers' (float32 weights, and wint8 ones against transformers on the same
dequantized weights)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from ernie_serve.cpu_kernels import build
from ernie_serve.cpu_kernels.isa import ISAS, cap_from_env, compile_flags, cpu_isas

XEON = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
        "amx_int8"}
ZEN4 = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
ZEN3 = {"avx2", "fma"}


@pytest.mark.parametrize("flags,tiers", [
    (XEON, ISAS),
    (ZEN4, ("scalar", "avx2", "avx512", "avx512_vnni")),
    (ZEN3, ("scalar", "avx2")),
    ({"fp", "asimd"}, ("scalar",)),  # Arm: no vector path of ours
    (ZEN4 - {"avx512_vnni"}, ("scalar", "avx2", "avx512")),  # Skylake-SP
    ({"avx2", "fma", "amx_tile", "amx_bf16"}, ("scalar", "avx2")),  # a tier counts only with every lower one
])
def test_a_cpu_runs_each_tier_whose_flags_it_has_and_every_lower_one(flags, tiers):
    assert cpu_isas(flags) == list(tiers)


@pytest.mark.parametrize("env,cap", [
    ({}, "amx"), ({"ERNIE_CPU_AMX": "0"}, "avx512_vnni"), ({"ERNIE_CPU_ISA": "avx2"}, "avx2"),
    ({"ERNIE_CPU_ISA": "scalar", "ERNIE_CPU_AMX": "0"}, "scalar"), ({"ERNIE_CPU_ISA": ""}, "amx"),
])
def test_the_cap_is_the_named_tier_or_the_cpus_highest_below_amx_without_it(env, cap):
    assert cap_from_env(env, ISAS) == cap


def test_a_tier_above_the_cpus_is_refused_naming_the_variable_and_what_the_cpu_runs():
    with pytest.raises(ValueError, match=r"ERNIE_CPU_ISA=avx512: this CPU runs only scalar, avx2 \(its flags lack "
                                         r"avx512f"):
        cap_from_env({"ERNIE_CPU_ISA": "avx512"}, cpu_isas(ZEN3))
    with pytest.raises(ValueError, match="ERNIE_CPU_ISA=amx: this CPU runs only scalar, avx2, avx512, avx512_vnni"):
        cap_from_env({"ERNIE_CPU_ISA": "amx"}, cpu_isas(ZEN4))
    with pytest.raises(ValueError, match="ERNIE_CPU_ISA='AVX2': expected one of"):
        cap_from_env({"ERNIE_CPU_ISA": "AVX2"}, ISAS)
    with pytest.raises(ValueError, match="ERNIE_CPU_ISA=amx with ERNIE_CPU_AMX=0"):  # on any CPU
        cap_from_env({"ERNIE_CPU_ISA": "amx", "ERNIE_CPU_AMX": "0"}, cpu_isas(ZEN3))
    with pytest.raises(ValueError, match="ERNIE_CPU_AMX='off'"):
        cap_from_env({"ERNIE_CPU_AMX": "off"}, ISAS)


def test_a_capped_library_switches_off_only_the_higher_tiers_the_cpu_has():
    assert compile_flags("amx", ISAS, XEON) == compile_flags("avx512_vnni", ISAS, XEON) == ()  # AMX: ernie_set_amx
    assert compile_flags("avx512", ISAS, XEON) == ("-mno-avx512vnni", "-mno-avxvnni", "-mno-amx-tile",
                                                  "-mno-amx-bf16", "-mno-amx-int8")
    assert compile_flags("avx512", cpu_isas(ZEN4), ZEN4) == ("-mno-avx512vnni",)
    assert compile_flags("avx2", cpu_isas(ZEN4), ZEN4) == ("-mno-avx512f", "-mno-avx512vnni")
    assert compile_flags("scalar", cpu_isas(ZEN3), ZEN3) == ("-mno-avx2", "-mno-fma")
    assert compile_flags("avx2", cpu_isas(ZEN3), ZEN3) == ()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_each_tier_runs_the_library_built_for_it(isa):
    """isa.c reads the tier from the compiler's macros, the ones the kernels' #if branches test. Every tier is
    listed: one this CPU lacks is skipped, the reason naming the flag it lacks."""
    assert build.isa() == isa


def test_a_tier_above_this_cpus_is_refused_at_start_up_naming_the_variable():
    """The real CPU, not a flag set: ERNIE_CPU_ISA=<the tier above its highest> stops the kernels from loading with
    the CPU's tiers and the flags it lacks, never a quiet fall back to a lower tier."""
    above = [t for t in ISAS if t not in build.cpu_isas()]
    if not above:
        pytest.skip("this CPU runs every tier; ERNIE_CPU_ISA=amx with ERNIE_CPU_AMX=0 is its refusal (tested above)")
    r = subprocess.run([sys.executable, "-c", "from ernie_serve.cpu_kernels import build; print(build.isa())"],
                       env=dict(os.environ, ERNIE_CPU_ISA=above[0]), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == "", (r.stdout, r.stderr)
    assert (f"ValueError: ERNIE_CPU_ISA={above[0]}: this CPU runs only {', '.join(build.cpu_isas())} (its flags lack"
            in r.stderr), r.stderr


def test_a_tier_this_process_may_not_run_is_refused():
    with pytest.raises(ValueError, match="this process may run scalar"):
        build.use_isa("avx1024")


def _dequantized_hf(name: str, bits: int):
    """transformers' model `name` with every weight the engine quantizes (projections, experts, shared experts; not
    the router, embeddings or lm_head) replaced by its weight-only dequantized values: the float32 oracle of a
    wint8 engine up to the activations' 16-bit rounding on the integer tiers."""
    import torch

    from ernie_serve.quantization import formats as fmt
    from hf_models import hf_model

    model = hf_model(name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim < 2 or "embed_tokens" in pname or "lm_head" in pname or pname.endswith("mlp.gate.weight"):
                continue
            w = p.numpy().swapaxes(-1, -2)  # [..., out, in] -> the [..., K, N] the engine quantizes
            q, s = fmt.quantize_weight_only(w, bits)
            p.copy_(torch.from_numpy(np.ascontiguousarray(fmt.dequantize_weight_only(q, s, bits).swapaxes(-1, -2))))
    return model


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """A transformers checkpoint whose sizes are no multiple of a vector or tile (the kernels' tails), two prompts,
    and transformers' 12 greedy tokens after each, float32 and wint8."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import VOCAB, hf_model

    name = "moe_odd_sizes"
    d = tmp_path_factory.mktemp(name)
    hf_model(name).save_pretrained(d)
    prompts = [np.random.default_rng(s).integers(3, VOCAB, size=n).tolist() for s, n in ((2, 17), (3, 40))]
    want = {}
    for method, model in (("float32", hf_model(name)), ("wint8", _dequantized_hf(name, 8))):
        with torch.no_grad():
            want[method] = [model.generate(torch.tensor(p)[None], max_new_tokens=12, min_new_tokens=12,
                                           do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return d, prompts, want


@pytest.mark.parametrize("method", ["float32", "wint8"])
def test_greedy_tokens_equal_transformers_on_every_tier(isa, parity, method):
    from ernie_serve import LLM, SamplingParams

    d, prompts, want = parity
    llm = LLM(model=str(d), skip_tokenizer_init=True, max_model_len=128, block_size=16, disable_progress_bar=True,
              quantization=None if method == "float32" else method)
    try:
        outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finally:
        llm.engine.close()
    assert [o.outputs[0].token_ids for o in outs] == want[method], (isa, method)
