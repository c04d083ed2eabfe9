"""Quantized serving end to end on a small random MoE checkpoint: online quantization while loading,
pre-quantized checkpoints from quantize_checkpoint, mixed configs, memory, the C8 KV cache."""
from __future__ import annotations

import json
import shutil

import numpy as np
import paddle
import pytest

from ernie_serve import LLM, SamplingParams
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.model.attention import AttentionMetadata
from ernie_serve.model.checkpoint_writer import write_checkpoint
from ernie_serve.model.kv_cache import PagedKVCache
from ernie_serve.model.layers import Linear
from ernie_serve.model.loader import load_model
from ernie_serve.model.moe import FusedExperts
from ernie_serve.model.quantize_checkpoint import quantize_checkpoint
from ernie_serve.model.quantized_layers import QuantLinear, QuantMoEExperts, weight_memory_report

# K of every matrix (hidden 128, q 128, dense 256, experts 64) is a multiple of 64, as wint2 needs.
CONFIG = {"architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 512, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "moe_num_experts": 6, "moe_k": 2, "moe_intermediate_size": 64,
          "moe_num_shared_experts": 1, "moe_layer_start_index": 1, "moe_layer_end_index": 2,
          "tie_word_embeddings": False, "max_position_embeddings": 1024}
PROMPTS = [np.random.default_rng(s).integers(3, 512, size=n).tolist() for s, n in ((0, 9), (1, 30), (2, 17))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _write(d, config=CONFIG, bf16=False):
    write_checkpoint(d, config, random_weights(config, seed=3), max_shard_bytes=300_000, bf16=bf16)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("fp32"))


@pytest.fixture(scope="module")
def fp32_tokens(ckpt):
    return _greedy(ckpt)


def _greedy(model_dir, **kw) -> list[list[int]]:
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, max_model_len=128, block_size=16,
              disable_progress_bar=True, **kw)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@paddle.no_grad()
def _logits(model, ids=PROMPTS[1]) -> np.ndarray:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None, len(ids) - 1)
    return model.compute_logits(model(paddle.to_tensor(ids), paddle.arange(len(ids)), meta, None)).numpy()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]))


@pytest.mark.parametrize("method,max_rel", [("wint8", 0.02), ("block_wise_fp8", 0.12), ("wint4", 0.4),
                                            ("wint2", 1.0)])
def test_online_quantization_logits_are_close_to_fp32(ckpt, method, max_rel):
    ref = _logits(load_model(ckpt, show_progress=False))
    got = _logits(load_model(ckpt, show_progress=False, quantization=method))
    rel = np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean())
    assert rel < max_rel, (method, rel)


@pytest.mark.parametrize("method,min_agree", [("wint8", 0.95), ("block_wise_fp8", 0.85), ("wint4", 0.5)])
def test_online_quantization_picks_the_fp32_next_token(ckpt, fp32_tokens, method, min_agree):
    """Teacher-forced on fp32's greedy continuations: free-running greedy on a random model diverges for
    good at the first near-tie, which says little about the quantization."""
    ref, got = load_model(ckpt, show_progress=False), load_model(ckpt, show_progress=False, quantization=method)
    assert _forced_agreement(got, ref, fp32_tokens) >= min_agree


def _forced_agreement(model, ref, continuations, quant=None, ref_quant=None) -> float:
    agree = []
    for prompt, cont in zip(PROMPTS, continuations):
        ids = prompt + cont
        a = _cached_logits(model, ids, len(prompt), quant).argmax(-1)
        b = _cached_logits(ref, ids, len(prompt), ref_quant).argmax(-1)
        agree.extend(a == b)
    return float(np.mean(agree))


