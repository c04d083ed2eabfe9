"""The kernels execution backend against the reference backend (its oracle), under triton's interpreter:
same greedy tokens and logits within float32 summation-order error, batched, with prefix caching, chunked
prefill, preemption, the CPU swap tier and ngram verification; on the tiny model and on the HF-parity
shapes (one KV head, head_dim 24 and 80, dense, tied / untied, MoE interval 2)."""
from __future__ import annotations

import numpy as np
import pytest

from ernie_serve import SamplingParams
from ernie_serve.sampling_params import GuidedDecodingParams
from ernie_serve.chat import render_chat_prompt
from kb_helpers import SHAPES, engine, greedy, prefill_step, prefill_then_decode, prompts, step_logits, write

LOGIT_TOL = 2e-4  # max |kernels - reference| / max |reference| per step (fp32 both sides)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_greedy_tokens_equal_the_reference_backend_batched(framework, tiny_model_dir):
    ids = prompts(4096, (5, 23, 70))
    ref = greedy(engine(tiny_model_dir, "reference"), ids)
    got = engine(tiny_model_dir, "kernels")
    assert got.engine.runner.executor.ops.name == framework
    assert greedy(got, ids) == ref


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape_ckpt(request, tmp_path_factory):
    return request.param, write(tmp_path_factory.mktemp(request.param), SHAPES[request.param])


def test_logits_and_tokens_match_the_reference_on_the_parity_shapes(shape_ckpt):
    name, ckpt = shape_ckpt
    vocab = SHAPES[name]["vocab_size"]
    ref, ker = engine(ckpt, "reference"), engine(ckpt, "kernels")
    step = prefill_step([9, 33], vocab)
    want, got = step_logits(ref, step), step_logits(ker, step)
    assert got.shape == want.shape == (42, vocab)
    assert _rel(got, want) < LOGIT_TOL, name
    ids = prompts(vocab, (7, 30))
    assert greedy(ker, ids) == greedy(ref, ids), name


def test_prefix_caching_chunked_prefill_and_preemption_match_the_reference(tiny_model_dir):
    # 12 blocks of 16 tokens for four growing sequences forces preemption; a 24-token budget chunks the
    # 70-token prompt; the last prompt shares the first one's 48-token prefix (3 full blocks)
    ids = prompts(4096, (50, 70, 33))
    ids.append(ids[0][:48] + [11, 12, 13])
    kw = dict(num_gpu_blocks_override=12, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = greedy(engine(tiny_model_dir, "reference", **kw), ids, params)
    ker = engine(tiny_model_dir, "kernels", **kw)
    assert greedy(ker, ids, params) == ref
    stats = ker.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] >= 48
    assert stats["num_free_blocks"] == 12


def test_swap_tier_and_ngram_verification_match_the_reference(tiny_model_dir):
    # a 9-block pool (128 tokens) with a CPU tier, one sequence at a time: the first prompt's prefix is
    # evicted to the tier and swapped back in for the last; on the chat prompt the demo model's answer repeats
    # the question, so ngram drafts make multi-token verification steps (short queries over cached KV)
    kw = dict(num_gpu_blocks_override=9, swap_space=0.01, max_num_seqs=1, max_model_len=128, skip=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    ref = engine(tiny_model_dir, "reference", **kw)
    chat = render_chat_prompt(ref.engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}],
                              None, None, None)[1]
    first = prompts(4096, (40,))[0]
    batch = [first, chat, prompts(4096, (60,))[0], first[:32] + [7, 8]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ker = engine(tiny_model_dir, "kernels", **kw)
    assert greedy(ker, batch, params) == greedy(ref, batch, params)
    stats = ker.engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["prefix_cache_host_hit_tokens"] > 0


def test_steps_sample_on_the_device_unless_they_need_the_logits_on_the_host(framework, tiny_model_dir, monkeypatch):
    from ernie_serve.kernels_backend.device_sampling import KernelLogits

    copies = []
    numpy = KernelLogits.numpy
    monkeypatch.setattr(KernelLogits, "numpy", lambda self: (copies.append(1), numpy(self))[1])
    ids = prompts(4096, (5, 23))
    ref, ker = engine(tiny_model_dir, "reference"), engine(tiny_model_dir, "kernels")
    assert greedy(ker, ids) == greedy(ref, ids) and not copies  # greedy: each row's argmax crossed, no logits
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=6, ignore_eos=True, seed=7)
    first, again = (greedy(ker, ids, seeded) for _ in range(2))
    assert first == again and not copies  # sampled on the device, reproducibly
    # penalties and the min_tokens mask are applied on the device too: the reference's tokens, no logits copied
    penalized = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, repetition_penalty=1.3,
                               presence_penalty=0.4, frequency_penalty=0.2)
    assert greedy(ker, ids, penalized) == greedy(ref, ids, penalized) and not copies
    # logprobs leave the device as each row's top few, not as the logits: both backends give the same ones
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    want, got = (llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False) for llm in (ref, ker))
    assert not copies
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
    # a grammar's mask crosses to the device as its rows' bias: the reference's tokens, no logits copied
    guided = SamplingParams(temperature=0, max_tokens=3, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    ref_tok, ker_tok = (engine(tiny_model_dir, b, skip=False) for b in ("reference", "kernels"))
    assert greedy(ker_tok, ids, guided) == greedy(ref_tok, ids, guided) and not copies


@pytest.mark.parametrize("prefill_backend", ["kernels", "reference"])
def test_prefill_decode_disaggregation_hands_kv_to_a_kernels_decode_engine(tiny_model_dir, prefill_backend):
    # splitwise_role's engine half: a prefill engine holds a finished request's KV, exports it (host float32 blocks,
    # the same format from either backend, across the wire format), a kernels decode engine continues it
    ids = prompts(4096, (45,))[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = greedy(engine(tiny_model_dir, "kernels"), [ids], params)[0]
    decode = engine(tiny_model_dir, "kernels", enable_prefix_caching=False)
    assert prefill_then_decode(engine(tiny_model_dir, prefill_backend), decode, ids, params) == want