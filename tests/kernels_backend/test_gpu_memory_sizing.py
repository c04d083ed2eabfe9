"""The KV pool's size on a GPU, model-free: what is read when, and what is reserved beside the blocks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.kernels_backend import loading

GiB = 1 << 30


class MemoryOps:
    """A device whose free memory drops by `first_use` at the first forward (NCCL's buffers, cuBLAS workspaces) and
    whose allocator caches `cached` bytes after it until released."""

    def __init__(self, total: int, in_use: int, first_use: int = 0, cached: int = 0):
        self.total, self.in_use, self.first_use, self.cached = total, in_use, first_use, cached
        self.calls: list[str] = []

    def memory_info(self):
        self.calls.append("memory_info")
        return self.total - self.in_use, self.total

    def release_cached(self):
        self.calls.append("release_cached")
        self.in_use -= self.cached
        self.cached = 0


def _size(monkeypatch, ops: MemoryOps, forward_peak: int, decode_peak: int, **config) -> int:
    def forward(cfg, o, model):
        o.calls.append("profile_forward")
        o.in_use += o.first_use + o.cached
        return forward_peak

    def decode(cfg, o, model):
        o.calls.append("profile_decode")
        return decode_peak

    monkeypatch.setattr(loading, "profile_forward_peak", forward)
    monkeypatch.setattr(loading, "profile_decode_peak", decode)
    model = SimpleNamespace(weights=SimpleNamespace(nbytes=10 * GiB))
    return loading.gpu_kv_blocks(EngineConfig(**config), ops, model, per_block=GiB)


def test_free_memory_is_read_after_the_profile_and_with_the_allocator_cache_released(monkeypatch):
    ops = MemoryOps(total=100 * GiB, in_use=10 * GiB, first_use=2 * GiB, cached=5 * GiB)
    blocks = _size(monkeypatch, ops, forward_peak=3 * GiB, decode_peak=0, gpu_memory_utilization=0.9)
    assert ops.calls == ["profile_forward", "release_cached", "memory_info"]
    assert blocks == 90 - (10 + 2) - 3  # NCCL's 2 GiB counted, the allocator's cached 5 GiB not


def test_cuda_graphs_reserve_their_shared_pool_before_the_kv_blocks(monkeypatch):
    plain = _size(monkeypatch, MemoryOps(100 * GiB, 10 * GiB), 3 * GiB, 4 * GiB)
    ops = MemoryOps(100 * GiB, 10 * GiB)
    graphs = _size(monkeypatch, ops, 3 * GiB, 4 * GiB, use_cudagraph=True)
    assert ops.calls == ["profile_forward", "profile_decode", "release_cached", "memory_info"]
    assert plain - graphs == 4


def test_a_model_that_leaves_nothing_names_the_graph_pool(monkeypatch):
    with pytest.raises(ValueError, match="does not fit.*6.0 GiB CUDA graph pool"):
        _size(monkeypatch, MemoryOps(100 * GiB, 82 * GiB), 3 * GiB, 6 * GiB, use_cudagraph=True)


def test_the_profiles_run_the_kernels_model_a_forward_a_decode_and_a_sampling_pass(tiny_model_dir, framework):
    from kb_helpers import engine

    llm = engine(tiny_model_dir, "kernels", max_num_seqs=4, max_num_batched_tokens=96, max_model_len=64)
    shard = llm.engine.runner.executor
    config = llm.engine.config
    sampled = []
    from ernie_serve.kernels_backend.device_sampling import KernelLogits

    chunks = []
    sample, top = KernelLogits.sample, KernelLogits.top_logprobs
    KernelLogits.sample = lambda self, *a: (sampled.append(int(self.logits.shape[0])), sample(self, *a))[1]
    KernelLogits.top_logprobs = lambda self, rows, *a: (chunks.append((int(self.raw.shape[0]), len(rows))),
                                                        top(self, rows, *a))[1]
    try:
        assert loading.profile_forward_peak(config, shard.ops, shard.model) >= 0
        assert loading.profile_decode_peak(config, shard.ops, shard.model) >= 0
    finally:
        KernelLogits.sample, KernelLogits.top_logprobs = sample, top
    assert sampled == [4, 4]  # max_num_seqs rows each: the forward's logits rows, the decode's sequences
    assert chunks == [(96, 96)]  # prompt logprobs on: every token's logits, then one chunk of their logprobs
