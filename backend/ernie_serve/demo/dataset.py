"""The demo chat set the tiny model is fitted to, and its digest: paddle-free, because ensure_tiny_model reads the
digest on every start-up (the build stamp) in processes that must not import Paddle (ernie-serve's own: Paddle's
failure-signal handler would take its SIGTERM and skip the drain)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..paths import demo_data_dir


def dataset_path() -> Path:
    return demo_data_dir() / "chat_demo.jsonl"


def dataset_digest(path: Path | None = None) -> str:
    """Short hash of the dataset file: part of the build stamp, so editing the data rebuilds the model."""
    return hashlib.sha256(Path(path or dataset_path()).read_bytes()).hexdigest()[:16]
