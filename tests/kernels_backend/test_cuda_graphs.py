"""Decode CUDA graphs, model-free where possible: the capture sizes, which steps replay, and padded replays
over the persistent step buffers giving the eager tokens (on CPU a graph's replay is emulated by rerunning
the captured function on the same buffers, which is what a CUDA graph replay does to them)."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve.step_contract import KVOp, StepInput
from ernie_serve.kernels_backend.cuda_graphs import CudaGraphRunner, bucket_for, graph_batch_sizes, is_decode_only
from ernie_serve.kernels_backend.framework import Graph
from kb_helpers import engine, greedy, prompts


@pytest.mark.parametrize("max_seqs,sizes", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                            (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_capture_sizes_cover_every_batch_up_to_max_num_seqs(max_seqs, sizes):
    assert graph_batch_sizes(max_seqs) == sizes
    for b in range(1, max_seqs + 1):
        size = bucket_for(b, sizes)
        assert size >= b and size - b <= 7 and (b > 2 or size == b)
    assert bucket_for(max_seqs + 1, sizes) is None
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        graph_batch_sizes(0)


def _decode(b: int, **kw) -> StepInput:
    fields = dict(token_ids=np.arange(b), positions=np.full(b, 5), query_start_loc=np.arange(b + 1),
                  seq_lens=np.full(b, 6), block_tables=np.arange(b)[:, None], slot_mapping=np.arange(b) * 16 + 5,
                  sample_rows=np.arange(b))
    fields.update(kw)
    return StepInput(**{k: np.asarray(v, np.int64) if k != "kv_ops" else v for k, v in fields.items()})


def test_only_plain_decode_steps_replay():
    assert is_decode_only(_decode(3))
    assert not is_decode_only(_decode(2, token_ids=[1, 2, 3], positions=[0, 1, 2], query_start_loc=[0, 2, 3],
                                      slot_mapping=[0, 1, 16]))  # a 2-token query (prefill chunk or verification)
    assert not is_decode_only(_decode(2, sample_rows=[1]))  # a row that does not sample
    assert not is_decode_only(_decode(2, kv_ops=[KVOp("swap_in", 0, 1)]))  # blocks move first
    assert not is_decode_only(StepInput())


class RerunGraph(Graph):
    """CPU stand-in for a CUDA graph: capture runs fn once and keeps it; replay reruns it on the buffers."""

    def __init__(self, pool=None):
        self.pool = pool

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        for kept, new in zip(self.out, self.fn()):
            if new is not kept:  # a real graph writes its captured output tensors: do the same
                kept[...] = new


def test_every_graph_captures_into_one_shared_pool_largest_first():
    pools, order = [], []

    class PoolGraph(RerunGraph):
        def capture(self, fn):
            pools.append(self.pool)
            return super().capture(fn)

    runner = CudaGraphRunner(graph_batch_sizes(20), PoolGraph, object)
    runner.capture_all(lambda size: (order.append(size), size)[1], lambda size: [np.zeros(size)])
    assert order == [20, 16, 8, 4, 2, 1]
    assert len(pools) == 6 and pools[0] is not None and all(p is pools[0] for p in pools)


def test_padded_decode_replays_give_the_eager_tokens(tiny_model_dir):
    ids = prompts(4096, (5, 23, 40))
    kw = dict(max_num_seqs=3)
    eager = greedy(engine(tiny_model_dir, "kernels", **kw), ids)
    llm = engine(tiny_model_dir, "kernels", **kw)
    shard = llm.engine.runner.executor
    shard.graphs = CudaGraphRunner(graph_batch_sizes(3), RerunGraph, object)
    shard.graphs.capture_all(shard._fill_padding, shard._graph_forward)
    assert sorted(shard.graphs.graphs) == [1, 2, 3]
    assert greedy(llm, ids) == eager
    assert shard.graphs.replays > 0
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.kv.pool.num_blocks


def test_step_buffers_pad_a_decode_step_with_rows_that_touch_nothing(tiny_model_dir):
    llm = engine(tiny_model_dir, "kernels", max_num_seqs=8)
    shard = llm.engine.runner.executor
    st = shard.buffers.fill(_decode(3), 16, pad_seqs_to=8)
    host = shard.ops.to_host
    np.testing.assert_array_equal(host(st.slot_mapping), [5, 21, 37, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(host(st.query_start_loc), np.arange(9))
    np.testing.assert_array_equal(host(st.seq_lens), [6, 6, 6, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(host(st.logit_rows), np.arange(8))
    assert host(st.block_tables).shape == (8, shard.buffers.max_blocks) and st.block_q * 1 >= 1
    with pytest.raises(ValueError, match="exceeds the buffers"):
        shard.buffers.fill(_decode(9), 16)


def test_the_runtime_refuses_what_cannot_take_effect(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="use_cudagraph=True is not supported here: CUDA graphs need a GPU"):
        engine(tiny_model_dir, "kernels", use_cudagraph=True)
    with pytest.raises(ValueError, match="gpu_memory_utilization is not supported here"):
        engine(tiny_model_dir, "kernels", gpu_memory_utilization=0.5)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="execution_backend='kernels' needs a CUDA GPU"):
        engine(tiny_model_dir, "kernels")


def test_split_kv_decodes_eager_and_replayed_give_the_reference_tokens(tiny_model_dir, monkeypatch):
    """Long contexts at a small batch split their keys (as on a GPU with more SMs than the step has programs),
    prefill and decodes; the captured graphs split by the longest context a bucket can see, so every replay
    holds to its capture."""
    import ernie_kernels.unified_attention as ua

    ids = prompts(4096, (150, 270))
    kw = dict(max_num_seqs=2, max_model_len=512)
    want = greedy(engine(tiny_model_dir, "reference", **kw), ids)
    splits = []
    launch = ua.unified_attention
    monkeypatch.setattr(ua, "unified_attention", lambda *a, **k: (splits.append(k["num_splits"]), launch(*a, **k))[1])
    for graphs in (False, True):
        llm = engine(tiny_model_dir, "kernels", **kw)
        shard = llm.engine.runner.executor
        shard.buffers.split_kv_target = 64  # about what 32 SMs ask for
        if graphs:
            shard.graphs = CudaGraphRunner(graph_batch_sizes(2), RerunGraph, object)
            shard.graphs.capture_all(shard._fill_padding, shard._graph_forward)
        splits.clear()
        assert greedy(llm, ids) == want
        assert max(splits) > 1
        assert not graphs or shard.graphs.replays > 0
