"""ngram speculative decoding: drafts verified in one forward, greedy output exactly unchanged."""
from __future__ import annotations

import json

import pytest

from ernie_serve.config import EngineConfig
from ernie_serve.engine.spec_decode import NgramProposer, make_proposer
from ernie_serve.sampling_params import SamplingParams
from ernie_serve.paths import demo_data_dir
from engine_helpers import assert_no_leaks, make_engine, run


def test_ngram_proposer_copies_what_followed_the_latest_match():
    p = NgramProposer(3)
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3], limit=5) == [4, 5, 9]
    assert p.propose([7, 8, 7, 8, 7], limit=5) == [8, 7]  # latest match of [8, 7]... then [7]
    assert p.propose([1, 2, 3], limit=5) == []
    assert p.propose([1, 2, 1, 2], limit=1) == [1]
    assert p.propose([1, 2, 1, 2], limit=0) == []


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="supported: 'ngram'"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 9})
    assert make_proposer(EngineConfig(speculative_config='{"method": "ngram"}').speculative_config).k == 1


def _chat_prompts(engine, n=6):
    rows = [json.loads(line) for line in (demo_data_dir() / "chat_demo.jsonl").read_text().splitlines() if line]
    return [engine.tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=True,
                                                 **r.get("chat_template_kwargs", {})) for r in rows[:n]]


def test_greedy_output_is_identical_with_ngram_drafts_and_some_are_accepted(tiny_model_dir):
    plain = make_engine(tiny_model_dir)
    spec = make_engine(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = _chat_prompts(plain)
    p = SamplingParams(temperature=0, max_tokens=48)
    ref = run(plain, [(0, f"r{i}", ids, p) for i, ids in enumerate(prompts)])
    got = run(spec, [(0, f"r{i}", ids, p) for i, ids in enumerate(prompts)])
    for rid in ref:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids, rid
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert spec.num_steps < plain.num_steps  # accepted drafts are steps saved
    assert_no_leaks(spec)
