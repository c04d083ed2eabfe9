"""reasoning_max_tokens: a thinking output's reasoning bounded per request, the rest of it well-formed."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from ernie_serve import LLM, SamplingParams
from ernie_serve.demo.tiny_model import CONFIGS, random_weights
from ernie_serve.engine.reasoning_budget import ReasoningBudget, budget_for, resolve_reasoning_budget
from ernie_serve.model.checkpoint_writer import write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEMO = {row["name"]: row for row in map(json.loads, (ROOT / "backend/ernie_serve/demo/data/chat_demo.jsonl")
                                        .read_text().splitlines()) if row}
CHAT = DEMO["capital"]["messages"]
END = 7  # a stand-in end-of-thinking id for the model-free tests


def test_the_budget_counts_reasoning_tokens_then_puts_the_end_in_place_of_the_next():
    b = ReasoningBudget(2, END)
    assert [b.take(t) for t in (11, 12, 13, 14)] == [11, 12, END, 14]
    b = ReasoningBudget(5, END)
    assert [b.take(t) for t in (11, END, 12, 13)] == [11, END, 12, 13] and not b.open  # closed by the model itself


def test_the_front_places_the_budget_only_where_the_output_starts_in_reasoning():
    p = SamplingParams(reasoning_max_tokens=4)
    assert resolve_reasoning_budget(p, END, True).reasoning_end_token_id == END
    off = resolve_reasoning_budget(p, END, False)  # thinking off: nothing to bound
    assert off.reasoning_max_tokens is None and budget_for(off) is None
    with pytest.raises(ValueError, match="reasoning_max_tokens needs a reasoning parser.*--reasoning-parser"):
        resolve_reasoning_budget(p, None, True)
    with pytest.raises(ValueError, match="reasoning_max_tokens needs reasoning_end_token_id"):
        budget_for(p)
    with pytest.raises(ValueError, match=r"reasoning_max_tokens must be an integer in \[1, "):
        SamplingParams(reasoning_max_tokens=0)
    with pytest.raises(ValueError, match="reasoning_end_token_id is only used with reasoning_max_tokens"):
        SamplingParams(reasoning_end_token_id=3)


def _chat(llm: LLM, budget: int | None, **kw) -> tuple[list[int], object]:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 60), reasoning_max_tokens=budget)
    out = llm.chat(CHAT, params, **kw)[0].outputs[0]
    return list(out.token_ids), out


@pytest.fixture(scope="module")
def thinking_llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), reasoning_parser="ernie-x1", max_model_len=512, block_size=16,
               disable_progress_bar=True)


def _end_id(llm: LLM) -> int:
    from ernie_serve.parsers import get_reasoning_parser

    return get_reasoning_parser("ernie-x1")(llm.tokenizer).think_end_token_id


def test_a_spent_budget_closes_the_thinking_and_the_parsers_see_the_reasoning_it_had(thinking_llm):
    end = _end_id(thinking_llm)
    free, free_out = _chat(thinking_llm, None)
    natural = free.index(end)  # the fitted demo model closes its reasoning itself after this many tokens
    assert natural > 4
    tokens, out = _chat(thinking_llm, 3)
    assert tokens[:3] == free[:3] and tokens[3] == end and end not in tokens[:3]
    assert out.reasoning_content == thinking_llm.tokenizer.decode(tokens[:3])
    assert out.finish_reason in ("stop", "length")
    # a budget the reasoning stays under changes nothing
    assert _chat(thinking_llm, natural + 5)[0] == free


def test_max_tokens_before_the_budget_ends_the_output_without_closing(thinking_llm):
    end = _end_id(thinking_llm)
    tokens, out = _chat(thinking_llm, 10, max_tokens=4)
    assert len(tokens) == 4 and end not in tokens and out.finish_reason == "length"


def test_thinking_off_leaves_the_output_as_it_was(thinking_llm):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _chat(thinking_llm, 1, **kwargs)[0] == _chat(thinking_llm, None, **kwargs)[0]


def test_drafts_after_a_forced_end_are_dropped(tiny_model_dir, thinking_llm):
    """n-gram drafts accepted past the forced token were drawn after the token it replaced."""
    spec = LLM(model=str(tiny_model_dir), reasoning_parser="ernie-x1", max_model_len=512, block_size=16,
               disable_progress_bar=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for budget in (2, 5, 9):
        assert _chat(spec, budget)[0] == _chat(thinking_llm, budget)[0]


def test_without_a_reasoning_parser_the_budget_is_refused_naming_it(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), max_model_len=256, block_size=16, disable_progress_bar=True)
    with pytest.raises(ValueError, match="reasoning_max_tokens needs a reasoning parser"):
        _chat(llm, 3)


def test_the_budget_holds_on_a_checkpoint_that_is_not_the_demos(tiny_model_dir, tmp_path):
    """Random weights of another shape (one KV head, head_dim 24) behind the demo's tokenizer: whatever the model
    writes, the fourth token is the reasoning's end."""
    config = dict(CONFIGS["tiny"], num_key_value_heads=1, head_dim=24, num_hidden_layers=2, moe_layer_end_index=1)
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(tiny_model_dir / f, tmp_path / f)
    write_checkpoint(tmp_path, config, random_weights(config, seed=5))
    llm = LLM(model=str(tmp_path), reasoning_parser="ernie-x1", max_model_len=256, block_size=16,
              disable_progress_bar=True)
    end = _end_id(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, reasoning_max_tokens=3)
    tokens = list(llm.chat(CHAT, params)[0].outputs[0].token_ids)
    assert tokens[3] == end and end not in tokens[:3]
    # the raw generate path places the budget from the prompt the same way
    prompt_ids = llm.chat(CHAT, replace(params, max_tokens=1))[0].prompt_token_ids
    assert list(llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params)[0].outputs[0].token_ids) == tokens
