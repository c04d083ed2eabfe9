from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from ernie_serve.tokenizer import ErnieTokenizer

    return ErnieTokenizer.from_pretrained(tiny_model_dir)
