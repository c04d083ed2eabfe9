"""MTP speculative decoding: the head's math over the paged cache, exact outputs, the sampling rule."""
from __future__ import annotations

import json
import shutil

import numpy as np
import paddle
import pytest
from scipy import stats

from ernie_serve.demo.tiny_model import CONFIGS, random_mtp_weights, random_weights
from ernie_serve.engine.sampler import Sampler, SamplingBatch, filtered_distribution
from ernie_serve.model.attention import AttentionMetadata
from ernie_serve.model.checkpoint_writer import pt_to_paddle, write_checkpoint
from ernie_serve.model.config import ErnieModelConfig
from ernie_serve.model.loader import load_mtp, load_model
from ernie_serve.paths import demo_data_dir
from ernie_serve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, make_engine, run

GREEDY = SamplingParams(temperature=0, max_tokens=40)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=1024)


def _mtp(k: int) -> dict:
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


def _chat_prompts(engine, n: int = 8) -> list[list[int]]:
    rows = [json.loads(line) for line in (demo_data_dir() / "chat_demo.jsonl").read_text().splitlines() if line]
    return [engine.tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=True,
                                                 **r.get("chat_template_kwargs", {})) for r in rows[:n]]


def _checkpoint(path, config: dict, layout: str = "pt"):
    arch = "Ernie4_5_MoeForCausalLM" if config.get("moe_num_experts") else "Ernie4_5ForCausalLM"
    config = dict(config, architectures=[arch])
    tensors = {**random_weights(config, seed=3), **random_mtp_weights(config, seed=4)}
    if layout == "paddle":
        tensors = pt_to_paddle(tensors, ErnieModelConfig.from_dict(config))
    write_checkpoint(path, config, tensors)
    return path


