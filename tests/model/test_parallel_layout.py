"""Tensor / expert parallel sharding without processes: which heads, columns and experts each rank holds,
refusals that name the numbers, and the loader filling each rank's shard with exactly its slice of the
full model (from both checkpoint layouts)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ernie_serve.demo.tiny_model import CONFIGS, random_weights
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.loader import load_model
from ernie_serve.model.parallel import ParallelLayout

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


def test_a_checkpoint_split_per_rank_is_refused_with_what_to_give_instead(tmp_path):
    (tmp_path / "rank0").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    with pytest.raises(ValueError, match="split per tensor-parallel rank.*give the full"):
        load_model(tmp_path, show_progress=False)
