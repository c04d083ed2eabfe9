"""Hypothesis strategies shared by the tokenizer tests (text that stresses SentencePiece edge cases)."""
from __future__ import annotations

from hypothesis import strategies as st

from ernie_serve.demo.tokenizer_builder import ADDED_TOKENS

SPECIALS = [t for t, _ in ADDED_TOKENS] + ["<s>", "</s>", "<unk>", "<pad>"]

texts = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
              st.sampled_from(SPECIALS + [" ", "  ", "\n", "\t", "\u2581", "😀", "中文", "\ufffd"])),
    max_size=10).map("".join)
