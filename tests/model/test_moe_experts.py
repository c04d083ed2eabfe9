"""Routed experts: the per-expert loop and the batched (decode) path both equal a per-token NumPy reference, in
the loaded layout and in the serving layout (BlockedExperts, column-blocked for cpu_gemm.c)."""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from ernie_serve.model import moe
from ernie_serve.model.layers import BlockedLinear, Linear, TiedEmbedding
from ernie_serve.model.moe import BlockedExperts, FusedExperts
from ernie_serve.cpu_kernels import cpu_gemm


def _reference(up_gate, down, x, ids, w):
    inter = down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t]):
            h = x[t] @ up_gate[e]
            g, u = h[:inter], h[inter:]
            out[t] += wt * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("tokens,top_k,num_experts", [(16, 4, 16), (3, 2, 8), (64, 6, 16), (1, 1, 4), (40, 2, 32)])
def test_both_paths_equal_the_reference(tokens, top_k, num_experts, monkeypatch):
    rng = np.random.default_rng(tokens * 31 + top_k)
    h, inter = 24, 10
    up_gate = rng.standard_normal((num_experts, h, 2 * inter)).astype(np.float32) * 0.3
    down = rng.standard_normal((num_experts, inter, h)).astype(np.float32) * 0.3
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, top_k)).astype(np.float32)
    ref = _reference(up_gate, down, x, ids, w)
    ex = FusedExperts.from_weights(up_gate, down)
    args = (paddle.to_tensor(x), paddle.to_tensor(ids), paddle.to_tensor(w))
    counts = np.bincount(ids.ravel(), minlength=num_experts)
    assert isinstance(moe._use_batched(counts), bool)
    for batched in (False, True):
        monkeypatch.setattr(moe, "_use_batched", lambda c, b=batched: b)
        got = ex(*args).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=f"batched={batched}")


def test_decode_shaped_routing_takes_the_batched_path_and_prefill_the_loop():
    decode = np.bincount(np.random.default_rng(0).integers(0, 16, 64), minlength=16)  # 16 tokens x top-4
    assert moe._use_batched(decode)
    skewed = np.zeros(16, dtype=np.int64)
    skewed[:3] = [500, 20, 4]  # most experts idle: the loop reads only the active ones
    assert not moe._use_batched(skewed)


def test_gradients_flow_through_the_batched_path(monkeypatch):
    rng = np.random.default_rng(1)
    ex = FusedExperts.from_weights(rng.standard_normal((4, 8, 12)).astype(np.float32),
                                   rng.standard_normal((4, 6, 8)).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((4, 8)).astype(np.float32), stop_gradient=False)
    ids = paddle.to_tensor(np.array([[0, 1], [2, 3], [1, 2], [3, 0]], np.int64))
    monkeypatch.setattr(moe, "_use_batched", lambda c: True)
    ex(x, ids, paddle.full([4, 2], 0.5)).square().sum().backward()
    assert np.abs(ex.up_gate_proj.grad.numpy()).sum() > 0 and x.grad is not None


@pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler to build cpu_gemm.c")
@pytest.mark.parametrize("tokens,top_k,num_experts,h,inter", [(16, 4, 16, 64, 48), (3, 2, 8, 24, 10),
                                                              (200, 2, 8, 40, 20), (1, 1, 4, 32, 16)])
@pytest.mark.parametrize("offset", [None, 2])
def test_the_serving_layout_equals_the_reference_at_decode_and_prefill_sizes(tokens, top_k, num_experts, h, inter,
                                                                             offset):
    """Decode sizes run every expert in one cpu_gemm.c call, prefill sizes unblock one expert at a time; both
    equal the reference, column counts that are not multiples of 32 and expert parallelism included."""
    rng = np.random.default_rng(tokens + h)
    up_gate = rng.standard_normal((num_experts, h, 2 * inter)).astype(np.float32) * 0.3
    down = rng.standard_normal((num_experts, inter, h)).astype(np.float32) * 0.3
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, top_k)).astype(np.float32)
    local = slice(offset, offset + num_experts // 2) if offset else slice(None)
    ref = _reference(up_gate, down, x, ids, w) if offset is None else None
    if offset is not None:  # only this rank's experts' share
        mine = (ids >= offset) & (ids < offset + num_experts // 2)
        ref = _reference(up_gate, down, x, np.where(mine, ids, 0), np.where(mine, w, 0.0))
    blocked = FusedExperts.from_weights(up_gate[local], down[local]).serving_layout()
    assert isinstance(blocked, BlockedExperts)
    assert blocked.nbytes >= 4 * (up_gate[local].size + down[local].size)
    with paddle.no_grad():
        got = blocked(paddle.to_tensor(x), paddle.to_tensor(ids), paddle.to_tensor(w), offset).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_an_engine_serves_its_fp32_experts_in_the_serving_layout(tiny_model_dir):
    from ernie_serve import LLM, SamplingParams
    from ernie_serve.model.loader import load_model

    llm = LLM(model=str(tiny_model_dir), skip_tokenizer_init=True, disable_progress_bar=True, max_model_len=128)
    served = [layer.mlp.experts for layer in llm.engine.model.layers if hasattr(layer.mlp, "experts")]
    assert served and all(isinstance(e, BlockedExperts) == cpu_gemm.available() for e in served)
    if cpu_gemm.available():  # every fp32 Linear too, lm_head included
        assert not any(type(m) in (Linear, FusedExperts) for m in llm.engine.model.sublayers())
        assert isinstance(llm.engine.model.lm_head, BlockedLinear)
    loaded = load_model(tiny_model_dir, show_progress=False)  # a model loaded on its own keeps the loaded layout
    assert all(isinstance(layer.mlp.experts, FusedExperts) for layer in loaded.layers if hasattr(layer.mlp, "experts"))
    out = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.skipif(not cpu_gemm.available(), reason="no C compiler to build cpu_gemm.c")
def test_a_tied_model_serves_lookups_and_logits_from_one_blocked_copy(tmp_path):
    """Tied embeddings: the serving layout is one column-blocked head whose columns the lookups read; logits and
    hidden states equal the loaded layout's, and the resident bytes do not grow (but for column padding)."""
    from ernie_serve.demo.tiny_model import CONFIGS, random_weights
    from ernie_serve.model.attention import AttentionMetadata
    from ernie_serve.model.checkpoint_writer import write_checkpoint
    from ernie_serve.model.loader import load_model
    from ernie_serve.model.quantized_layers import model_memory_bytes

    config = dict(CONFIGS["tiny"], tie_word_embeddings=True, vocab_size=1000)
    write_checkpoint(tmp_path, config, random_weights(config))
    model = load_model(tmp_path, show_progress=False)
    ids, pos = paddle.to_tensor(np.array([5, 17, 999, 0, 64], np.int64)), paddle.to_tensor(np.arange(5))
    meta = AttentionMetadata.build([5], [5], None, 16, None, 4)
    with paddle.no_grad():
        before, bytes_before = model.compute_logits(model(ids, pos, meta, None)).numpy(), model_memory_bytes([model])
        model.process_weights_after_loading()
        after, bytes_after = model.compute_logits(model(ids, pos, meta, None)).numpy(), model_memory_bytes([model])
    assert isinstance(model.embed_tokens, TiedEmbedding) and isinstance(model.lm_head, BlockedLinear)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    assert bytes_before <= bytes_after <= bytes_before + 4 * 32 * config["hidden_size"]
