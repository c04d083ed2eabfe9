"""The parsers on the project's real (demo) SentencePiece tokenizer, chat template and detokenizer."""
from __future__ import annotations

import pytest

from ernie_serve.parsers import ChatOutputParser, parse_complete

tokenizer_mod = pytest.importorskip("ernie_serve.tokenizer")
builder = pytest.importorskip("ernie_serve.demo.tokenizer_builder")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def real_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("parsers_tokenizer")
    builder.build_tokenizer(out)
    return tokenizer_mod.ErnieTokenizer.from_pretrained(out)


def prompt_ids(tok, enable_thinking):
    return tok.apply_chat_template([{"role": "user", "content": "weather?"}], tokenize=True,
                                   enable_thinking=enable_thinking)


@pytest.mark.parametrize("text", [
    "The user wants the weather.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"location": "北京", "days": 3, "metric": true}}\n</tool_call>\n',
    "Simple.\n</think>\n\n<response>\nIt is sunny, 晴天.\n</response>",
    "cut off while thinking",
])
def test_token_by_token_through_the_detokenizer_equals_non_streaming(real_tok, text):
    prompt = prompt_ids(real_tok, True)
    out = ChatOutputParser(real_tok, "ernie-x1", "ernie-x1", prompt, TOOLS)
    assert out.model_status == "think_start"
    detok = tokenizer_mod.IncrementalDetokenizer(real_tok, prompt)
    ids = real_tok.encode(text)
    streamed = []
    for tid in ids:
        msg = out.feed(detok.step([tid]), [tid])
        streamed.append(msg)
    out.feed(detok.flush(), [], final=True)
    final = out.finish()
    full = real_tok.decode(ids)
    expected = parse_complete(real_tok, "ernie-x1", "ernie-x1", prompt, full, TOOLS)
    assert (final.reasoning_content, final.content, final.tools_called) == \
        (expected.reasoning_content, expected.content, expected.tools_called)
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in expected.tool_calls]
    assert 0 < out.num_reasoning_tokens <= len(ids)


def test_template_enable_thinking_sets_the_model_status(real_tok):
    """The template closes the think block for enable_thinking=False; the parser reads that from the ids."""
    off = ChatOutputParser(real_tok, "ernie-x1", None, prompt_ids(real_tok, False))
    assert off.model_status == "think_end" and not off.enable_thinking
    on = ChatOutputParser(real_tok, "ernie-x1", None, prompt_ids(real_tok, True))
    assert on.model_status == "think_start" and on.enable_thinking
    off.feed("\n<response>plain answer</response>", [])
    assert off.finish().content == "plain answer" and off.num_reasoning_tokens == 0