@paddle.no_grad()
def _cached_logits(model, ids, n_prompt, quant=None) -> np.ndarray:
    """Prefill the prompt, then decode the rest one token per step through a (C8 when quant) KV cache:
    logits of every position from the last prompt token on."""
    cfg, bs = model.config, 16
    nb = -(-len(ids) // bs)
    cache = PagedKVCache(cfg.num_hidden_layers, nb, bs, cfg.num_key_value_heads, cfg.head_dim, quant=quant)
    table = [list(range(nb))]
    meta = AttentionMetadata.build([n_prompt], [n_prompt], table, bs, np.arange(n_prompt), n_prompt - 1)
    h = model(paddle.to_tensor(ids[:n_prompt]), paddle.arange(n_prompt), meta, cache)
    out = [model.compute_logits(h[-1:]).numpy()]
    for p in range(n_prompt, len(ids) - 1):
        meta = AttentionMetadata.build([1], [p + 1], table, bs, np.array([p]), p)
        h = model(paddle.to_tensor(ids[p:p + 1]), paddle.to_tensor([p]), meta, cache)
        out.append(model.compute_logits(h).numpy())
    return np.concatenate(out)


def test_quantized_layers_replace_linears_and_experts_but_not_router_embeddings_or_head(ckpt):
    m = load_model(ckpt, show_progress=False, quantization="wint4")
    assert isinstance(m.layers[0].self_attn.qkv_proj, QuantLinear) and m.layers[0].self_attn.qkv_proj.method == "wint4"
    assert isinstance(m.layers[0].mlp.up_gate_proj, QuantLinear)
    assert isinstance(m.layers[1].mlp.experts, QuantMoEExperts)
    assert isinstance(m.layers[1].mlp.shared_experts.down_proj, QuantLinear)
    assert isinstance(m.lm_head, Linear) and m.layers[1].mlp.gate.weight.dtype == paddle.float32
    assert not any(isinstance(s, (Linear, FusedExperts)) for n, s in m.named_sublayers() if n.startswith("layers."))


@pytest.mark.parametrize("method,ratio", [("wint8", 3.8), ("block_wise_fp8", 3.9), ("wint4", 7.0)])
def test_resident_weights_shrink_by_the_format_ratio(ckpt, method, ratio):
    fp32 = weight_memory_report(load_model(ckpt, show_progress=False))
    rep = weight_memory_report(load_model(ckpt, show_progress=False, quantization=method))
    assert rep["quantized_fp32_bytes"] / rep["quantized_bytes"] >= ratio
    assert rep["fp32_model_bytes"] == fp32["total_bytes"]
    assert rep["total_bytes"] == rep["float_bytes"] + rep["quantized_bytes"] < fp32["total_bytes"]


def test_bf16_checkpoint_quantizes_while_loading(tmp_path, ckpt):
    d = _write(tmp_path / "bf16", bf16=True)
    ref = _logits(load_model(d, show_progress=False))
    got = _logits(load_model(d, show_progress=False, quantization="wint8"))
    assert np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()) < 0.02


@pytest.mark.parametrize("method", ["wint8", "wint4", "block_wise_fp8", "wint2"])
def test_prequantized_checkpoint_serves_like_online_quantization(tmp_path, ckpt, method):
    out = quantize_checkpoint(ckpt, tmp_path / method, method)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["is_quantized"] and qc["quantization"] == method
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "ernie.layers.1.mlp.experts.0.up_gate_proj.quant_weight" in names
    assert "ernie.layers.1.mlp.gate.weight" in names and "lm_head.weight" in names
    online = load_model(ckpt, show_progress=False, quantization=method)
    pre = load_model(out, show_progress=False)
    # same tensors (so same memory); logits agree to rounding: Paddle's matmuls are not bit-reproducible across
    # allocations, and an fp32 rounding difference can move a row's 16-bit activation code (cpu_qgemm.c) by one
    np.testing.assert_allclose(_logits(pre), _logits(online), rtol=1e-5, atol=5e-4)
    assert weight_memory_report(pre) == weight_memory_report(online)
    assert _greedy(out) == _greedy(ckpt, quantization=method)


def test_w4a8_checkpoint_is_calibrated_and_close_to_fp32(tmp_path, ckpt, fp32_tokens):
    out = quantize_checkpoint(ckpt, tmp_path / "w4a8", "w4a8")
    m = load_model(out, show_progress=False)
    assert m.layers[1].mlp.experts.method == "w4a8" and m.layers[0].self_attn.qkv_proj.method == "wint8"
    assert float(m.layers[1].mlp.experts.up_gate_proj[0].tensors["activation_scale"]) > 0
    ref = _logits(load_model(ckpt, show_progress=False))
    got = _logits(m)
    assert np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()) < 0.3
    with pytest.raises(ValueError, match="w4a8 needs a static activation scale"):
        load_model(ckpt, show_progress=False, quantization="w4a8")


def test_prequantized_checkpoint_rejects_a_different_quantization_flag(tmp_path, ckpt):
    out = quantize_checkpoint(ckpt, tmp_path / "w8", "wint8")
    with pytest.raises(ValueError, match="conflicts with this pre-quantized checkpoint"):
        load_model(out, show_progress=False, quantization="wint4")