def _ids(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_demo_greedy_output_is_identical_with_mtp_and_its_fitted_head_saves_steps(tiny_model_dir, k):
    plain = make_engine(tiny_model_dir)
    spec = make_engine(tiny_model_dir, **_mtp(k))
    prompts = _chat_prompts(plain)
    ref = run(plain, [(0, f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    got = run(spec, [(0, f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts)])
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in ref.items()}
    s = spec.stats()
    assert s["spec_acceptance_rate"] > 0.5, s  # the head was fitted on these chats
    assert spec.num_steps < plain.num_steps
    assert_no_leaks(spec)


@pytest.mark.parametrize("name,config", [
    ("moe_gqa", dict(SMALL, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1)),
    ("dense_one_kv_head_odd_headdim", dict(SMALL, num_key_value_heads=1, head_dim=24)),
    ("moe_mha_tied", dict(SMALL, num_key_value_heads=4, tie_word_embeddings=True, moe_num_experts=4, moe_k=1,
                          moe_intermediate_size=16, moe_num_shared_experts=1)),
])
def test_greedy_output_is_identical_with_a_random_head_under_batching_chunking_and_preemption(tmp_path, name, config):
    d = _checkpoint(tmp_path / name, config)
    prompts = [(i, f"r{i}", _ids(i, 9 + 23 * i), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
               for i in range(6)]
    opts = dict(skip_tokenizer_init=True, max_model_len=256, long_prefill_token_threshold=32,
                num_gpu_blocks_override=24)  # chunks of 32, and too few blocks for all six at once
    ref = run(make_engine(d, **opts), prompts)
    spec = make_engine(d, **opts, **_mtp(2))
    got = run(spec, prompts)
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in ref.items()}
    assert spec.scheduler.num_preemptions > 0 and spec.stats()["spec_draft_tokens"] > 0
    assert_no_leaks(spec)


def _dense_head_logits(model, head, tokens: list[int], extra: list[int]) -> np.ndarray:
    """The head by definition, without a cache: target hidden states h_0..h_{N-2} of tokens[:-1], then the
    head over (x_{t+1}, h_t) for t < N-1, continuing with (extra[j], previous head output) for the drafts."""
    n = len(tokens)
    with paddle.no_grad():
        meta = AttentionMetadata.build([n - 1], [n - 1], None, 16, None, n - 2)
        h = model(paddle.to_tensor(tokens[:-1]), paddle.arange(n - 1), meta, None)
        ids, hid = list(tokens[1:]), h
        out = None
        for j in range(len(extra) + 1):
            m = len(ids)
            meta = AttentionMetadata.build([m], [m], None, 16, None, m - 1)
            out = head(model, paddle.to_tensor(ids), hid, paddle.arange(m), meta, None)
            if j < len(extra):
                ids.append(extra[j])
                hid = paddle.concat([h, out[-1:]], axis=0) if j == 0 else paddle.concat([hid, out[-1:]], axis=0)
        return model.compute_logits(out[-1:]).numpy()[0]


def test_drafts_are_the_heads_greedy_predictions_computed_without_a_cache(tmp_path):
    d = _checkpoint(tmp_path / "ck", dict(SMALL, num_key_value_heads=1))
    engine = make_engine(d, skip_tokenizer_init=True, block_size=4, **_mtp(3))
    prompt = _ids(7, 13)
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    req = engine.requests["a"][0]
    model, head = load_model(d, show_progress=False), None
    head = load_mtp(model.config, model.mtp_weights, "test")
    checked = 0
    while engine.has_unfinished_requests() and checked < 6:
        engine.step()
        if req.spec_token_ids and not req.is_finished:
            drafts = req.spec_token_ids
            for j, tok in enumerate(drafts):
                ref = _dense_head_logits(model, head, req.all_token_ids, drafts[:j])
                assert tok == int(ref.argmax()), (checked, j)
            checked += 1
    assert checked == 6


def test_pt_and_paddle_layouts_load_the_same_head(tmp_path):
    pt = load_model(_checkpoint(tmp_path / "pt", SMALL), show_progress=False)
    pd = load_model(_checkpoint(tmp_path / "pd", SMALL, layout="paddle"), show_progress=False)
    a = load_mtp(pt.config, pt.mtp_weights, "pt")
    b = load_mtp(pd.config, pd.mtp_weights, "paddle")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())


def test_a_checkpoint_without_a_head_is_refused_at_start(tmp_path):
    d = tmp_path / "nohead"
    config = dict(SMALL, architectures=["Ernie4_5ForCausalLM"])
    write_checkpoint(d, config, random_weights(config, seed=3))
    with pytest.raises(ValueError, match="no MTP-head tensors"):
        make_engine(d, skip_tokenizer_init=True, **_mtp(1))


def test_a_separate_mtp_checkpoint_is_read_from_speculative_config_model(tmp_path):
    config = dict(SMALL, architectures=["Ernie4_5ForCausalLM"])
    body, heads = tmp_path / "body", tmp_path / "mtp"
    write_checkpoint(body, config, random_weights(config, seed=3))
    write_checkpoint(heads, config, random_mtp_weights(config, seed=4))
    both = _checkpoint(tmp_path / "both", SMALL)
    p = [(0, "a", _ids(1, 20), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": str(heads)}
    split = make_engine(body, skip_tokenizer_init=True, speculative_config=spec)
    one = make_engine(both, skip_tokenizer_init=True, **_mtp(2))
    assert run(split, p)["a"].outputs[0].token_ids == run(one, p)["a"].outputs[0].token_ids
    assert split.stats()["spec_draft_tokens"] == one.stats()["spec_draft_tokens"] > 0


def test_the_speculative_sampling_rule_emits_the_target_distribution():
    """Model-free: drafts drawn from q, verified against p with top-k / top-p filters; 30k trials."""
    rng = np.random.default_rng(0)
    V, N = 12, 30_000
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, seed=1)
    probs = np.exp(logits / 0.8 - (logits / 0.8).max())
    probs /= probs.sum()
    target = filtered_distribution(probs[None], np.array([8]), np.array([0.9]), np.array([0.0]))[0]
    q = rng.dirichlet(np.ones(V) * 0.7).astype(np.float32)  # a deliberately different draft distribution
    gen = np.random.default_rng(5)
    drafts = gen.choice(V, size=N, p=q / q.sum())
    sampler = Sampler()
    rows = 1000
    counts = np.zeros(V)
    for start in range(0, N, rows):
        d = drafts[start : start + rows]
        batch = SamplingBatch(params=[params] * len(d), generators=[gen] * len(d),
                              prompt_token_ids=[[]] * len(d), output_token_ids=[[]] * len(d),
                              eos_token_ids=[None] * len(d), bad_words_ids=[[]] * len(d),
                              draft_tokens=list(map(int, d)), draft_probs=[q] * len(d))
        out = sampler(np.tile(logits, (len(d), 1)), batch)
        counts += np.bincount(out.token_ids, minlength=V)
    keep = target > 0
    assert counts[~keep].sum() == 0  # never a token outside the filtered set
    expected = target[keep].astype(np.float64)
    _, p_value = stats.chisquare(counts[keep], expected / expected.sum() * counts.sum())
    assert p_value > 1e-3, (counts, target * N)


def test_sampling_with_mtp_keeps_the_target_distribution(tiny_model_dir):
    """Two-sample chi-square on the 2nd and 3rd tokens (the ones MTP drafts) at temperature 1.5."""
    prompt = _chat_prompts(make_engine(tiny_model_dir), 1)[0]
    n = 400

    def sample(engine) -> list[tuple[int, int]]:
        reqs = [(0, f"s{i}", prompt, SamplingParams(temperature=1.5, max_tokens=3, seed=1000 + i, ignore_eos=True))
                for i in range(n)]
        return [tuple(o.outputs[0].token_ids[1:3]) for o in run(engine, reqs).values()]

    plain = sample(make_engine(tiny_model_dir, max_num_seqs=64))
    spec_engine = make_engine(tiny_model_dir, max_num_seqs=64, **_mtp(2))
    spec = sample(spec_engine)
    assert spec_engine.stats()["spec_accepted_tokens"] > 0
    for pos in (0, 1):
        a = np.array([t[pos] for t in plain])
        b = np.array([t[pos] for t in spec])
        cats = [c for c in np.unique(np.concatenate([a, b])) if (a == c).sum() + (b == c).sum() >= 10]
        table = np.array([[(a == c).sum() for c in cats] + [np.isin(a, cats, invert=True).sum()],
                          [(b == c).sum() for c in cats] + [np.isin(b, cats, invert=True).sum()]])
        table = table[:, table.sum(axis=0) > 0]
        assert table.shape[1] >= 2, "the test needs a spread distribution"
        _, p_value, _, _ = stats.chi2_contingency(table)
        assert p_value > 1e-3, (pos, table)
