"""Where the project keeps what it builds locally (the embedded tiny model, benchmark checkpoints)."""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def repo_root() -> Path | None:
    """The checkout this package runs from, or None when installed from a wheel."""
    root = _PACKAGE_DIR.parent.parent
    return root if (root / "pyproject.toml").exists() and (root / "model_repository").exists() else None


def models_dir() -> Path:
    """Git-ignored home of locally built checkpoints; ERNIE_MODELS_DIR overrides it."""
    env = os.environ.get("ERNIE_MODELS_DIR")
    if env:
        return Path(env)
    root = repo_root()
    return (root / ".cache" / "models") if root else Path.home() / ".cache" / "ernie_serve" / "models"


def build_dir() -> Path:
    """Git-ignored home of native code compiled for the host (ERNIE_BUILD_DIR overrides it)."""
    env = os.environ.get("ERNIE_BUILD_DIR")
    if env:
        return Path(env)
    root = repo_root()
    return (root / ".cache" / "build") if root else Path.home() / ".cache" / "ernie_serve" / "build"


def tiny_model_dir() -> Path:
    """The embedded demo model every entry point defaults to."""
    return models_dir() / "tiny-ernie-moe"


def demo_data_dir() -> Path:
    return _PACKAGE_DIR / "demo" / "data"
