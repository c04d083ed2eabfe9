"""Build the embedded demo model's tokenizer from the corpus kept in the repo (no download).

The files have the layout of the real ERNIE-4.5 repos (tokenizer.model + tokenizer_config.json +
special_tokens_map.json) so the serving code only ever sees one format. Training settings are the
ones that make `decode(encode(text)) == text` exact: no dummy prefix, no whitespace folding, identity
normalization, byte fallback. A single training thread and a fixed corpus order make the output
byte-identical run to run.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece as spm

from ..paths import demo_data_dir

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
# (token, special): "special" tokens are dropped by decode(skip_special_tokens=True); the markup tags
# are not, because the reasoning and tool-call parsers must still see them in the decoded text.
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|begin_of_sentence|>", True), ("<|end_of_sentence|>", True),
    ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False), ("<response>", False), ("</response>", False),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_output>", False), ("</tool_output>", False),
    ("<|IMAGE_PLACEHOLDER|>", True),
] + [(f"<mask:{i}>", True) for i in range(8)]
# Whitespace that SentencePiece does not fold into `▁`: single pieces instead of byte fallback.
_WHITESPACE_PIECES = ["\n", "\t"]

# Our own ChatML-style thinking template. It renders the same text as the ERNIE-4.5-21B-A3B-Thinking
# template for the conversations that one supports, and additionally honours add_generation_prompt,
# `reasoning_content` on assistant turns, tools given without the {"type", "function"} wrapper, and
# enable_thinking=false (an empty think block, so the prompt's last special token is </think>).
CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_query=messages|length - 1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' and m.content is string
        and not (m.content.startswith('<tool_output>') and m.content.endswith('</tool_output>')) -%}
    {%- set ns.last_query = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- set has_system = messages|length > 0 and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system or system_settings -%}
  {{- '<system_setting>\n' -}}
  {%- if system_settings -%}{{- system_settings + '\n' -}}{%- endif -%}
  {%- if has_system -%}{{- messages[0].content + '\n' -}}{%- endif -%}
  {{- '</system_setting>\n\n' -}}
{%- endif -%}
{{- '<global_setting>\nthink_mode=True\n</global_setting>' -}}
{%- if tools -%}
  {{- '\n\n<tool_list>\n[' -}}
  {%- for tool in tools -%}
    {%- set fn = tool.function if tool.function is defined else tool -%}
    {{- '{"type": "function", "function": ' + (fn | tojson) + '}' -}}
    {%- if not loop.last -%}{{- ',' -}}{%- endif -%}
  {%- endfor -%}
  {{- ']\n</tool_list>' -}}
{%- endif -%}
{{- '<|im_end|>\n\n' -}}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n\n' -}}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string
                        else (m.thoughts if m.thoughts is string else '') -%}
    {%- if not reasoning and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n' -}}
    {%- endif -%}
    {%- if content -%}{{- '<response>\n' + content + '\n</response>\n' -}}{%- endif -%}
    {%- for call in m.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
      {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) -}}
      {{- '}\n</tool_call>\n' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>tool' -}}{%- endif -%}
    {{- '\n<tool_output>' + (m.content | tojson) + '</tool_output>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n<think>\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
""".strip()


def _corpus_lines() -> list[str]:
    text = (demo_data_dir() / "corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.split("\n") if line]


def _train(vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus_lines()), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, hard_vocab_limit=False,
        character_coverage=0.9999, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD,
        user_defined_symbols=[t for t, _ in ADDED_TOKENS] + _WHITESPACE_PIECES,
        num_threads=1, shuffle_input_sentence=False, input_sentence_size=0, minloglevel=2,
    )
    return model.getvalue()


def _added_entry(content: str, special: bool) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def build_tokenizer(out_dir: Path, vocab_size: int = 4096) -> None:
    """Train the demo SentencePiece model and write the HF-style tokenizer files into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    proto = _train(vocab_size)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    decoder = {str(sp.piece_to_id(t)): _added_entry(t, True) for t in (UNK, BOS, EOS, PAD)}
    decoder.update({str(sp.piece_to_id(t)): _added_entry(t, special) for t, special in ADDED_TOKENS})
    extra = [t for t, special in ADDED_TOKENS if special]
    config = {
        "tokenizer_class": "Ernie4_5_Tokenizer",
        "add_bos_token": False,  # the chat template writes every special token the prompt needs
        "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
        "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
        "additional_special_tokens": extra,
        "added_tokens_decoder": decoder,
        "model_max_length": 131072,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD,
                   "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
                   "additional_special_tokens": extra}
    (out_dir / "tokenizer.model").write_bytes(proto)
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
