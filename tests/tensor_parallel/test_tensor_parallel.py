"""Tensor and expert parallelism over real worker processes and gloo collectives (CPU).

Each case builds the same checkpoint at 1 rank and at 2 (tensor parallel, and expert parallel for MoE
models): the logits of a prefill and of a step over the cached prefix agree within 1e-4 relative, and
greedy generation (chunked prefill, prefix caching) gives identical tokens. Checkpoints are random, in
the shapes the HF parity test covers: one KV head (replicated on both ranks), head_dim != H / heads,
tied and untied heads, dense and MoE layers, both checkpoint layouts.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from ernie_serve import LLM, SamplingParams
from ernie_serve.config import EngineConfig
from ernie_serve.demo.tiny_model import random_weights
from ernie_serve.engine.async_engine import AsyncEngine, EngineDeadError
from ernie_serve.engine.llm_engine import LLMEngine
from ernie_serve.step_contract import StepInput
from ernie_serve.model.attention import AttentionMetadata
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.quantize_checkpoint import quantize_checkpoint, shard_checkpoint

VOCAB = 512
BASE = dict(architectures=["Ernie4_5_MoeForCausalLM"], vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, max_position_embeddings=4096,
            rms_norm_eps=1e-5, rope_theta=500000.0, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
            moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, tie_word_embeddings=True)
CASES = {
    "moe_kv2_headdim24_tied_paddle": (dict(BASE, head_dim=24), "paddle"),
    "moe_one_kv_head_untied_noshared": (dict(BASE, num_key_value_heads=1, tie_word_embeddings=False,
                                             moe_num_shared_experts=0, moe_layer_interval=2), "pt"),
    "dense_one_kv_head_headdim24": (dict(BASE, architectures=["Ernie4_5ForCausalLM"], moe_num_experts=0,
                                         num_key_value_heads=1, head_dim=24, tie_word_embeddings=False), "pt"),
}
ENGINE = dict(max_model_len=128, max_num_seqs=8, block_size=16, num_gpu_blocks_override=64,
              max_num_batched_tokens=32, skip_tokenizer_init=True, disable_progress_bar=True, enable_logprob=True)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [np.random.default_rng(i).integers(3, VOCAB, size=n).tolist() for i, n in enumerate((23, 5, 40, 1))]


def _checkpoint(root, name: str):
    config, layout = CASES[name]
    tensors = random_weights(config, seed=sorted(CASES).index(name))
    if layout == "paddle":
        tensors = pt_to_paddle(tensors, ErnieModelConfig.from_dict(config))
    write_checkpoint(root / name, config, tensors)
    return root / name


@pytest.fixture(scope="module", params=["tiny"] + sorted(CASES))
def engines(request, tmp_path_factory, tiny_model_dir):
    """{"tp1": LLM, "tp2": LLM, ("ep2": LLM for MoE models)} on one checkpoint."""
    name = request.param
    path = tiny_model_dir if name == "tiny" else _checkpoint(tmp_path_factory.mktemp("tp"), name)
    llms = {"tp1": LLM(model=str(path), **ENGINE), "tp2": LLM(model=str(path), tensor_parallel_size=2, **ENGINE)}
    if llms["tp1"].engine.model_config.is_moe:
        llms["ep2"] = LLM(model=str(path), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE)
    yield name, llms
    for llm in llms.values():
        llm.engine.close()


def _logits(llm: LLM, prompt: list[int], extra: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Logits of every position of a prefill, then of a 3-token step that attends to its cached KV.
    The step writes the pool's last blocks, which the generation test's few requests never reach."""
    executor, bs = llm.engine.runner.executor, 16
    n, m = len(prompt), len(extra)
    blocks = list(range(64 - (-(-(n + m) // bs)), 64))
    slots = lambda pos: np.asarray(blocks, np.int64)[pos // bs] * bs + pos % bs  # noqa: E731
    out = []
    for ids, start in ((prompt, 0), (extra, n)):
        pos = np.arange(start, start + len(ids))
        meta = AttentionMetadata.build([len(ids)], [start + len(ids)], [blocks], bs, slots(pos), int(pos[-1]))
        step = StepInput.for_tokens(np.asarray(ids, np.int64), pos, meta, np.arange(len(ids)), [],
                                    np.array([-1]))  # a row key no Request has (they count from 0)
        out.append(executor.execute(step)[1].numpy())
    return out[0], out[1]


def test_logits_of_every_parallel_layout_match_one_rank(engines):
    name, llms = engines
    ref = _logits(llms["tp1"], PROMPTS[0], [7, 8, 9])
    for kind, llm in llms.items():
        for got, want in zip(_logits(llm, PROMPTS[0], [7, 8, 9]), ref):
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), (name, kind)


def test_greedy_tokens_of_every_parallel_layout_equal_one_rank(engines):
    name, llms = engines
    ref = [o.outputs[0].token_ids for o in llms["tp1"].generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                use_tqdm=False)]
    for kind, llm in llms.items():
        got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                           use_tqdm=False)]
        assert got == ref, (name, kind)


def test_prompt_logprobs_of_every_parallel_layout_equal_one_rank(engines):
    """The prompt's rows come back from the ranks after the sampled ones, in 32-token chunks."""
    name, llms = engines
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)

    def figures(llm):
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
        return [[None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in o.prompt_logprobs]
                for o in outs]

    ref = figures(llms["tp1"])
    assert [len(r) for r in ref] == [len(p) for p in PROMPTS]
    for kind, llm in llms.items():
        for got, want in zip(figures(llm), ref):
            assert got[0] is None and all(set(g) == set(w) for g, w in zip(got[1:], want[1:])), (name, kind)
            for g, w in zip(got[1:], want[1:]):
                for t in w:
                    assert abs(g[t][0] - w[t][0]) <= 1e-4 * max(1.0, abs(w[t][0])), (name, kind)


