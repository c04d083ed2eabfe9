"""cpu_layer.c's decoder stack (model/cpu_layers.py) against the Python layers it stands in for: the same kernels
in the same order, so hidden states, logits and the KV cache must be equal bit for bit, on prefill, mixed and decode
steps, over model shapes other than the demo's (one KV head, head_dim 24 and 80, dense layers, MoE every other
layer, shared experts or none, a SwiGLU width cpu_gemm.c cannot fuse) and the weight-only int formats; steps and
models it does not cover run the Python layers."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve import LLM, SamplingParams
from ernie_serve.cpu_kernels import build, cpu_layer
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.step_contract import StepInput
from ernie_serve.model.checkpoint_writer import write_checkpoint
from ernie_serve.model.cpu_layers import CpuDecoderStack
from ernie_serve.model.quantized_layers import QuantLinear
from ernie_serve.model.quantize_checkpoint import quantize_checkpoint

pytestmark = pytest.mark.skipif(not build.available(), reason="the CPU kernels are not built here")

_ARCH = {"architectures": ["Ernie4_5_MoeForCausalLM"], "max_position_embeddings": 1024}
_BASE = dict(_ARCH, vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96)
_MOE = dict(_BASE, moe_num_experts=6, moe_k=2, moe_intermediate_size=32)
SHAPES = {
    "moe_shared_one_kv_head": dict(_MOE, num_key_value_heads=1, tie_word_embeddings=True, moe_num_shared_experts=1,
                                   moe_layer_start_index=1, moe_layer_end_index=2),
    "moe_interval2_no_shared_untied": dict(_MOE, tie_word_embeddings=False, moe_num_shared_experts=0,
                                           moe_layer_start_index=0, moe_layer_end_index=2, moe_layer_interval=2),
    # 2 x 40 and 2 x 20 wide gate-ups: SwiGLU runs as its own pass (cpu_gemm.c fuses widths of 64k only)
    "moe_headdim24_unfused_swiglu": dict(_MOE, head_dim=24, intermediate_size=40, moe_intermediate_size=20,
                                         moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=2,
                                         tie_word_embeddings=True),
    "dense_gqa4_headdim80": dict(_BASE, architectures=["Ernie4_5ForCausalLM"], num_attention_heads=8,
                                 num_key_value_heads=2, head_dim=80, tie_word_embeddings=False),
}
BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """ckpt(name): the random checkpoint of SHAPES[name], written once for the module."""
    written = {}

    def get(name: str):
        if name not in written:
            written[name] = tmp_path_factory.mktemp(name)
            write_checkpoint(written[name], SHAPES[name], random_weights(SHAPES[name], seed=5))
        return written[name]
    return get


def _llm(model_dir, **kw) -> LLM:
    kw = dict(dict(max_model_len=256, block_size=BLOCK, execution_backend="reference"), **kw)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, disable_progress_bar=True, **kw)


def _step(seqs: list[tuple[int, int]], vocab: int, seed: int = 7, blocks: int = 8) -> StepInput:
    """Sequence i computes positions [start, start + n) and holds blocks [b i, b i + b) (b = `blocks`); decodes
    (n <= 8) come first."""
    rng = np.random.default_rng(seed)
    ids, pos, slots = [], [], []
    tables = np.arange(len(seqs) * blocks, dtype=np.int64).reshape(len(seqs), blocks)
    for i, (start, n) in enumerate(seqs):
        p = np.arange(start, start + n)
        ids.append(rng.integers(3, vocab, size=n))
        pos.append(p)
        slots.append(tables[i, p // BLOCK] * BLOCK + p % BLOCK)
    lens = np.asarray([s + n for s, n in seqs], np.int64)
    num_decodes = 0
    while num_decodes < len(seqs) and seqs[num_decodes][1] <= 8:
        num_decodes += 1
    cat = np.concatenate
    return StepInput(token_ids=cat(ids).astype(np.int64), positions=cat(pos).astype(np.int64),
                     query_start_loc=cat([[0], np.cumsum([n for _, n in seqs])]).astype(np.int64), seq_lens=lens,
                     block_tables=tables[:, : int(-(-lens.max() // BLOCK))], slot_mapping=cat(slots).astype(np.int64),
                     sample_rows=np.arange(sum(n for _, n in seqs), dtype=np.int64), num_decodes=num_decodes,
                     max_position=int(lens.max()) - 1)


def _execute(llm: LLM, step: StepInput, fused: bool, calls: list) -> tuple[np.ndarray, np.ndarray]:
    shard = llm.engine.runner.executor
    stack = shard.model.cpu_layers
    shard.model.cpu_layers = stack if fused else None
    try:
        before = len(calls)
        hidden, logits = shard.execute(step)
        assert len(calls) == before + fused  # the C stack ran exactly when asked for
        return hidden.numpy().copy(), logits.numpy().copy()
    finally:
        shard.model.cpu_layers = stack


@pytest.fixture
def calls(monkeypatch):
    seen = []
    run = cpu_layer.decoder_layers
    monkeypatch.setattr(cpu_layer, "decoder_layers", lambda *a: (seen.append(1), run(*a))[1])
    return seen


def _same_steps(llm: LLM, vocab: int, calls: list) -> None:
    """A prefill of three sequences, then a step mixing two decodes with a chunk, then a step of three decodes
    (multi-token verification included): fused and Python equal bit for bit, the cache too."""
    cache = llm.engine.runner.executor.cache
    steps = [_step([(0, 9), (0, 33), (0, 20)], vocab),
             _step([(9, 1), (20, 3), (33, 40)], vocab, seed=8),
             _step([(10, 1), (23, 4), (73, 1)], vocab, seed=9)]
    for i, step in enumerate(steps):
        snapshot = [a.copy() for a in cache.k + cache.v]
        h_fused, l_fused = _execute(llm, step, True, calls)
        written = [a.copy() for a in cache.k + cache.v]
        for a, s in zip(cache.k + cache.v, snapshot):
            a[...] = s
        h_py, l_py = _execute(llm, step, False, calls)
        assert np.array_equal(h_fused, h_py), f"step {i}: hidden states differ by {np.abs(h_fused - h_py).max()}"
        assert np.array_equal(l_fused, l_py), f"step {i}"
        assert all(np.array_equal(a, b) for a, b in zip(written, cache.k + cache.v)), f"step {i}: KV cache"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_c_stack_equals_the_python_layers_bit_for_bit_on_other_shapes(ckpt, name, calls):
    llm = _llm(ckpt(name))
    assert llm.engine.runner.executor.model.cpu_layers is not None, name
    _same_steps(llm, SHAPES[name]["vocab_size"], calls)


@pytest.mark.parametrize("name", ["moe_headdim24_unfused_swiglu", "moe_shared_one_kv_head", "dense_gqa4_headdim80"])
def test_the_c_stack_equals_the_python_layers_with_bfloat16_weights(ckpt, name, calls):
    """--dtype bfloat16: every serving-layout weight held in bfloat16, the C stack still equal to the Python layers."""
    llm = _llm(ckpt(name), dtype="bfloat16")
    model = llm.engine.runner.executor.model
    assert model.cpu_layers is not None and model.layers[0].self_attn.qkv_proj.bits == 16
    _same_steps(llm, SHAPES[name]["vocab_size"], calls)


@pytest.mark.parametrize("method", ["wint8", "wint4", "w4a8"])
def test_the_c_stack_equals_the_python_layers_on_the_int_formats(ckpt, method, calls, tmp_path):
    name = "moe_headdim24_unfused_swiglu"  # experts, shared experts and SwiGLU as its own pass
    # w4a8 needs calibrated activation scales: a pre-quantized checkpoint
    llm = (_llm(quantize_checkpoint(ckpt(name), tmp_path / "w4a8", "w4a8")) if method == "w4a8"
           else _llm(ckpt(name), quantization=method))
    model = llm.engine.runner.executor.model
    assert model.layers[1].mlp.experts.method == method
    if method == "w4a8":
        # FastDeploy's w4a8 keeps wint8 dense layers; a w4a8 o_proj and dense MLP exercise cpu_layer.c's dense path
        layer = model.layers[0]
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "up_gate_proj"), (layer.mlp, "down_proj")):
            w = getattr(parent, attr).dequantize().numpy()
            setattr(parent, attr, QuantLinear.from_float(w, "w4a8", activation_scale=0.05))
        model.cpu_layers = CpuDecoderStack.build(model)
        assert model.cpu_layers is not None
    _same_steps(llm, SHAPES[name]["vocab_size"], calls)


def test_greedy_tokens_equal_with_prefix_caching_chunked_prefill_and_preemption(tiny_model_dir, calls):
    # as tests/kernels_backend's: 12 blocks for four growing sequences preempt, a 24-token budget chunks the
    # 70-token prompt, the last prompt shares the first's 48-token prefix
    ids = [np.random.default_rng(n).integers(3, 4096, size=n).tolist() for n in (50, 70, 33)]
    ids.append(ids[0][:48] + [11, 12, 13])
    kw = dict(num_gpu_blocks_override=12, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def greedy(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params,
                                                             use_tqdm=False)]
    python = _llm(tiny_model_dir, **kw)
    python.engine.runner.executor.model.cpu_layers = None
    want = greedy(python)
    fused = _llm(tiny_model_dir, **kw)
    assert greedy(fused) == want and len(calls) > 10
    assert fused.engine.stats()["num_preemptions"] > 0 and fused.engine.stats()["prefix_cache_hit_tokens"] >= 48


def test_steps_and_models_it_does_not_cover_run_the_python_layers(ckpt, tmp_path, calls):
    name = "moe_shared_one_kv_head"
    vocab = SHAPES[name]["vocab_size"]
    # a chunk past cpu_attention.c's size (600 x 600 > 512 x 512) goes through the tiled Python path, whole step
    llm = _llm(ckpt(name), max_model_len=1024)
    assert llm.engine.runner.executor.model.cpu_layers is not None
    llm.engine.runner.executor.execute(_step([(0, 2), (0, 600)], vocab, blocks=38))
    assert not calls
    # the C8 cache: described (wint8 weights), not served
    c8 = _llm(quantize_checkpoint(ckpt(name), tmp_path / "c8", "wint8", kv_cache_int8=True))
    assert c8.engine.runner.executor.model.cpu_layers is not None
    c8.engine.runner.executor.execute(_step([(0, 9)], vocab))
    assert not calls


@pytest.mark.parametrize("what, change", [
    ("a slot one past the last block", lambda s: s.slot_mapping.__setitem__(-1, 4 * BLOCK)),
    ("a negative slot", lambda s: s.slot_mapping.__setitem__(0, -1)),
    ("a negative position", lambda s: s.positions.__setitem__(0, -1)),
    ("a table entry past the cache", lambda s: s.block_tables.__setitem__((0, 0), 4)),
    ("a sequence longer than its table", lambda s: s.seq_lens.__setitem__(0, BLOCK + 1)),
    ("fewer visible tokens than new ones", lambda s: s.seq_lens.__setitem__(0, 3)),
])
def test_a_step_with_an_index_out_of_range_is_refused_before_anything_is_written(ckpt, what, change):
    """cpu_layer.c checks every index it reads or writes through (step_in_range) and returns before the first
    layer: the C stack must never write past the cache because a caller got a block table wrong."""
    name = "dense_gqa4_headdim80"
    llm = _llm(ckpt(name), num_gpu_blocks_override=4, max_model_len=64)
    bad = _step([(0, 5)], SHAPES[name]["vocab_size"])
    bad.block_tables = np.array([[0]], np.int64)
    change(bad)
    cache = llm.engine.runner.executor.cache
    before = [a.copy() for a in cache.k + cache.v]
    with pytest.raises(ValueError, match="outside the model's"):
        llm.engine.runner.executor.execute(bad)
    assert all(np.array_equal(a, b) for a, b in zip(cache.k + cache.v, before)), what
