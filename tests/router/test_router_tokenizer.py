"""The tokenizer.json written for sglang-router tokenizes as the served model does (HF `tokenizers`, the library the
router's Rust tokenizer is built on, against ErnieTokenizer), and is refused where the translation would not hold."""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from ernie_client.openai.router_tokenizer import RouterTokenizerError, router_tokenizer_dir
from ernie_serve.tokenizer import ErnieTokenizer

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "backend/ernie_serve/demo/data"


def _texts(tok: ErnieTokenizer) -> list[str]:
    lines = [line for line in (DATA / "corpus.txt").read_text(encoding="utf-8").split("\n") if line]
    rows = [json.loads(line) for line in (DATA / "chat_demo.jsonl").read_text().splitlines() if line]
    chats = [tok.apply_chat_template(row["messages"], tools=row.get("tools"), add_generation_prompt=True,
                                     tokenize=False) for row in rows]
    rng = random.Random(0)
    mixed = ["".join(rng.choice(lines)[rng.randint(0, 5):] + rng.choice(["", " ", "  ", "\n", "\t", " \n "])
                     for _ in range(3)) for _ in range(300)]
    edges = ["", " ", "  lead", "trail  ", "\n\n\n", "a  b\tc\n d 12345", "héllo wörld 😀 日本語 \u00a0x",
             "<|im_start|>user\nhi<|im_end|>\n<think>\nx</think><tool_call>{}</tool_call>", "<mask:3><|im_end|x"]
    return lines + chats + mixed + edges


def test_the_export_tokenizes_and_decodes_as_the_model_does(tiny_model_dir, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    out = router_tokenizer_dir(tiny_model_dir, tmp_path)
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    hf = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    ours = ErnieTokenizer.from_pretrained(tiny_model_dir)
    differ = [t for t in _texts(ours) if hf.encode(t, add_special_tokens=False).ids != ours.encode(t)]
    assert not differ, differ[:5]
    for text in _texts(ours)[:200]:
        assert hf.decode(ours.encode(text), skip_special_tokens=False) == text


def test_the_export_is_made_once_per_content_and_a_tokenizer_json_is_used_as_it_is(tiny_model_dir, tmp_path):
    first = router_tokenizer_dir(tiny_model_dir, tmp_path)
    mtime = (first / "tokenizer.json").stat().st_mtime_ns
    assert router_tokenizer_dir(tiny_model_dir, tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".partial-")]
    assert router_tokenizer_dir(first, tmp_path / "elsewhere") == first  # it has a tokenizer.json of its own


def test_normalizations_it_cannot_reproduce_are_refused_by_name(tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["a small corpus of words"] * 50 + ["more words here"]),
                                   model_writer=model, model_type="bpe", vocab_size=40, add_dummy_prefix=True,
                                   minloglevel=2, num_threads=1)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    with pytest.raises(RouterTokenizerError, match="add_dummy_prefix"):
        router_tokenizer_dir(tmp_path, tmp_path / "out")
    with pytest.raises(RouterTokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        router_tokenizer_dir(tmp_path / "out", tmp_path / "out2")
