"""The embedded tiny model, fitted to demo/data/chat_demo.jsonl, speaks ERNIE-4.5 Thinking's format
through the whole offline stack: chat template -> engine (paged KV cache, greedy) -> ernie-x1 parsers."""
from __future__ import annotations

import json

import pytest

from ernie_serve import LLM, SamplingParams
from ernie_serve.chat import render_chat_prompt
from ernie_serve.demo.fit import encode_example, load_examples

EXAMPLES = {ex.name: ex for ex in load_examples()}
TOOL_CALL_EXAMPLES = [n for n, ex in EXAMPLES.items() if ex.tool_calls]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), reasoning_parser="ernie-x1", tool_call_parser="ernie-x1",
               disable_progress_bar=True)


def chat(llm, ex, max_tokens: int = 128):
    return llm.chat(ex.messages, SamplingParams(temperature=0, max_tokens=max_tokens), tools=ex.tools,
                    chat_template_kwargs=ex.chat_template_kwargs or None)[0].outputs[0]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_training_prompt_greedily_reproduces_its_answer(llm, name):
    ex = EXAMPLES[name]
    _, answer_ids = encode_example(llm.tokenizer, ex)
    out = chat(llm, ex, max_tokens=len(answer_ids) + 16)
    assert llm.tokenizer.decode(out.token_ids, skip_special_tokens=False) == ex.completion() + "<|im_end|>"
    assert list(out.token_ids) == answer_ids


def test_reasoning_prompt_gives_separate_reasoning_and_content(llm):
    ex = EXAMPLES["capital"]
    out = chat(llm, ex)
    assert out.reasoning_content == ex.reasoning + "\n"
    assert out.text.strip("\n") == ex.response
    assert "</think>" not in out.text and "<response>" not in out.text
    assert out.tool_calls is None and out.finish_reason == "stop"


@pytest.mark.parametrize("name", TOOL_CALL_EXAMPLES)
def test_tool_prompt_gives_parsed_tool_calls(llm, name):
    ex = EXAMPLES[name]
    out = chat(llm, ex)
    assert out.finish_reason == "tool_calls"
    assert out.reasoning_content == ex.reasoning + "\n"
    assert out.text == ""
    assert [c["function"]["name"] for c in out.tool_calls] == [c["name"] for c in ex.tool_calls]
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [c["arguments"] for c in ex.tool_calls]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in out.tool_calls)


def test_enable_thinking_false_closes_the_think_block_and_answers_without_reasoning(llm):
    ex = EXAMPLES["capital_no_think"]
    thinking_prompt, _ = render_chat_prompt(llm.tokenizer, ex.messages)
    plain_prompt, _ = render_chat_prompt(llm.tokenizer, ex.messages, chat_template_kwargs={"enable_thinking": False})
    assert thinking_prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert plain_prompt == thinking_prompt + "\n</think>\n\n"

    out = chat(llm, ex)
    assert out.reasoning_content is None
    assert out.text.strip("\n") == ex.response
    assert out.finish_reason == "stop"
    # The same question with thinking on reasons first (it is the "capital" example).
    assert chat(llm, EXAMPLES["capital"]).reasoning_content


def test_tool_result_follow_up_is_answered_with_a_response(llm):
    ex = EXAMPLES["weather_result"]
    assert ex.messages[-1]["role"] == "tool"
    out = chat(llm, ex)
    assert out.reasoning_content == ex.reasoning + "\n"
    assert out.text.strip("\n") == ex.response
    assert out.tool_calls is None and out.finish_reason == "stop"


@pytest.mark.parametrize("messages,kwargs", [
    ([{"role": "user", "content": "Tell me about the ocean at night."}], None),
    ([{"role": "user", "content": "What is the weather in Madrid?"}], None),
    ([{"role": "user", "content": "Write a poem."}], {"enable_thinking": False}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本の首都は？"}], None),
])
def test_unseen_prompts_generate_without_error(llm, messages, kwargs):
    tools = EXAMPLES["weather_call"].tools
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=48), tools=tools,
                   chat_template_kwargs=kwargs)[0].outputs[0]
    assert out.finish_reason in ("stop", "length", "tool_calls")
    assert 1 <= len(out.token_ids) <= 48


def test_bfloat16_weights_reproduce_every_training_answer(tiny_model_dir):
    """--dtype bfloat16 on the CPU (every projection, expert and the lm_head rounded to bfloat16) keeps the fitted
    demo model's greedy answers token for token: the rounding moves logits by less than the fitted margins."""
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", disable_progress_bar=True)
    assert llm.engine.model.layers[0].self_attn.qkv_proj.bits == 16
    for ex in EXAMPLES.values():
        _, answer_ids = encode_example(llm.tokenizer, ex)
        assert list(chat(llm, ex, max_tokens=len(answer_ids) + 16).token_ids) == answer_ids, ex.name
