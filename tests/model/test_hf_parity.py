"""Parity with an independent implementation: HF transformers' Ernie4_5(_Moe)ForCausalLM.

Random checkpoints are written by transformers' own save_pretrained, so both the tensor names and
the math come from outside this project. Logits must agree within 1e-4 relative (fp32) and greedy
decoding must give the same 32 tokens; the same weights in the "-Paddle" layout give the same logits.
"""
from __future__ import annotations

import shutil
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ernie_serve import LLM, SamplingParams  # noqa: E402
from ernie_serve.cpu_kernels import cpu_gemm  # noqa: E402
from ernie_serve.model.attention import AttentionMetadata  # noqa: E402
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint  # noqa: E402
from ernie_serve.model.config import ErnieModelConfig  # noqa: E402
from ernie_serve.model.loader import load_model  # noqa: E402
from ernie_serve.model.safetensors_io import iter_tensors  # noqa: E402
from hf_models import CONFIGS, VOCAB, hf_model  # noqa: E402

@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory, tiny_model_dir):
    name = request.param
    d = tmp_path_factory.mktemp(name)
    model = hf_model(name)
    model.save_pretrained(d)
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / f, d / f)
    return name, d, model


def _our_logits(model_dir, ids: np.ndarray) -> np.ndarray:
    import paddle

    m = load_model(model_dir, show_progress=False)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None, len(ids) - 1)
    with paddle.no_grad():
        return m.compute_logits(m(paddle.to_tensor(ids), paddle.arange(len(ids)), meta, None)).numpy()


def _prompt(seed: int = 0, n: int = 23) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n)


def test_logits_match_transformers(checkpoint):
    name, d, hf = checkpoint
    ids = _prompt()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    ours = _our_logits(d, ids)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), name


def test_paddle_layout_gives_same_logits(checkpoint, tmp_path):
    name, d, _ = checkpoint
    cfg = ErnieModelConfig.from_pretrained(d)
    tensors = {n: np.array(a) for s in sorted(d.glob("*.safetensors")) for n, a, _ in iter_tensors(s)}
    import json

    write_checkpoint(tmp_path, json.loads((d / "config.json").read_text()), pt_to_paddle(tensors, cfg),
                     max_shard_bytes=200_000)  # several shards + index, as real checkpoints
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = _prompt(1)
    np.testing.assert_allclose(_our_logits(tmp_path, ids), _our_logits(d, ids), rtol=0, atol=1e-5)