def test_a_layout_the_model_cannot_take_is_refused_before_any_worker_starts(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=3, **ENGINE))


@pytest.fixture(scope="module")
def w4a8_checkpoints(tmp_path_factory, tiny_model_dir):
    """The seeds' W4A8C8-TP4 deployment in miniature: pre-quantized W4A8 checkpoints (with and without the
    C8 cache's static scales), the first also split per rank (rank0/, rank1/)."""
    root = tmp_path_factory.mktemp("w4a8")
    quantize_checkpoint(tiny_model_dir, root / "w4a8", "w4a8")
    quantize_checkpoint(tiny_model_dir, root / "w4a8c8", "w4a8", kv_cache_int8=True)
    shard_checkpoint(root / "w4a8", root / "w4a8_split", 2)
    return root


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                         use_tqdm=False)]


NEAR_TIE = 0.05  # logprob gap under which int8-activation rounding flips (above) may swap the top two tokens


def _assert_same_greedy_tokens_but_near_ties(llm: LLM, ref: LLM, kind: str) -> None:
    """Greedy tokens equal the reference's, except that a sequence may take the reference's second choice where
    that one's logprob is within NEAR_TIE of the first (the sequences are not compared past that point)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = [llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False) for llm in (llm, ref)]
    for got, want in zip(*outs):
        g, w = got.outputs[0], want.outputs[0]
        i = next((k for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        if i is None:
            assert g.token_ids == w.token_ids, kind
            continue
        chosen = w.logprobs[i]
        assert g.token_ids[i] in chosen, (kind, i, g.token_ids[i], chosen)
        gap = chosen[w.token_ids[i]].logprob - chosen[g.token_ids[i]].logprob
        assert gap <= NEAR_TIE, (kind, i, gap)


def test_a_prequantized_w4a8_checkpoint_gives_one_rank_s_logits_and_tokens_on_two(w4a8_checkpoints, tiny_model_dir):
    """The same quantized weights on every layout (split in quantized form, or read from rank directories).
    Logits agree up to int8-activation rounding flips: a rank's partial sums, added in another order, and its
    wint8 dense layers taking their shard of each row at 16-bit precision (cpu_qgemm.c scales a row by its own
    max), can move a w4a8 activation across a rounding boundary (rows of the three-token step, measured), which
    moves the logits by far less than the quantization error itself, but enough to swap two tokens whose logprobs
    are 0.02 apart (the embedded model built 2026-12-05: PROMPTS[0]'s fifth token, 1303 vs 3675)."""
    root = w4a8_checkpoints
    fp32 = _logits(LLM(model=str(tiny_model_dir), **ENGINE), PROMPTS[0], [7, 8, 9])
    llms = {"tp1": LLM(model=str(root / "w4a8"), **ENGINE),
            "tp2": LLM(model=str(root / "w4a8"), tensor_parallel_size=2, **ENGINE),
            "ep2": LLM(model=str(root / "w4a8"), tensor_parallel_size=2, enable_expert_parallel=True, **ENGINE),
            "tp2_presharded": LLM(model=str(root / "w4a8_split"), tensor_parallel_size=2, **ENGINE)}
    try:
        ref = _logits(llms["tp1"], PROMPTS[0], [7, 8, 9])
        for kind, llm in llms.items():
            for got, expected, f in zip(_logits(llm, PROMPTS[0], [7, 8, 9]), ref, fp32):
                assert np.abs(got - expected).mean() <= 0.2 * np.abs(expected - f).mean(), kind
            _assert_same_greedy_tokens_but_near_ties(llm, llms["tp1"], kind)
    finally:
        for llm in llms.values():
            llm.engine.close()


def test_w4a8_with_the_c8_cache_on_two_ranks_differs_from_one_only_by_rounding_flips(w4a8_checkpoints, tiny_model_dir):
    """With int8 activations and an int8 cache, the ranks' partial sums (added in another order) and their wint8
    layers' 16-bit activations (scaled by each rank's shard of a row) move a few values across a rounding boundary:
    cache codes differ by at most two steps in a few places, except where such a flip moved one token to another
    expert (measured: one token from layer 3 on, its K/V ~30 steps apart), and the logits by much less than the
    quantization error itself."""
    fp32 = _logits(LLM(model=str(tiny_model_dir), **ENGINE), PROMPTS[0], [7, 8, 9])
    one = LLM(model=str(w4a8_checkpoints / "w4a8c8"), **ENGINE)
    two = LLM(model=str(w4a8_checkpoints / "w4a8c8"), tensor_parallel_size=2, **ENGINE)
    try:
        a, b = _logits(one, PROMPTS[0], [7, 8, 9]), _logits(two, PROMPTS[0], [7, 8, 9])
        c1, c2 = one.engine.runner.cache, two.engine.runner.cache.rank0
        assert c1.quant is not None and c1.quant.static and c2.quant is not None and c2.quant.static
        heads = c2.k[0].shape[-2]  # rank 0 holds the first of the model's KV heads
        for layer in range(len(c1.k)):
            for x, y in ((c1.k[layer], c2.k[layer]), (c1.v[layer], c2.v[layer])):
                diff = np.abs(x[..., :heads, :].astype(np.int16) - y.astype(np.int16))
                rerouted = {tuple(t) for t in np.argwhere(diff > 2)[:, :2]}  # (block, slot): tokens
                assert len(rerouted) <= 1 and (diff > 0).mean() < 0.02, layer
        for got, want, ref in zip(b, a, fp32):
            assert np.abs(got - want).mean() <= 0.3 * np.abs(want - ref).mean()
        assert all(len(t) == GREEDY.max_tokens for t in _tokens(two))
    finally:
        two.engine.close()


def test_a_c8_cache_crosses_as_int8_codes_and_comes_back_on_the_same_ranks_unchanged(w4a8_checkpoints):
    """P/D with the C8 cache (the seeds' W4A8C8 at TP4, here TP2 a side): the blocks cross as int8 codes with their
    static scales (a quarter of float32's bytes); each decode rank stores its heads' codes as they came, so the
    pair gives the mixed TP2 engine's own tokens."""
    kw = dict(ENGINE, tensor_parallel_size=2)
    prefill, decode = (LLM(model=str(w4a8_checkpoints / "w4a8c8"), **kw) for _ in range(2))
    try:
        want = _tokens(decode)[0]
        rid = "c8"
        prefill.engine.add_request(rid, PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                   hold_kv=True)
        while prefill.engine.has_unfinished_requests():
            prefill.engine.step()
        from ernie_serve.engine.kv_transfer import KVTransfer

        exported = prefill.engine.export_kv(rid)
        assert exported.blocks.dtype == "int8" and exported.blocks.scale_kind == "static"
        final = decode.engine.add_prefilled_request(KVTransfer.from_frames(exported.to_frames()), GREEDY)
        while final is None:
            final = next((o for o in decode.engine.step() if o.request_id == rid and o.finished), None)
        assert list(final.outputs[0].token_ids) == list(want)
    finally:
        prefill.engine.close()
        decode.engine.close()


def test_online_quantization_under_tensor_parallelism_quantizes_each_rank_slice(tiny_model_dir):
    """--quantization wint8 at 2 ranks: each rank quantizes its slice, so the logits are not bit-equal to
    one rank's wint8, but as close to the fp32 model as one rank's quantization is. (The typical row: a
    few rows route a token to another expert under either quantization, and differ by much more.)"""
    fp32 = _logits(LLM(model=str(tiny_model_dir), **ENGINE), PROMPTS[0], [7, 8, 9])[0]
    one = LLM(model=str(tiny_model_dir), quantization="wint8", **ENGINE)
    two = LLM(model=str(tiny_model_dir), tensor_parallel_size=2, quantization="wint8", **ENGINE)
    try:
        err_one = np.median(np.abs(_logits(one, PROMPTS[0], [7, 8, 9])[0] - fp32).max(axis=1))
        err_two = np.median(np.abs(_logits(two, PROMPTS[0], [7, 8, 9])[0] - fp32).max(axis=1))
    finally:
        two.engine.close()
    assert 0 < err_two <= 2 * err_one, (err_one, err_two)


def test_a_quantized_split_that_breaks_the_format_s_groups_is_refused_at_start_up(tmp_path, tiny_model_dir):
    """block_wise_fp8 scales 128x128 blocks; the tiny model's 32-wide heads put two ranks' columns in one."""
    quantize_checkpoint(tiny_model_dir, tmp_path / "fp8", "block_wise_fp8")
    with pytest.raises(Exception, match=r"do not fall on block_wise_fp8's 128-column groups"):
        LLMEngine(EngineConfig(model=str(tmp_path / "fp8"), tensor_parallel_size=2, **ENGINE))


def _causes(err: BaseException) -> list[BaseException]:
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(nxt)
    return chain


@pytest.mark.parametrize("stopped_first", [False, True], ids=["between_steps", "inside_a_collective"])
def test_a_rank_that_dies_ends_every_request_once_with_an_error_and_the_engine_is_unhealthy(tiny_model_dir, caplog,
                                                                                           stopped_first):
    """The driver learns of the death in one of two ways, which the timing of a loaded machine picks: its liveness
    check before the next step sees the rank gone, or, when the rank was still alive at that check, the step's
    collective fails on rank 0 (gloo: the connection was reset). A rank stopped before the step passes the check
    and dies while rank 0 waits on it inside the step's all-reduce: the second way, every time."""
    config = EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, **dict(ENGINE, max_model_len=512))
    front = AsyncEngine(config)
    finals: dict[str, list] = {}
    streamed, killed, ended = set(), threading.Event(), threading.Event()
    all_streaming = threading.Event()

    def callback(rid):
        def on_output(out, err):
            streamed.add(rid)
            if out.finished:
                finals.setdefault(rid, []).append((out, err))
                if len(finals) == 3:
                    ended.set()
        return on_output

    def hold_the_loop(stats):  # after each step, on the loop thread: once every request streamed, wait for the kill
        if len(streamed) == 3 and not killed.is_set():
            all_streaming.set()
            killed.wait(timeout=60)

    front.step_listeners.append(hold_the_loop)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(3):
        front.add_request(f"r{i}", PROMPTS[i % 3][:20], params, callback(f"r{i}"))
    assert all_streaming.wait(timeout=120)
    (pid,) = front.engine.runner.executor.worker_pids
    if stopped_first:
        os.kill(pid, signal.SIGSTOP)
        killed.set()  # the next step starts: the stopped rank passes the liveness check and never joins the step
        time.sleep(0.5)  # rank 0 is then waiting on it in a collective, or about to; either way the step fails there
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
        killed.set()
    assert ended.wait(timeout=120), "requests did not end after a rank died"
    assert sorted(finals) == ["r0", "r1", "r2"] and all(len(v) == 1 for v in finals.values())
    for out, err in (v[0] for v in finals.values()):
        assert isinstance(err, EngineDeadError) and "tensor-parallel rank 1 (pid" in str(err), err
        assert "killed by signal 9" in str(err)
        assert out.finished and out.outputs[0].finish_reason not in (None, "length", "stop")
    assert not front.is_healthy
    if stopped_first:  # the failed collective came first; the rank's exit then named it
        (failed,) = [r for r in caplog.records if r.exc_info and r.getMessage().startswith("engine step failed")]
        assert any("gloo" in str(e).lower() for e in _causes(failed.exc_info[1])), _causes(failed.exc_info[1])
    with pytest.raises(EngineDeadError):
        front.add_request("late", [5, 6], params, lambda out, err: None)
    front.shutdown(drain=False)


