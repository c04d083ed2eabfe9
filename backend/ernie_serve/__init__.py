"""ERNIE-4.5 serving engine: continuous batching over a paged KV cache, in Paddle."""
from . import _env  # noqa: F401  (must run before paddle is imported)
from .config import EngineConfig
from .outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams


def __getattr__(name):  # LLM pulls in paddle and the model; import it only when asked for
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind"]
