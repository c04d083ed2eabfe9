"""MTP speculative decoding on the kernels backend against the reference backend, under triton's interpreter:
the head's logits agree, the drafts are the same ones (so the same number accepted), and greedy output equals
plain decoding, with batching, chunked prefill, preemption, CUDA-graph replays and sampling."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ernie_serve import SamplingParams
from ernie_serve.demo.tiny_model import random_mtp_weights, random_weights
from ernie_serve.paths import demo_data_dir
from ernie_serve.step_contract import StepInput
from ernie_serve.kernels_backend.cuda_graphs import CudaGraphRunner, graph_batch_sizes
from ernie_serve.model.checkpoint_writer import write_checkpoint
from kb_helpers import GREEDY, QUANT, SHAPES, engine, greedy, prefill_step, prompts
from test_cuda_graphs import RerunGraph

LOGIT_TOL = 2e-4  # as test_kernels_engine: fp32 on both sides, summation order differs


def _mtp(k: int) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


def _write(tmp_path_factory, name: str):
    config = SHAPES[name]
    d = tmp_path_factory.mktemp(name)
    write_checkpoint(d, config, {**random_weights(config, seed=3), **random_mtp_weights(config, seed=4)})
    return name, d


@pytest.fixture(scope="module", params=["moe_one_kv_head", "dense_one_kv_head_headdim24"])
def mtp_ckpt(request, tmp_path_factory):
    return _write(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def moe_mtp_ckpt(tmp_path_factory):
    return _write(tmp_path_factory, "moe_one_kv_head")


def _head_step(step: StepInput, lengths: list[int]) -> tuple[StepInput, np.ndarray]:
    """The head's catch-up over a prefill step: position t of each sequence with x_{t+1}, t < n - 1; and the rows
    of the target's hidden states it reads (h_t)."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = np.concatenate([s + np.arange(n - 1) for s, n in zip(starts, lengths)])
    q = [n - 1 for n in lengths]
    return StepInput(token_ids=step.token_ids[rows + 1], positions=step.positions[rows],
                     query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int64),
                     seq_lens=np.asarray(q, np.int64), block_tables=step.block_tables,
                     slot_mapping=step.slot_mapping[rows], sample_rows=np.zeros(0, np.int64),
                     max_position=max(q) - 1), rows


def test_the_heads_logits_match_the_reference(mtp_ckpt):
    name, ckpt = mtp_ckpt
    vocab = SHAPES[name]["vocab_size"]
    lengths = [9, 33]
    step = prefill_step(lengths, vocab)
    head_step, rows = _head_step(step, lengths)
    got = {}
    for backend in ("reference", "kernels"):
        ex = engine(ckpt, backend, **_mtp(1)).engine.runner.executor
        hidden, _ = ex.execute(step)
        head = ex.draft_head
        lg = head.logits(head.run(head_step, head.take(hidden, rows)))
        got[backend] = lg if isinstance(lg, np.ndarray) else lg.numpy()
    assert got["kernels"].shape == got["reference"].shape == (sum(lengths) - 2, vocab)
    err = np.abs(got["kernels"] - got["reference"]).max() / np.abs(got["reference"]).max()
    assert err < LOGIT_TOL, name


def test_greedy_output_equals_plain_decoding_under_batching_chunking_and_preemption(moe_mtp_ckpt):
    name, ckpt = moe_mtp_ckpt
    vocab = SHAPES[name]["vocab_size"]
    ids = prompts(vocab, (9, 32, 55, 21))
    kw = dict(num_gpu_blocks_override=8, long_prefill_token_threshold=16, max_num_seqs=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = greedy(engine(ckpt, "reference", **kw), ids, params)
    ref = engine(ckpt, "reference", **kw, **_mtp(2))
    ker = engine(ckpt, "kernels", **kw, **_mtp(2))
    assert greedy(ker, ids, params) == greedy(ref, ids, params) == plain, name
    s, r = ker.engine.stats(), ref.engine.stats()
    assert s["spec_draft_tokens"] > 0 and s["num_preemptions"] > 0
    # the same drafts as the reference's head, so the same ones accepted
    assert (s["spec_draft_tokens"], s["spec_accepted_tokens"]) == (r["spec_draft_tokens"], r["spec_accepted_tokens"])
    assert s["num_free_blocks"] == 8


def test_the_demo_heads_drafts_are_accepted_on_both_frameworks_without_copying_logits(framework, tiny_model_dir,
                                                                                         monkeypatch):
    from ernie_serve.kernels_backend.device_sampling import KernelLogits

    ids = prompts(4096, (12, 30))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = greedy(engine(tiny_model_dir, "reference"), ids, params)
    ker = engine(tiny_model_dir, "kernels", **_mtp(1))
    assert ker.engine.runner.executor.ops.name == framework
    copies = []
    numpy = KernelLogits.numpy
    monkeypatch.setattr(KernelLogits, "numpy", lambda self: (copies.append(1), numpy(self))[1])
    assert greedy(ker, ids, params) == plain
    # greedy drafts are the head's argmax on the device, and greedy verification samples there too
    assert ker.engine.stats()["spec_draft_tokens"] > 0 and not copies


def test_decode_graph_replays_hand_the_drafter_their_hidden_states(tiny_model_dir):
    # drafts stop one token before max_tokens, so the last steps are decode-only and replay a graph
    ids = prompts(4096, (5, 23))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = greedy(engine(tiny_model_dir, "kernels", max_num_seqs=2, **_mtp(1)), ids, params)
    llm = engine(tiny_model_dir, "kernels", max_num_seqs=2, **_mtp(1))
    shard = llm.engine.runner.executor
    shard.graphs = CudaGraphRunner(graph_batch_sizes(2), RerunGraph, object)
    shard.graphs.capture_all(shard._fill_padding, shard._graph_forward)
    assert greedy(llm, ids, params) == eager
    assert shard.graphs.replays > 0


SAMPLED = {
    "top_p": (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True, seed=1), "base"),
    # two completions a prompt, a penalty over prompt + output (drafts included), logprobs, the rejection method
    "n2_penalty_logprobs_rejection": (SamplingParams(n=2, temperature=0.7, top_k=20, repetition_penalty=1.2,
                                                     logprobs=2, max_tokens=8, ignore_eos=True, seed=2), "rejection"),
}