def test_kv_swaps_to_the_cpu_tier_reach_every_rank(tiny_model_dir):
    # 8 device blocks, 4 per request: later requests evict earlier prefixes to the CPU tier, and the repeats
    # are served from it; every rank must swap its own KV heads out and back for the tokens to stay right.
    kw = dict(ENGINE, num_gpu_blocks_override=8, swap_space=0.01, max_num_batched_tokens=64)
    prompts = [np.random.default_rng(i).integers(3, 4000, 50).tolist() for i in (5, 6, 7)]
    order = [prompts[0], prompts[1], prompts[2], prompts[0] + [77], prompts[1] + [78]]
    results = {}
    for tp in (1, 2):
        llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=tp, **kw)
        results[tp] = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                       for p in order]
        assert llm.engine.kv.stats.host_hit_tokens > 0, "expected prefix hits served from the CPU tier"
        llm.engine.close()
    assert results[2] == results[1]


def test_guided_decoding_and_seeded_sampling_are_unchanged_by_tensor_parallelism(tiny_model_dir):
    # Sampling (penalties, grammars, generators) runs on rank 0 over all-gathered logits: it cannot tell.
    from ernie_serve.sampling_params import GuidedDecodingParams

    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=40,
                             guided_decoding=GuidedDecodingParams(regex="(yes|no|maybe) [a-z]{2,8}")),
              SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=16, repetition_penalty=1.2)]
    prompts = ["Is the sky blue?", "Write a word:"]
    texts = {}
    for tp in (1, 2):
        llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=tp, max_model_len=256, block_size=16,
                  num_gpu_blocks_override=64, disable_progress_bar=True)
        texts[tp] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.close()
    assert texts[2] == texts[1]
    assert texts[1][0].split(" ")[0] in ("yes", "no", "maybe")


