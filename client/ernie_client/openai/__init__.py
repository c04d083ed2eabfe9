"""OpenAI-compatible HTTP server over the `ernie` Triton ensemble (see openai_server.py for the CLI)."""
from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
