"""Parser tests need only a fake tokenizer: markers are single ids, other text is one id per char."""
from __future__ import annotations

import sys
from pathlib import Path

try:
    import ernie_serve  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend"))

import pytest  # noqa: E402

from parser_helpers import FakeTokenizer  # noqa: E402


@pytest.fixture
def tok() -> FakeTokenizer:
    return FakeTokenizer()
