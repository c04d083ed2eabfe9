"""The one engine configuration object. Field names are FastDeploy's CLI flags with `_`;
defaults are FastDeploy's, except where a CPU default has to differ (marked)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

QUANTIZATIONS = ("wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
SPLITWISE_ROLES = ("mixed", "prefill", "decode")


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = the embedded tiny model
    tokenizer: str | None = None  # defaults to `model`
    skip_tokenizer_init: bool = False  # token ids in and out only (no text, no stop strings), as vLLM
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: 8192 (FastDeploy V1 scheduler)
    block_size: int = 64
    gpu_memory_utilization: float = 0.9
    kv_cache_ratio: float = 0.75  # kept for flag compatibility; the V1 scheduler ignores it
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV pool on CPU; None: 1 GiB (CPU-only flag)
    enable_prefix_caching: bool = True
    swap_space: float | None = None  # GB of CPU tier for evicted prefix blocks
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # cap on one prefill chunk per step; 0: no cap beyond the budget
    quantization: str | None = None
    load_choices: str = "default_v1"
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    splitwise_role: str = "mixed"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    chat_template: str | None = None
    enable_logprob: bool = True
    max_logprobs: int = 20
    seed: int = 0
    max_waiting_requests: int = 1024
    disable_progress_bar: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config) if self.speculative_config else None
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
        if self.splitwise_role == "decode":
            self.enable_prefix_caching = False  # as FastDeploy: decode instances receive KV, never share it
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        need(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(self.block_size >= 1, "block_size", "must be >= 1")
        need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
             f"must be one of {', '.join(QUANTIZATIONS)}")
        need(self.splitwise_role in SPLITWISE_ROLES, "splitwise_role", f"must be one of {', '.join(SPLITWISE_ROLES)}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        need(self.swap_space is None or self.swap_space >= 0, "swap_space", "must be >= 0 GB")
        need(self.max_logprobs <= 20, "max_logprobs", "must be <= 20")

    @property
    def prefill_chunk_limit(self) -> int:
        """Largest chunk one prefill may take in a step (long_prefill_token_threshold)."""
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        if threshold <= 0:
            return self.max_num_batched_tokens
        return threshold

    @property
    def sampling_class(self) -> str:
        return os.environ.get("FD_SAMPLING_CLASS", "base")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Accept flag spellings with '-' and reject unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        clean = {k.replace("-", "_"): v for k, v in kwargs.items()}
        unknown = sorted(set(clean) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**clean)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