def _decode_transferred(src: LLM, dst: LLM, rid: str, prompt: list[int]) -> list[int]:
    """Prefill on src (its KV exported whole, every KV head), decode on dst from the imported blocks."""
    from ernie_serve.engine.kv_transfer import KVTransfer

    src.engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), hold_kv=True)
    while src.engine.has_unfinished_requests():
        src.engine.step()
    transfer = KVTransfer.from_frames(src.engine.export_kv(rid).to_frames())
    assert transfer.blocks.shape[4] == src.engine.model_config.num_key_value_heads  # all heads, whatever the ranks
    final = dst.engine.add_prefilled_request(transfer, GREEDY)
    while final is None:
        final = next((o for o in dst.engine.step() if o.request_id == rid and o.finished), None)
    return list(final.outputs[0].token_ids)


def test_prefill_and_decode_at_different_parallel_layouts_give_one_ranks_tokens(engines):
    """P/D under tensor parallelism: the transfer carries every KV head, each rank keeps its own on import, so
    the two sides may differ in layout (KV heads re-sharded, replicated ones included)."""
    name, llms = engines
    ref = [o.outputs[0].token_ids for o in llms["tp1"].generate(prompt_token_ids=PROMPTS[:2], sampling_params=GREEDY,
                                                                use_tqdm=False)]
    pairs = [("tp2", "tp1"), ("tp1", "tp2"), ("tp2", "tp2")] + ([("ep2", "tp2")] if "ep2" in llms else [])
    for src, dst in pairs:
        for i, prompt in enumerate(PROMPTS[:2]):
            got = _decode_transferred(llms[src], llms[dst], f"pd-{src}-{dst}-{i}", prompt)
            assert got == list(ref[i]), (name, src, dst, i)


