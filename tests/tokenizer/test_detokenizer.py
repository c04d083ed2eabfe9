"""Streaming detokenization: any chunking of the ids gives exactly the full decode."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tok_strategies import texts

from ernie_serve.tokenizer import ErnieTokenizer, IncrementalDetokenizer
from ernie_serve.tokenizer.detokenizer import CONTEXT_IDS


def _stream(tok: ErnieTokenizer, ids: list[int], cuts: list[int], skip: bool, prompt: list[int] = []) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    bounds = [0] + sorted(cuts) + [len(ids)]
    deltas = [detok.step(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@settings(max_examples=200, deadline=None)
@given(text=texts, skip=st.booleans(), data=st.data())
def test_any_chunking_concatenates_to_the_full_decode(tok: ErnieTokenizer, text: str, skip: bool,
                                                       data: st.DataObject) -> None:
    ids = tok.encode(text)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1))
    prompt = tok.encode(data.draw(texts))
    deltas = _stream(tok, ids, cuts, skip, prompt)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_character_split_over_byte_pieces_is_held_until_complete(tok: ErnieTokenizer) -> None:
    ids = tok.encode("a😀b")
    assert len(ids) == 6  # 'a', four byte-fallback pieces, 'b'
    deltas = _stream(tok, ids, list(range(1, len(ids))), skip=False)
    assert deltas == ["a", "", "", "", "😀", "b", ""]


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok: ErnieTokenizer) -> None:
    ids = tok.encode("x😀")[:3]
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids) == "x"
    assert detok.num_pending == 2
    assert detok.flush() == "\ufffd\ufffd"


def test_leading_space_of_first_generated_token_survives(tok: ErnieTokenizer) -> None:
    prompt, out = tok.encode("Hello"), tok.encode(" world, how are you")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(detok.step([i]) for i in out) == " world, how are you"


def test_state_is_a_bounded_window_and_can_be_rebuilt_from_it(tok: ErnieTokenizer) -> None:
    ids = tok.encode("The capital of France is Paris. 巴黎是法国的首都 😀 " * 20)
    detok = IncrementalDetokenizer(tok)
    for k, i in enumerate(ids[:200]):
        detok.step([i])
        assert len(detok.context_ids) <= CONTEXT_IDS + 3
    # A fresh instance built from the window continues exactly where the old one would.
    ctx, pending = detok.context_ids, detok.num_pending
    rebuilt = IncrementalDetokenizer(tok, prompt_ids=ctx[:len(ctx) - pending])
    rest = ids[200:]
    assert rebuilt.step(ctx[len(ctx) - pending:] + rest) + rebuilt.flush() == detok.step(rest) + detok.flush()
    assert detok.text == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_any_ids_of_the_vocabulary_stream_to_their_decode(tok: ErnieTokenizer, data: st.DataObject,
                                                          skip: bool) -> None:
    """Ids no text encodes to (bare byte pieces, specials between plain pieces) included: the no-decode path
    must agree with SentencePiece wherever it is taken."""
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 1))
    assert "".join(_stream(tok, ids, cuts, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_plain_pieces_stream_without_decoding(tok: ErnieTokenizer) -> None:
    """A step whose ids continue a run of plain pieces is its pieces' text: no window decode a token."""
    ids = tok.encode(" the capital of France is Paris and the capital of Italy is Rome" * 4)
    calls = []
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Hello"))
    detok._tokenizer = type("Counting", (), {"decode": lambda _, i, **k: calls.append(1) or tok.decode(i, **k)})()
    text = "".join(detok.step([i]) for i in ids)
    assert text == tok.decode(ids)
    assert len(calls) <= 4, f"{len(calls)} decodes for {len(ids)} plain tokens"
