"""Tensor / expert parallel sharding without processes: which heads, columns and experts each rank holds,
refusals that name the numbers, and the loader filling each rank's shard with exactly its slice of the
full model (from both checkpoint layouts, pre-quantized checkpoints in every format, and checkpoints
already split per rank)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ernie_serve.demo.tiny_model import CONFIGS, random_weights
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.loader import load_model
from ernie_serve.model.parallel import ParallelLayout
from ernie_serve.model.quantize_checkpoint import checkpoint_tensors, quantize_checkpoint, shard_checkpoint
from ernie_serve.quantization.formats import QUANT_TENSOR_SUFFIXES
from ernie_serve.model.quantized_layers import QuantLinear, QuantMoEExperts

SMALL = dict(CONFIGS["tiny"], vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             head_dim=24, moe_intermediate_size=32, moe_layer_start_index=1, moe_layer_end_index=1,
             moe_num_experts=4, moe_num_shared_experts=1)


def _cfg(**kw) -> ErnieModelConfig:
    return ErnieModelConfig.from_dict(dict(SMALL, **kw))


@pytest.mark.parametrize("kv,n,expected", [
    (2, 2, [range(0, 1), range(1, 2)]),  # split
    (1, 2, [range(0, 1), range(0, 1)]),  # one KV head: every rank keeps it
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated: the head its queries read
])
def test_each_rank_keeps_the_kv_heads_its_query_heads_read(kv, n, expected):
    cfg = _cfg(num_attention_heads=4, num_key_value_heads=kv)
    got = [ParallelLayout(r, n).kv_heads(cfg) for r in range(n)]
    assert got == expected
    group = cfg.num_attention_heads // kv
    for r in range(n):
        heads = ParallelLayout(r, n).query_heads(cfg)
        assert {h // group for h in heads} == set(got[r])


@pytest.mark.parametrize("kw,n,ep,message", [
    (dict(num_attention_heads=4), 3, False, "does not divide the model's num_attention_heads=4"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, False, "does not divide num_key_value_heads=3"),
    (dict(num_attention_heads=12, num_key_value_heads=3), 4, False, "num_key_value_heads=3 is fewer than"),
    (dict(moe_intermediate_size=30), 4, False, "moe_intermediate_size=30"),
    (dict(moe_num_experts=6), 4, True, "moe_num_experts=6"),
    (dict(intermediate_size=90), 4, False, "intermediate_size=90"),
    (dict(vocab_size=510), 4, False, "vocab_size=510"),
])
def test_layouts_the_model_cannot_be_split_into_are_refused_naming_the_numbers(kw, n, ep, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(0, n, ep).check(_cfg(**kw))


def _full_params(path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in load_model(path, show_progress=False).state_dict().items()}


def _expected_shard(full: np.ndarray, name: str, layout: ParallelLayout, cfg: ErnieModelConfig) -> np.ndarray:
    shard = layout.shard_of(name, cfg)
    return full if shard is None else np.take(full, shard[1], axis=shard[0])


@pytest.mark.parametrize("layout_name", ["pt", "paddle"])
@pytest.mark.parametrize("kv,ep", [(2, False), (1, False), (2, True)])
def test_each_rank_loads_exactly_its_slice_of_every_parameter(tmp_path, layout_name, kv, ep):
    config = dict(SMALL, num_key_value_heads=kv, tie_word_embeddings=False)
    cfg = ErnieModelConfig.from_dict(config)
    tensors = random_weights(config, seed=3)
    if layout_name == "paddle":
        tensors = pt_to_paddle(tensors, cfg)
    write_checkpoint(tmp_path, config, tensors)
    full = _full_params(tmp_path)
    for rank in range(2):
        layout = ParallelLayout(rank, 2, ep)
        model = load_model(tmp_path, show_progress=False, layout=layout)
        for name, value in model.state_dict().items():
            np.testing.assert_array_equal(value.numpy(), _expected_shard(full[name], name, layout, cfg), err_msg=name)


# Shapes every quantized format can split in two: one 128-wide head per rank, 128-row / 128-column halves
ALIGNED = dict(SMALL, hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
               intermediate_size=256, moe_intermediate_size=256, moe_num_shared_experts=1, vocab_size=512)


def _dequantized(model) -> dict[str, np.ndarray]:
    """Every weight of a (quantized) model as the float model's parameter would hold it."""
    out = {k: v.numpy() for k, v in model.state_dict().items() if not k.endswith(_QUANT_SUFFIXES)}
    for path, layer in model.named_sublayers():
        if isinstance(layer, QuantMoEExperts):
            for kind in ("up_gate_proj", "down_proj"):
                out[f"{path}.{kind}"] = np.stack([q.dequantize().numpy() for q in getattr(layer, kind)])
        elif isinstance(layer, QuantLinear) and ".experts." not in path:
            out[f"{path}.weight"] = layer.dequantize().numpy()
    return out


