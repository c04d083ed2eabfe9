"""Loading at scale: each rank reads only its slices of the checkpoint, in the stored dtype, and streams them onto
the device tensor by tensor, so the host never holds the shard (kernels_backend/weights.py, model/safetensors_io.py).

Host memory is measured with tracemalloc, which sees NumPy's buffers but not the tensors the framework allocates:
what it reports is the loader's host staging, the thing that must stay bounded."""
from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from ernie_serve import load_progress
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.kernels_backend.framework import make_tensor_ops
from ernie_serve.kernels_backend.weights import load_device_weights
from ernie_serve.model import safetensors_io
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.parallel import ParallelLayout

CONFIG = dict(architectures=["Ernie4_5_MoeForCausalLM"], vocab_size=256, hidden_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500000.0, moe_num_experts=8, moe_k=2,
              moe_intermediate_size=128, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=3,
              tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["pt", "paddle"])
def checkpoint(request, tmp_path_factory):
    """A bf16 checkpoint of CONFIG in either layout, and its tensors as fp32."""
    tensors = random_weights(CONFIG, seed=3)
    if request.param == "paddle":
        tensors = pt_to_paddle(tensors, ErnieModelConfig.from_dict(CONFIG))
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, CONFIG, tensors, bf16=True, max_shard_bytes=1 << 20)
    return path


@pytest.fixture(scope="module")
def ops():
    return make_tensor_ops("paddle")


def _load(path, ops, rank=0, world=1, quantization=None):
    cfg = ErnieModelConfig.from_pretrained(path)
    return load_device_weights(path, cfg, ops, quantization, show_progress=False,
                               layout=ParallelLayout(rank, world))[0]


def _params(weights, ops) -> dict[str, np.ndarray]:
    """The float weights a load placed, by a name of our own, on the host in fp32."""
    out = {"embed": weights.embed, "lm_head": weights.lm_head, "norm": weights.norm}
    for i, layer in enumerate(weights.layers):
        out.update({f"{i}.qkv": layer.qkv.weight, f"{i}.o": layer.o.weight, f"{i}.in_norm": layer.input_norm})
        if layer.mlp_up_gate is not None:
            out.update({f"{i}.mlp_up_gate": layer.mlp_up_gate.weight, f"{i}.mlp_down": layer.mlp_down.weight})
        if layer.is_moe:
            out.update({f"{i}.gate": layer.gate, f"{i}.bias": layer.gate_bias,
                        f"{i}.experts_up_gate": layer.experts.up_gate, f"{i}.experts_down": layer.experts.down})
    return {k: ops.to_host(v) for k, v in out.items()}


def _shard_bytes_fp32(path) -> int:
    return 4 * sum(int(np.prod(i["shape"])) for s in path.glob("*.safetensors")
                   for i in safetensors_io.read_header(s)[0].values())


def _largest_tensor_bytes_fp32(path) -> int:
    return 4 * max(int(np.prod(i["shape"])) for s in path.glob("*.safetensors")
                   for i in safetensors_io.read_header(s)[0].values())


def test_reading_a_slice_along_any_axis_gives_numpy_slicing_in_the_stored_dtype(tmp_path, monkeypatch):
    a = np.random.default_rng(0).standard_normal((6, 50, 9)).astype(np.float32)
    safetensors_io.save_file({"a": a}, tmp_path / "x.safetensors", bf16={"a"})
    monkeypatch.setattr(safetensors_io, "SCRATCH_BYTES", 2000)  # several passes of whole rows
    stored = a.astype(ml_dtypes.bfloat16)
    keep = np.array([1, 2, 3, 17, 30, 31, 49])
    with safetensors_io.SafetensorsReader(tmp_path / "x.safetensors") as reader:
        assert reader.read("a").dtype == ml_dtypes.bfloat16
        assert np.array_equal(reader.read("a"), stored)
        assert np.array_equal(reader.read("a", 0, np.array([4, 5, 0])), stored[[4, 5, 0]])
        assert np.array_equal(reader.read("a", 1, keep), stored[:, keep])
        assert np.array_equal(reader.read("a", 2, np.array([8, 0, 1])), stored[:, :, [8, 0, 1]])