MTP_CASES = {  # MTP heads split across two ranks: GQA with a MoE target, and one KV head (replicated) at head_dim 24
    "moe_kv2_mtp": dict(BASE, head_dim=16),
    "dense_one_kv_head_headdim24_mtp": dict(BASE, architectures=["Ernie4_5ForCausalLM"], moe_num_experts=0,
                                            num_key_value_heads=1, head_dim=24, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(MTP_CASES))
def test_mtp_under_tensor_and_expert_parallelism_gives_one_ranks_greedy_tokens(tmp_path, name):
    """The head is split as the target's layers are; every rank runs each draft call. Greedy output is TP=1's
    without MTP, under chunked prefill and preemption (too few blocks for every request at once)."""
    from ernie_serve.demo.tiny_model import random_mtp_weights

    config = MTP_CASES[name]
    write_checkpoint(tmp_path / name, config, {**random_weights(config, seed=5), **random_mtp_weights(config, seed=6)})
    opts = dict(ENGINE, num_gpu_blocks_override=8)
    mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    plain = LLM(model=str(tmp_path / name), **opts)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                          use_tqdm=False)]
    plain.engine.close()
    layouts = [dict(tensor_parallel_size=2)] + ([dict(tensor_parallel_size=2, enable_expert_parallel=True)]
                                                if config.get("moe_num_experts") else [])
    for layout in layouts:
        llm = LLM(model=str(tmp_path / name), **opts, **layout, **mtp)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                use_tqdm=False)]
            stats = llm.engine.stats()
            assert got == ref, (name, layout)
            assert stats["spec_draft_tokens"] > 0 and llm.engine.scheduler.num_preemptions > 0, stats
        finally:
            llm.engine.close()