def _assert_greedy_tokens_equal(llm: LLM, hf, prompts: list[np.ndarray], n: int, name: str) -> None:
    """The engine's n greedy tokens after each prompt are transformers' generate's."""
    outs = llm.generate(prompt_token_ids=[p.tolist() for p in prompts],
                        sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor(p)[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref, name


def test_greedy_tokens_match_transformers_generate(checkpoint):
    name, d, hf = checkpoint
    llm = LLM(model=str(d), max_model_len=256, block_size=16, disable_progress_bar=True)
    _assert_greedy_tokens_equal(llm, hf, [_prompt(2, 17), _prompt(3, 40)], 32, name)


def test_long_prompt_matches_transformers_through_tiles_and_chunked_prefill(checkpoint):
    """1100 tokens: several query and KV tiles without a cache, and 384-token chunks over the paged cache."""
    name, d, hf = checkpoint
    ids = _prompt(4, 1100)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
        ref_tokens = hf.generate(torch.tensor(ids)[None], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
    ours = _our_logits(d, ids)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max(), name
    llm = LLM(model=str(d), max_model_len=2048, block_size=16, max_num_batched_tokens=384, disable_progress_bar=True)
    out = llm.generate(prompt_token_ids=[ids.tolist()],
                       sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == ref_tokens, name


def test_greedy_tokens_match_transformers_with_a_random_mtp_head(checkpoint, tmp_path):
    """MTP drafts (k=2) from a random head never change the greedy output: still HF's tokens."""
    import json

    from ernie_serve.demo.tiny_model import random_mtp_weights

    name, d, hf = checkpoint
    config = json.loads((d / "config.json").read_text())
    tensors = {n: np.array(a) for s in sorted(d.glob("*.safetensors")) for n, a, _ in iter_tensors(s)}
    write_checkpoint(tmp_path, config, {**tensors, **random_mtp_weights(config, seed=5)})
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(d / f, tmp_path / f)
    prompt = _prompt(5, 29)
    llm = LLM(model=str(tmp_path), max_model_len=256, block_size=16, disable_progress_bar=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    out = llm.generate(prompt_token_ids=[prompt.tolist()],
                       sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt)[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref, name
    assert llm.engine.stats()["spec_draft_tokens"] > 0


def _bf16_rounded_hf(name: str):
    """The HF model with the weights --dtype bfloat16 holds in bfloat16 rounded to it (every projection, the experts,
    the lm_head, and a tied embedding with it), the router and an untied embedding left in float32: the same
    float32 arithmetic on the same values, so an independent oracle for our bfloat16 path. Where our GEMM runs on AMX
    (cpu_gemm.bf16_on_amx: 16 rows or more times a weight whose K is a multiple of 32) it multiplies x rounded to
    bfloat16 too; so does each such projection here, on the rows it is called with."""
    import ml_dtypes

    model = hf_model(name)
    tied = CONFIGS[name].get("tie_word_embeddings")
    routers = {id(p) for pname, p in model.named_parameters() if pname.endswith("mlp.gate.weight")}
    linear, forward = torch.nn.functional.linear, model.forward

    def linear_as_ours(x, w, b=None):  # every projection and expert goes through F.linear
        k = w.shape[-1]
        if id(w) not in routers and cpu_gemm.bf16_on_amx(x.numel() // k, k):
            x = x.to(torch.bfloat16).to(x.dtype)
        return linear(x, w, b)

    def forward_as_ours(*args, **kwargs):
        with mock.patch.object(torch.nn.functional, "linear", linear_as_ours):
            return forward(*args, **kwargs)

    with torch.no_grad():
        for pname, p in model.named_parameters():
            router = pname.endswith("mlp.gate.weight") or "moe_statics" in pname
            if p.ndim >= 2 and not router and (tied or "embed_tokens" not in pname):
                rounded = np.asarray(p.numpy(), ml_dtypes.bfloat16).astype(np.float32)
                p.copy_(torch.from_numpy(rounded))
    model.forward = forward_as_ours
    return model


def test_bfloat16_weights_give_the_logits_and_greedy_tokens_of_the_rounded_model(checkpoint):
    """--dtype bfloat16 on the CPU: logits within 1e-4 of transformers run on the bfloat16-rounded weights, within
    bfloat16's tolerance of the float32 logits, and through the engine (the C decoder stack, a bfloat16 paged
    cache, chunked prefill) the rounded model's greedy tokens, up to a near-tie the cache's rounding may break
    the other way."""
    import paddle

    name, d, hf = checkpoint
    rounded = _bf16_rounded_hf(name)
    ids = _prompt(6, 31)
    with torch.no_grad():
        ref = rounded(torch.tensor(ids)[None]).logits[0].numpy()
        fp32 = hf(torch.tensor(ids)[None]).logits[0].numpy()
    m = load_model(d, show_progress=False)
    m.process_weights_after_loading(16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None, len(ids) - 1)
    with paddle.no_grad():
        ours = m.compute_logits(m(paddle.to_tensor(ids), paddle.arange(len(ids)), meta, None)).numpy()
    scale = np.abs(ref).max()
    # Where x is rounded to bfloat16 (AMX) a last-bit difference in float32 can round an activation the other way, a
    # step of 2^-9 that the next layers carry on: the oracle then agrees to bfloat16's tolerance (measured: up to 0.45%
    # of the largest logit on the seven parity checkpoints AMX takes), not float32's
    amx = cpu_gemm.bf16_on_amx(len(ids), CONFIGS[name]["hidden_size"])
    assert np.abs(ours - ref).max() <= (1e-2 if amx else 1e-4) * scale, name
    # against float32: bfloat16 keeps 8 significant bits (measured here: a row's largest error is 0.5-2.3% of the
    # largest logit at the median over the 9 checkpoints), and where the rounding flips a token's routed experts
    # its row moves by more (as on a GPU in bfloat16), so the bound is on the median row
    row_err = np.abs(ours - fp32).max(axis=1) / scale
    assert 0 < np.median(row_err) <= 3e-2, name

    llm = LLM(model=str(d), max_model_len=256, block_size=16, max_num_batched_tokens=32, dtype="bfloat16",
              disable_progress_bar=True, enable_logprob=True)
    prompts = [_prompt(7, 19), _prompt(8, 45)]
    # prompt logprobs: the 45-token prompt's second chunk attends to the first's keys and values from the bfloat16
    # cache; against the rounded model (float32 keys and values) they move by the cache's rounding
    first = llm.generate(prompt_token_ids=[prompts[1].tolist()], sampling_params=SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    with torch.no_grad():
        logits = rounded(torch.tensor(prompts[1])[None]).logits[0]
    want_lp = torch.log_softmax(logits, -1)[torch.arange(len(prompts[1]) - 1), prompts[1][1:]].numpy()
    got_lp = np.array([first[i][int(prompts[1][i])].logprob for i in range(1, len(prompts[1]))])
    # measured: a median of 0.0015-0.011 nats over the nine checkpoints; a token whose routed experts the rounding
    # flips moves by more (up to ~2 nats on one), so the bound is on the median
    assert np.median(np.abs(got_lp - want_lp)) <= 3e-2, name
    outs = llm.generate(prompt_token_ids=[p.tolist() for p in prompts],
                        sampling_params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = rounded.generate(torch.tensor(p)[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                   pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        want, got = ref.sequences[0, len(p):].tolist(), out.outputs[0].token_ids
        split = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if split is not None:  # past here the two continue different texts: only where they part is compared
            step = ref.scores[split][0].numpy()
            assert step[want[split]] - step[got[split]] <= 2e-2 * np.abs(step).max(), (name, split)
