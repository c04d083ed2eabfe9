"""Builds the demo tokenizer once per session; these tests need no model download."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

try:
    import ernie_serve  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "backend"))

from ernie_serve.demo.tokenizer_builder import build_tokenizer  # noqa: E402
from ernie_serve.tokenizer import ErnieTokenizer  # noqa: E402

# CI checks out the repo with shared/ as its sibling folder: <clone>/../shared
SHARED_DIR = (Path(__file__).resolve().parents[2] / ".." / "shared").resolve()
REAL_THINKING_TEMPLATE = SHARED_DIR / "reference" / "ernie45_thinking_chat_template.jinja"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> ErnieTokenizer:
    return ErnieTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def real_thinking_template() -> str:
    if not REAL_THINKING_TEMPLATE.is_file():
        pytest.skip(f"shared reference folder not found at {SHARED_DIR} (expected as a sibling of the repo)")
    return REAL_THINKING_TEMPLATE.read_text(encoding="utf-8")