def test_bfloat16_weights_on_every_rank_give_one_ranks_bfloat16_logits(tiny_model_dir, monkeypatch):
    """--dtype bfloat16 reaches the worker ranks: TP2 / EP2 logits equal one bfloat16 rank's up to the bfloat16 KV
    cache's rounding (a rank's partial sums land a K/V value on the other side of a rounding boundary now and then:
    one bfloat16 step in that value), far closer than float32's logits, which a worker left in float32 would move
    them toward. AMX is kept off here (ERNIE_CPU_AMX=0, the workers inherit it): it rounds x to bfloat16 too, and a
    rank's half-width partial sums then flip such roundings in every layer, noise as large as the gap this test
    reads (cpu_amx.c's own tests cover its arithmetic)."""
    from ernie_serve.cpu_kernels import build

    monkeypatch.setenv("ERNIE_CPU_AMX", "0")
    build.library().ernie_set_amx(0)
    try:
        one = LLM(model=str(tiny_model_dir), dtype="bfloat16", **ENGINE)
        ref = _logits(one, PROMPTS[0], [7, 8, 9])
        fp32 = _logits(LLM(model=str(tiny_model_dir), **ENGINE), PROMPTS[0], [7, 8, 9])
        for kw in (dict(), dict(enable_expert_parallel=True)):
            llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", tensor_parallel_size=2, **kw, **ENGINE)
            try:
                for got, want, far in zip(_logits(llm, PROMPTS[0], [7, 8, 9]), ref, fp32):
                    err, gap = np.abs(got - want).max(), np.abs(far - want).max()
                    assert err <= 1e-3 * np.abs(want).max() and err * 10 < gap, (kw, err, gap)
            finally:
                llm.engine.close()
        one.engine.close()
    finally:
        build.library().ernie_set_amx(1)