_QUANT_SUFFIXES = tuple(QUANT_TENSOR_SUFFIXES)


@pytest.fixture(scope="module")
def aligned_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("aligned")
    cfg = ErnieModelConfig.from_dict(ALIGNED)
    write_checkpoint(root / "float", ALIGNED, pt_to_paddle(random_weights(ALIGNED, seed=5), cfg))
    return root


@pytest.mark.parametrize("method", ["wint8", "wint4", "w4a8", "block_wise_fp8", "wint2"])
def test_each_rank_of_a_prequantized_checkpoint_holds_its_slice_of_the_same_quantized_weights(
        aligned_checkpoint, method):
    """Split in quantized form: rank r dequantizes to exactly rank r's slice of the one-rank model's
    dequantized weights (and, with C8, its KV heads' static scales)."""
    path = aligned_checkpoint / method
    if not path.exists():
        quantize_checkpoint(aligned_checkpoint / "float", path, method, kv_cache_int8=method == "w4a8")
    cfg = ErnieModelConfig.from_pretrained(path)
    one = load_model(path, show_progress=False)
    full = _dequantized(one)
    for ep in (False, True):
        for rank in range(2):
            layout = ParallelLayout(rank, 2, ep)
            model = load_model(path, show_progress=False, layout=layout)
            for name, value in _dequantized(model).items():
                np.testing.assert_array_equal(value, _expected_shard(full[name], name, layout, cfg), err_msg=name)
            if method == "w4a8":
                cols = slice(rank * cfg.head_dim, (rank + 1) * cfg.head_dim)
                for got, want in zip(model.kv_cache_quant.k_scales, one.kv_cache_quant.k_scales):
                    np.testing.assert_array_equal(got, want[cols])


@pytest.mark.parametrize("source,ep", [("wint4", False), ("wint4", True), ("float", False)])
def test_a_checkpoint_split_per_rank_loads_what_the_full_one_gives_each_rank(aligned_checkpoint, tmp_path, source, ep):
    full = aligned_checkpoint / source
    if not full.exists():
        quantize_checkpoint(aligned_checkpoint / "float", full, source)
    shard_checkpoint(full, tmp_path / "split", 2, expert_parallel=ep)
    assert sorted(p.name for p in (tmp_path / "split").iterdir() if p.is_dir()) == ["rank0", "rank1"]
    for rank in range(2):
        layout = ParallelLayout(rank, 2, ep)
        want = checkpoint_tensors(load_model(full, show_progress=False, layout=layout))
        got = checkpoint_tensors(load_model(tmp_path / "split", show_progress=False, layout=layout))
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want[name]).view(np.uint8),
                                          err_msg=name)


def test_a_checkpoint_split_per_rank_is_served_only_with_its_rank_count(aligned_checkpoint, tmp_path):
    shard_checkpoint(aligned_checkpoint / "float", tmp_path / "split", 2)
    with pytest.raises(ValueError, match=r"split for 2 tensor-parallel ranks .* tensor_parallel_size=2, not 1"):
        load_model(tmp_path / "split", show_progress=False)
    with pytest.raises(ValueError, match=r"expert 0 belongs to another expert-parallel rank"):
        load_model(tmp_path / "split", show_progress=False, layout=ParallelLayout(1, 2, True))


def test_online_quantization_quantizes_each_rank_slice(aligned_checkpoint):
    """--quantization under tensor parallelism: each rank quantizes its own slice (FastDeploy's way), so a
    column-parallel weight equals the one-rank quantization's slice (per-column scales see the same
    columns) and a row-parallel one is within a quantization step of it."""
    path = aligned_checkpoint / "float"
    cfg = ErnieModelConfig.from_pretrained(path)
    full = _dequantized(load_model(path, show_progress=False, quantization="wint8"))
    model = load_model(path, show_progress=False, quantization="wint8", layout=ParallelLayout(1, 2))
    local = _dequantized(model)
    layout = ParallelLayout(1, 2)
    col = "layers.0.self_attn.qkv_proj.weight"
    np.testing.assert_array_equal(local[col], _expected_shard(full[col], col, layout, cfg))
    row = "layers.0.self_attn.o_proj.weight"
    want = _expected_shard(full[row], row, layout, cfg)
    assert np.abs(local[row] - want).max() <= np.abs(want).max() / 127