def test_mixed_quantization_config_with_per_layer_moe_ranges(tmp_path):
    qc = {"quantization": "mix_quant", "dense_quant_type": "wint8", "moe_quant_type": "w4w2",
          "moe_quant_config": {"moe_w4_quant_config": {"quant_type": "wint4", "quant_start_layer": 0,
                                                       "quant_end_layer": 1},
                               "moe_w2_quant_config": {"quant_type": "wint2", "quant_start_layer": 2,
                                                       "quant_end_layer": 2}}}
    d = _write(tmp_path / "mixed", dict(CONFIG, quantization_config=qc))
    m = load_model(d, show_progress=False)
    assert m.layers[0].self_attn.o_proj.method == "wint8" and m.layers[0].mlp.down_proj.method == "wint8"
    assert m.layers[1].mlp.experts.method == "wint4" and m.layers[2].mlp.experts.method == "wint2"
    assert m.layers[2].mlp.shared_experts.up_gate_proj.method == "wint8"
    # the same plan, pre-quantized by hand from the online model, loads directly (FastDeploy's 2-bit layout)
    pre = tmp_path / "mixed-pre"
    tensors = {}
    for path, layer in m.named_sublayers():
        if isinstance(layer, QuantLinear):
            parts = path.split(".")
            if parts[-3] == "experts":  # layers.L.mlp.experts.up_gate_proj.E -> experts.E.up_gate_proj
                path = ".".join(parts[:-2] + [parts[-1], parts[-2]])
            tensors.update({f"ernie.{path}.{k}": v for k, v in layer.export().items()})
    for n, p in m.named_parameters():
        n = n.replace("mlp.gate.e_score_correction_bias", "mlp.moe_statics.e_score_correction_bias")
        tensors[n if n == "lm_head.weight" else "ernie." + n] = p.numpy()
    write_checkpoint(pre, dict(CONFIG, quantization_config=dict(qc, is_quantized=True)), tensors)
    np.testing.assert_allclose(_logits(load_model(pre, show_progress=False)), _logits(m), rtol=1e-5, atol=1e-4)


def test_c8_kv_cache_dynamic_and_static_stay_close_to_fp32_kv(tmp_path, ckpt, fp32_tokens):
    dyn = _write(tmp_path / "c8dyn", dict(CONFIG, quantization_config={"kv_cache_quant_type": "int8"}))
    m = load_model(dyn, show_progress=False)
    assert m.kv_cache_quant is not None and not m.kv_cache_quant.static
    assert isinstance(m.layers[0].self_attn.qkv_proj, Linear)  # KV-only config: weights stay fp32
    assert _forced_agreement(m, m, fp32_tokens, quant=m.kv_cache_quant) >= 0.95
    static = quantize_checkpoint(ckpt, tmp_path / "c8static", "wint8", kv_cache_int8=True)
    ms = load_model(static, show_progress=False)
    assert ms.kv_cache_quant.static and ms.kv_cache_quant.k_scales[0].shape == (CONFIG["num_key_value_heads"] * 32,)
    assert _forced_agreement(ms, ms, fp32_tokens, quant=ms.kv_cache_quant) >= 0.95
    llm = LLM(model=str(static), skip_tokenizer_init=True, max_model_len=128, block_size=16, disable_progress_bar=True)
    assert llm.engine.runner.cache.k[0].dtype == np.int8  # the engine serves it with the C8 cache
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


def test_float_experts_train_with_autograd():
    rng = np.random.default_rng(0)
    ex = FusedExperts.from_weights(rng.standard_normal((4, 16, 24)).astype(np.float32) * 0.2,
                                   rng.standard_normal((4, 12, 16)).astype(np.float32) * 0.2)
    x = paddle.to_tensor(rng.standard_normal((5, 16)).astype(np.float32), stop_gradient=False)
    ids = paddle.to_tensor(np.array([[0, 1], [1, 2], [0, 2], [1, 0], [2, 1]], np.int64))
    w = paddle.to_tensor(np.full((5, 2), 0.5, np.float32))
    ex(x, ids, w).square().sum().backward()
    g = ex.up_gate_proj.grad.numpy()
    assert np.abs(g[:3]).sum() > 0 and np.abs(g[3]).sum() == 0  # expert 3 got no tokens
    assert ex.down_proj.grad is not None and x.grad is not None
