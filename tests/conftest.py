"""Shared fixtures: the embedded tiny model and a KV-leak check after engine tests."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

import ernie_serve  # noqa: F401  (sets the MKL environment before paddle loads)

SHARED_DIR = Path(__file__).resolve().parents[1].parent / "shared"
_CLIENT_TEST_DIRS = {"e2e", "reliability", "openai", "demo"}  # tests that hold gRPC clients


@pytest.fixture(autouse=True)
def _collect_client_garbage_between_tests(request):
    """Finalize a test's garbage here, not inside a later thread start. CPython 3.11 can run the cyclic GC while a
    new thread holds threading's shutdown-locks lock; a tritonclient gRPC client collected there joins its stream
    thread from __del__, which takes the same lock: the test process hung for good (seen once: main thread in
    start_stream's Thread.start, the new thread in InferenceServerClient.__del__ -> Thread._stop)."""
    yield
    if "tritonclient.grpc" in sys.modules and request.node.path.parent.name in _CLIENT_TEST_DIRS:
        gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from ernie_serve.demo.tiny_model import ensure_tiny_model

    return ensure_tiny_model()
