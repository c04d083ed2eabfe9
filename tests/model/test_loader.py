"""Checkpoint loading: both layouts, bf16 on disk, sharding, and errors that name what is wrong."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from ernie_serve.demo.tiny_model import CONFIGS, random_weights
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.loader import load_model

SMALL = dict(CONFIGS["tiny"], vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             head_dim=16, moe_intermediate_size=32, moe_layer_end_index=1)


def _write(tmp_path, tensors, config=SMALL, **kw):
    write_checkpoint(tmp_path, config, tensors, **kw)
    return tmp_path


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_bf16_checkpoint_loads_as_rounded_fp32(tmp_path):
    w = random_weights(SMALL, seed=1)
    fp32 = load_model(_write(tmp_path / "a", w), show_progress=False)
    bf16 = load_model(_write(tmp_path / "b", w, bf16=True), show_progress=False)
    for name, ref in _state(fp32).items():
        got = _state(bf16)[name]
        if name.endswith(("gate.weight", "e_score_correction_bias")):
            np.testing.assert_array_equal(got, ref)  # the router stays fp32 on disk, as in the real checkpoints
        else:
            np.testing.assert_allclose(got, ref, rtol=2 ** -8, atol=1e-6)


def test_paddle_layout_and_sharding_give_identical_parameters(tmp_path):
    w = random_weights(SMALL, seed=2)
    pt = load_model(_write(tmp_path / "pt", w), show_progress=False)
    cfg = ErnieModelConfig.from_dict(SMALL)
    pd = load_model(_write(tmp_path / "pd", pt_to_paddle(w, cfg), max_shard_bytes=50_000), show_progress=False)
    assert len(list((tmp_path / "pd").glob("*.safetensors"))) > 2
    a, b = _state(pt), _state(pd)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_missing_tensor_is_named(tmp_path):
    w = random_weights(SMALL)
    del w["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors for: layers\.1\.mlp\.experts\.up_gate_proj"):
        load_model(_write(tmp_path, w), show_progress=False)


def test_unexpected_tensor_is_named(tmp_path):
    w = random_weights(SMALL)
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.rotary_emb.inv_freq'"):
        load_model(_write(tmp_path, w), show_progress=False)


def test_wrong_shape_is_named(tmp_path):
    w = random_weights(SMALL)
    w["model.layers.0.self_attn.o_proj.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.o_proj.weight' has shape"):
        load_model(_write(tmp_path, w), show_progress=False)


def test_unknown_architecture_and_missing_fields(tmp_path):
    bad = dict(SMALL, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architectures"):
        ErnieModelConfig.from_dict(bad)
    cfg = copy.deepcopy(SMALL)
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ErnieModelConfig.from_dict(cfg)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, show_progress=False)


def test_mtp_tensors_are_kept_and_never_break_loading(tmp_path):
    w = random_weights(SMALL)
    h = SMALL["hidden_size"]
    w["model.mtp_emb_norm.0.weight"] = np.ones(h, np.float32)
    w["model.mtp_linear_proj.0.weight"] = np.zeros((h, 2 * h), np.float32)
    m = load_model(_write(tmp_path, w), show_progress=False)
    assert set(m.mtp_weights) == {"model.mtp_emb_norm.0.weight", "model.mtp_linear_proj.0.weight"}


def test_rope_parameters_and_rope_theta_spellings(tmp_path):
    a = ErnieModelConfig.from_dict(dict(SMALL, rope_theta=10000.0))
    b = ErnieModelConfig.from_dict(dict({k: v for k, v in SMALL.items() if k != "rope_theta"},
                                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}))
    assert a.rope_theta == b.rope_theta == 10000.0
    assert json.dumps(SMALL)  # the config stays JSON-serializable