def test_each_rank_places_exactly_its_slice_of_every_weight(checkpoint, ops):
    whole = _params(_load(checkpoint, ops), ops)
    cfg = ErnieModelConfig.from_pretrained(checkpoint)
    for rank in range(2):
        layout = ParallelLayout(rank, 2)
        mine = _params(_load(checkpoint, ops, rank, 2), ops)
        for name, value in mine.items():
            layer, _, kind = name.rpartition(".")
            param = {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight", "qkv": "self_attn.qkv_proj.weight",
                     "o": "self_attn.o_proj.weight", "experts_up_gate": "mlp.experts.up_gate_proj",
                     "experts_down": "mlp.experts.down_proj",
                     "mlp_up_gate": ("mlp.shared_experts." if int(layer or 0) >= 1 else "mlp.") + "up_gate_proj.weight",
                     "mlp_down": ("mlp.shared_experts." if int(layer or 0) >= 1 else "mlp.") + "down_proj.weight",
                     }.get(kind, "replicated")
            shard = layout.shard_of(f"layers.{layer}.{param}" if layer else param, cfg)
            expected = whole[name] if shard is None else np.take(whole[name], shard[1], axis=shard[0])
            np.testing.assert_array_equal(value, expected, err_msg=f"rank {rank}: {name}")


def test_float_weights_reach_the_device_in_the_checkpoint_dtype(checkpoint, ops, monkeypatch):
    handed = []
    real = type(ops).tensor

    def spy(self, a, dtype=None):
        handed.append((np.asarray(a).dtype, np.asarray(a).size))
        return real(self, a, dtype)
    monkeypatch.setattr(type(ops), "tensor", spy)
    _load(checkpoint, ops, 1, 2)
    large = {dtype for dtype, size in handed if size >= CONFIG["hidden_size"] * 32}
    assert large == {np.dtype(ml_dtypes.bfloat16)}, large


@pytest.mark.parametrize("world,rank,quantization", [(1, 0, None), (2, 1, None), (1, 0, "wint8"), (2, 0, "wint4")])
def test_host_memory_while_loading_stays_within_a_few_tensors_not_the_shard(checkpoint, ops, world, rank,
                                                                          quantization):
    _load(checkpoint, ops, rank, world, quantization)  # first imports and caches outside the measurement
    tracemalloc.start()
    try:
        _load(checkpoint, ops, rank, world, quantization)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    shard = _shard_bytes_fp32(checkpoint) // world
    # a tensor's slice, the parameter it is assembled into and the device copy; quantizing adds an fp32 copy of
    # one matrix and formats.quantize_weight_only's temporaries (a few more fp32 copies of it)
    bound = (8 if quantization else 4) * _largest_tensor_bytes_fp32(checkpoint) + (256 << 10)
    assert peak <= bound < shard, (peak, bound, shard)


def test_loading_reports_its_progress_up_to_the_whole_checkpoint(checkpoint, ops):
    ticks = []
    with load_progress.reporting_to(lambda phase, done, total: ticks.append((phase, done, total))):
        _load(checkpoint, ops, 1, 2)
    total = sum(i["data_offsets"][1] - i["data_offsets"][0] for s in checkpoint.glob("*.safetensors")
                for i in safetensors_io.read_header(s)[0].values())
    assert ticks and ticks[-1] == ("weights", total, total)
    assert [d for _, d, _ in ticks] == sorted(d for _, d, _ in ticks)


def test_a_transposed_read_is_a_contiguous_copy_of_the_transpose(tmp_path):
    a = np.random.default_rng(1).standard_normal((700, 300)).astype(np.float32)
    safetensors_io.save_file({"a": a}, tmp_path / "x.safetensors", bf16={"a"})
    with safetensors_io.SafetensorsReader(tmp_path / "x.safetensors") as reader:
        t = reader.read("a", 1, np.arange(10, 290), transpose=True)
    assert t.flags.c_contiguous and np.array_equal(t, a.astype(ml_dtypes.bfloat16)[:, 10:290].T)
