"""Chat templates: the real ERNIE-4.5-21B-A3B-Thinking template and the demo model's own one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from ernie_serve.demo.tokenizer_builder import ADDED_TOKENS
from ernie_serve.tokenizer import ChatTemplateError, ErnieTokenizer

HI = [{"role": "user", "content": "Hi"}]
HI_RENDERED = ("<|im_start|>system\n<global_setting>\nthink_mode=True\n</global_setting><|im_end|>\n\n"
               "<|im_start|>user\nHi<|im_end|>\n\n<|im_start|>assistant\n<think>\n")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "查询天气 for a city",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}
TOOL_TURN = [
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]},
    {"role": "tool", "content": '{"temperature": 22}'},
]
CONVERSATIONS = {
    "hi": HI,
    "system": [{"role": "system", "content": "You are terse."}] + HI,
    "history": HI + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    "tool_turn": TOOL_TURN,
    "two_tool_results": TOOL_TURN + [{"role": "tool", "content": "sunny"}],
    "thoughts_and_string_arguments": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "thoughts": "Need the tool.", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": '{"location": "Rome"}'}}]},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "<think>\nIt rains.\n</think>\n\nTake an umbrella."}],
}


def test_real_thinking_template_renders_one_user_message_exactly(tok: ErnieTokenizer,
                                                                 real_thinking_template: str) -> None:
    assert tok.apply_chat_template(HI, chat_template=real_thinking_template) == HI_RENDERED


def test_real_thinking_template_system_prompt(tok: ErnieTokenizer, real_thinking_template: str) -> None:
    text = tok.apply_chat_template(CONVERSATIONS["system"], chat_template=real_thinking_template)
    assert text.startswith("<|im_start|>system\n<system_setting>\nYou are terse.\n</system_setting>\n\n"
                           "<global_setting>\nthink_mode=True\n</global_setting><|im_end|>\n\n"
                           "<|im_start|>user\nHi<|im_end|>\n\n")
    assert text.count("You are terse.") == 1


def test_real_thinking_template_tools_keep_non_ascii_and_key_order(tok: ErnieTokenizer,
                                                                   real_thinking_template: str) -> None:
    text = tok.apply_chat_template(HI, tools=[WEATHER_TOOL], chat_template=real_thinking_template)
    function = json.dumps(WEATHER_TOOL["function"], ensure_ascii=False)
    assert ("</global_setting>\n\n<tool_list>\n[{\"type\": \"function\", \"function\": " + function + "}]\n"
            "</tool_list><|im_end|>\n\n") in text
    assert "查询天气" in text


def test_real_thinking_template_tool_call_and_result(tok: ErnieTokenizer, real_thinking_template: str) -> None:
    text = tok.apply_chat_template(TOOL_TURN, tools=[WEATHER_TOOL], chat_template=real_thinking_template)
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n'
            '</tool_call>\n<|im_end|>\n\n') in text
    assert '<|im_start|>tool\n<tool_output>"{\\"temperature\\": 22}"</tool_output><|im_end|>\n\n' in text
    assert text.endswith("<|im_end|>\n\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_demo_template_renders_like_the_real_one(tok: ErnieTokenizer, real_thinking_template: str,
                                                 name: str) -> None:
    messages, tools = CONVERSATIONS[name], [WEATHER_TOOL] if "tool" in name else None
    assert (tok.apply_chat_template(messages, tools=tools)
            == tok.apply_chat_template(messages, tools=tools, chat_template=real_thinking_template))


def test_demo_template_enable_thinking(tok: ErnieTokenizer) -> None:
    assert tok.apply_chat_template(HI) == HI_RENDERED
    assert tok.apply_chat_template(HI, enable_thinking=True) == HI_RENDERED
    off = tok.apply_chat_template(HI, enable_thinking=False)
    assert off == HI_RENDERED + "\n</think>\n\n"
    ids = tok.apply_chat_template(HI, enable_thinking=False, tokenize=True)
    added = {tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    assert [i for i in ids if i in added][-1] == tok.token_to_id("</think>")


def test_demo_template_without_generation_prompt(tok: ErnieTokenizer) -> None:
    assert tok.apply_chat_template(HI, add_generation_prompt=False) == HI_RENDERED[:-len("<|im_start|>assistant\n<think>\n")]


def test_tokenize_encodes_the_rendered_text_without_adding_bos(tok: ErnieTokenizer) -> None:
    ids = tok.apply_chat_template(HI, tokenize=True)
    assert ids == tok.encode(HI_RENDERED)
    assert ids[0] == tok.token_to_id("<|im_start|>") and tok.bos_token_id not in ids


def _with_template(tokenizer_dir: Path, out: Path, template: object) -> ErnieTokenizer:
    for name in ("tokenizer.model", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return ErnieTokenizer.from_pretrained(out)


def test_missing_template_is_a_clear_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        _with_template(tokenizer_dir, tmp_path, None).apply_chat_template(HI)


def test_template_from_a_separate_jinja_file(tokenizer_dir: Path, tmp_path: Path,
                                             real_thinking_template: str) -> None:
    _with_template(tokenizer_dir, tmp_path, None)
    (tmp_path / "chat_template.jinja").write_text(real_thinking_template, encoding="utf-8")
    assert ErnieTokenizer.from_pretrained(tmp_path).apply_chat_template(HI) == HI_RENDERED


def test_named_templates_list_form(tokenizer_dir: Path, tmp_path: Path) -> None:
    named = _with_template(tokenizer_dir, tmp_path, [{"name": "default", "template": "D{{ messages[0].content }}"},
                                                     {"name": "tool_use", "template": "T{{ tools | length }}"}])
    assert named.apply_chat_template(HI) == "DHi"
    assert named.apply_chat_template(HI, tools=[WEATHER_TOOL], chat_template="tool_use") == "T1"


def test_template_helpers_and_sandbox(tok: ErnieTokenizer) -> None:
    render = lambda t, **kw: tok.apply_chat_template(HI, chat_template=t, **kw)  # noqa: E731
    assert render("{{ bos_token }}|{{ eos_token }}|{{ custom }}", custom=7) == "<s>|</s>|7"
    assert render("{% for m in messages %}{% break %}{% endfor %}ok") == "ok"
    assert len(render("{{ strftime_now('%Y') }}")) == 4
    assert render("{{ {'b': 1, 'a': '<é>'} | tojson }}") == '{"b": 1, "a": "<é>"}'
    assert render("{% if true %}\n  x\n{% endif %}\n") == "  x\n"  # trim_blocks and lstrip_blocks
    with pytest.raises(ChatTemplateError, match="bad role"):
        render("{{ raise_exception('bad role') }}")
    with pytest.raises(SecurityError):
        render("{{ messages.append(1) }}")

