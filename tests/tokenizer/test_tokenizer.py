"""Encode/decode and vocabulary behaviour of ErnieTokenizer on the demo tokenizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from tok_strategies import SPECIALS, texts

from ernie_serve.demo.tokenizer_builder import build_tokenizer
from ernie_serve.tokenizer import ErnieTokenizer

ROUND_TRIP_TEXTS = [
    "", "Hello world", " leading space", "   three leading", "trailing  ", "multiple     spaces inside",
    "line1\nline2\n\n\nline5\n", "\ttab\tseparated\t", "\r\nwindows line ends\r\n", "中文测试，你好！",
    "混合 mixed 文本 with 😀 emoji 🎉 and ❤️", "é composed and e\u0301 decomposed", "zero\u200bwidth\ufeff",
    "literal \u2581 sentencepiece marker\u2581\u2581", "\x00\x01 control", "<0x41> looks like a byte piece",
    '{"name": "get_weather", "arguments": {"location": "Paris"}}', "def f(x):\n    return x + 1\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_of_encode_is_exact(tok: ErnieTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_in_text_map_to_single_ids(tok: ErnieTokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<response>\nok\n</response>"
    ids = tok.encode(text)
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<response>", "</response>"):
        assert tok.token_to_id(special) in ids
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == text
    for special in SPECIALS:
        assert tok.encode(f"a{special}b") == tok.encode("a") + [tok.token_to_id(special)] + tok.encode("b")


def test_special_ids_are_read_from_the_files(tok: ErnieTokenizer, tokenizer_dir: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert tok.bos_token_id == tok.token_to_id(config["bos_token"]) == 1
    assert tok.eos_token_id == tok.token_to_id(config["eos_token"]) == 2
    assert tok.unk_token_id == tok.token_to_id(config["unk_token"]) == 0
    assert tok.pad_token_id == tok.token_to_id(config["pad_token"])
    assert {tok.bos_token_id, tok.eos_token_id, tok.token_to_id("<|im_end|>")} <= tok.all_special_ids


def test_skip_special_tokens_drops_control_tokens_but_keeps_markup(tok: ErnieTokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|></s>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"


def test_vocab_lookups_are_consistent(tok: ErnieTokenizer) -> None:
    vocab = tok.get_vocab()
    assert len(tok) == tok.vocab_size == len(vocab) == 4096
    assert sorted(vocab.values()) == list(range(len(tok)))
    for token, i in list(vocab.items())[:400]:
        assert tok.token_to_id(token) == i and tok.id_to_token(i) == token
    assert tok.token_to_id("definitely-not-a-piece") is None
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([len(tok)])


def test_added_tokens_json_extends_the_vocab(tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|extra|>": 4096}))
    tok = ErnieTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 4097
    ids = tok.encode("x<|extra|>y")
    assert 4096 in ids and tok.decode(ids) == "x<|extra|>y"


def test_missing_model_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        ErnieTokenizer.from_pretrained(tmp_path)


def test_build_is_byte_identical_across_runs(tmp_path: Path) -> None:
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.model", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@settings(max_examples=200, deadline=None)
@given(texts)
def test_round_trip_property(tok: ErnieTokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
