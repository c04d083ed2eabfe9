"""Shared fixtures: the embedded tiny model and a KV-leak check after engine tests."""
from __future__ import annotations

from pathlib import Path

import pytest

import ernie_serve  # noqa: F401  (sets the MKL environment before paddle loads)

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from ernie_serve.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()