@pytest.mark.parametrize("case", sorted(SAMPLED))
def test_sampled_drafts_are_drawn_and_verified_on_the_device_as_the_reference_does(case, tiny_model_dir,
                                                                                    monkeypatch):
    from ernie_serve.kernels_backend.device_sampling import KernelLogits

    params, method = SAMPLED[case]
    monkeypatch.setenv("FD_SAMPLING_CLASS", method)
    ref = engine(tiny_model_dir, "reference", skip=False, **_mtp(2))
    # the demo chats, which the demo head was fitted on: some drafts are kept
    chats = [json.loads(line) for line in (demo_data_dir() / "chat_demo.jsonl").read_text().splitlines() if line]
    ids = [ref.engine.tokenizer.apply_chat_template(c["messages"], tokenize=True) for c in chats[:3]]
    want = [c for o in ref.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False) for c in o.outputs]
    llm = engine(tiny_model_dir, "kernels", **_mtp(2))
    copies = []
    numpy = KernelLogits.numpy
    monkeypatch.setattr(KernelLogits, "numpy", lambda self: (copies.append(1), numpy(self))[1])
    got = [c for o in llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False) for c in o.outputs]
    # the same seeds draw the same drafts, keep the same ones and resample the same residuals
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and not copies
    if params.logprobs is not None:
        for g, w in zip(got, want):
            for gd, wd in zip(g.logprobs, w.logprobs):
                assert gd.keys() == wd.keys()
                np.testing.assert_allclose([gd[t].logprob for t in wd], [wd[t].logprob for t in wd], atol=2e-3)
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # and some resampled
    assert stats["num_free_blocks"] == llm.engine.kv.pool.num_blocks


def test_a_checkpoint_without_a_head_is_refused_at_start(tmp_path):
    config = SHAPES["moe_one_kv_head"]
    write_checkpoint(tmp_path, config, random_weights(config, seed=3))
    with pytest.raises(ValueError, match="has no MTP-head tensors"):
        engine(tmp_path, "kernels", **_mtp(1))


def test_a_c8_cache_with_dynamic_scales_gives_the_head_its_own_layer_and_static_scales_are_refused(tmp_path):
    from ernie_serve.model.quantize_checkpoint import quantize_checkpoint

    config = dict(QUANT, quantization_config={"kv_cache_quant_type": "int8"})
    dynamic = tmp_path / "c8dyn"
    write_checkpoint(dynamic, config, {**random_weights(config, seed=3), **random_mtp_weights(config, seed=4)})
    llm = engine(dynamic, "kernels", **_mtp(1))
    cache = llm.engine.runner.executor.cache
    assert cache.int8 and cache.num_layers == QUANT["num_hidden_layers"] + 1 and len(cache.dynamic) == cache.num_layers
    outs = llm.generate(prompt_token_ids=prompts(QUANT["vocab_size"], (6, 25)), sampling_params=GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["num_free_blocks"] == llm.engine.kv.pool.num_blocks
    static = quantize_checkpoint(dynamic, tmp_path / "c8static", "wint8", kv_cache_int8=True)
    with pytest.raises(ValueError, match="'mtp' with a C8 KV cache of static scales"):
        engine(static, "kernels", **_mtp(1))
