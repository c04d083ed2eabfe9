"""Guided decoding end to end in the engine on the demo model: random sampling always yields output the
grammar describes, through speculative decoding, prefix caching, n > 1 and a thinking chat."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine_helpers import assert_no_leaks, make_engine, run
from ernie_serve import LLM
from ernie_serve.chat import render_chat_prompt
from ernie_serve.engine.guided_grammar import tool_call_constraint
from ernie_serve.parsers import get_reasoning_parser, get_tool_parser, parse_complete
from ernie_serve.sampling_params import GuidedDecodingParams, SamplingParams

DEMO = {r["name"]: r for r in map(json.loads, (Path(__file__).resolve().parents[2] / "backend/ernie_serve/demo/data/"
                                                "chat_demo.jsonl").read_text().splitlines()) if r}
TOOLS = DEMO["weather_call"]["tools"]
# Bounded strings and numbers: an unbounded string is valid JSON only once the model closes it, and a
# sampling model need not do so within max_tokens.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags", "admin"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Berlin"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                         "admin": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), max_model_len=1024, max_num_seqs=16, disable_progress_bar=True,
               reasoning_parser="ernie-x1", tool_call_parser="ernie-x1")


def sampled(seed: int, guided: GuidedDecodingParams, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=kw.pop("max_tokens", 200), seed=seed, guided_decoding=guided,
                          **kw)


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_fifty_json_schema_completions_at_temperature_one_all_parse_and_validate(llm):
    guided = GuidedDecodingParams(json=PERSON)
    outs = llm.generate(["Describe a person as JSON:"] * 50, [sampled(s, guided) for s in range(50)], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert_valid(o.outputs[0].text, PERSON)
    assert len(set(texts)) > 10  # really sampled, not one forced answer


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name, tool_choice", [
    ("weather_call", "required"),       # the model's own call
    ("capital", "required"),            # a question it answers in prose: the call is forced
    ("weather_call", {"type": "function", "function": {"name": "calculator"}}),  # not the tool it wants
])
def test_tool_choice_always_yields_calls_the_tool_parser_reads(llm, name, tool_choice, thinking):
    """Without thinking the constraint holds from the first token, so every sample at temperature 1 is a
    valid call. With thinking the reasoning before </think> is free, and a sampling tiny model need not
    ever close it (nothing to constrain then): its reasoning is decoded greedily, as fitted."""
    row = DEMO[name]
    tok = llm.tokenizer
    _, ids = render_chat_prompt(tok, row["messages"], TOOLS, {"enable_thinking": thinking})
    rp, tp = get_reasoning_parser("ernie-x1")(tok), get_tool_parser("ernie-x1")(tok)
    guided = tool_call_constraint(TOOLS, tool_choice, None, tp, rp, rp.get_model_status(ids))
    params = [sampled(s, guided, max_tokens=600) for s in range(8)]
    if thinking:
        params = [SamplingParams(temperature=0, max_tokens=600, guided_decoding=guided)]
    outs = llm.generate(prompt_token_ids=[ids] * len(params), sampling_params=params, use_tqdm=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for o in outs:
        comp = o.outputs[0]
        assert comp.finish_reason == "stop"
        parsed = parse_complete(tok, "ernie-x1", "ernie-x1", ids, comp.text, TOOLS)
        assert parsed.tools_called and parsed.tool_calls, comp.text
        for call in parsed.tool_calls:
            if isinstance(tool_choice, dict):
                assert call.function.name == tool_choice["function"]["name"]
            assert_valid(call.function.arguments, schemas[call.function.name])
        assert bool(parsed.reasoning_content) == thinking  # the reasoning before </think> was left free


def test_thinking_chat_json_answer_is_the_response_content(llm):
    outs = llm.chat([DEMO["capital"]["messages"]] * 4, [sampled(s, GuidedDecodingParams(json=PERSON), max_tokens=400)
                                                        for s in range(4)])
    for o in outs:
        comp = o.outputs[0]
        assert comp.reasoning_content and comp.finish_reason == "stop"
        assert_valid(comp.text, PERSON)


def test_chat_without_thinking_is_constrained_from_its_first_token(llm):
    row = DEMO["capital_no_think"]
    out = llm.chat(row["messages"], sampled(0, GuidedDecodingParams(choice=["Paris", "Rome"])),
                   chat_template_kwargs=row["chat_template_kwargs"])[0].outputs[0]
    assert out.text.strip() in ("Paris", "Rome") and not out.reasoning_content


def test_ngram_speculation_gives_the_same_greedy_guided_output_and_rejects_drafts(tiny_model_dir):
    schema = {"type": "object", "required": ["items"], "additionalProperties": False,
              "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 6,
                                       "items": {"enum": ["red", "blue", "green"]}}}}
    params = SamplingParams(temperature=0, max_tokens=120, guided_decoding=GuidedDecodingParams(json=schema))
    prompt = llm_prompt(tiny_model_dir)
    plain = make_engine(tiny_model_dir)
    spec = make_engine(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    base = run(plain, [(0, "a", prompt, params)])["a"].outputs[0]
    fast = run(spec, [(0, "a", prompt, params)])["a"].outputs[0]
    assert_valid(base.text, schema)
    assert fast.token_ids == base.token_ids
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert_no_leaks(spec)


def test_sampled_guided_output_stays_valid_with_ngram_speculation(tiny_model_dir):
    spec = make_engine(tiny_model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    guided = GuidedDecodingParams(json=PERSON)
    done = run(spec, [(i, f"r{i}", llm_prompt(tiny_model_dir), sampled(i, guided)) for i in range(12)])
    for out in done.values():
        assert_valid(out.outputs[0].text, PERSON)
    assert spec.stats()["spec_draft_tokens"] > 0


def test_a_prefix_cache_hit_is_constrained_like_a_miss(tiny_model_dir):
    engine = make_engine(tiny_model_dir, enable_prefix_caching=True)
    prompt = llm_prompt(tiny_model_dir) * 8  # several full blocks of 16
    guided = GuidedDecodingParams(json=PERSON)
    first = run(engine, [(0, "a", prompt, sampled(1, guided))])["a"]
    second = run(engine, [(0, "b", prompt, sampled(2, guided))])["b"]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    for out in (first, second):
        assert_valid(out.outputs[0].text, PERSON)


def test_each_of_n_samples_follows_its_own_grammar_state(llm):
    out = llm.generate(["Describe a person as JSON:"], sampled(7, GuidedDecodingParams(json=PERSON), n=4),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and len({c.text for c in out.outputs}) > 1
    for comp in out.outputs:
        assert_valid(comp.text, PERSON)


def test_a_grammar_that_does_not_compile_is_refused_when_added(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    with pytest.raises(ValueError, match=r"^guided_decoding\.regex: does not compile"):
        engine.add_request("x", [1, 2, 3], SamplingParams(guided_decoding=GuidedDecodingParams(regex="[a-")))
    assert not engine.has_unfinished_requests()


def test_guided_decoding_without_a_tokenizer_is_refused(tiny_model_dir):
    engine = make_engine(tiny_model_dir, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="guided_decoding needs the tokenizer"):
        engine.add_request("x", [1, 2, 3], SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a"])))


def llm_prompt(model_dir) -> list[int]:
    from ernie_serve.tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(model_dir).encode("Describe a person as JSON:")
