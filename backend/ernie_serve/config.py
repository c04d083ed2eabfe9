"""The one engine configuration object. Field names are FastDeploy's CLI flags with `_`;
defaults are FastDeploy's, except where a CPU default has to differ (marked)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from . import kv_protocols

QUANTIZATIONS = ("wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
SPLITWISE_ROLES = ("mixed", "prefill", "decode")
EXECUTION_BACKENDS = ("auto", "reference", "kernels", "simulated")
SIMULATED_FIELDS = ("simulated_gpu", "simulated_model", "simulated_time_scale")
# --dtype (vLLM's and FastDeploy's flag): the activation / float-weight dtype, with vLLM's aliases
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
          "half": "float16"}
# FastDeploy's --guided-decoding-backend: structured outputs run on llguidance ("guidance", what "auto" picks)
GUIDED_DECODING_BACKENDS = ("auto", "guidance", "off")
DEFAULT_CPU_KV_BYTES = 1 << 30  # the KV pool on CPU when kv_cache_memory is not given
# speculative_config keys per method; mtp's "model": a separate checkpoint holding the MTP head
SPECULATIVE_KEYS = {"ngram": {"method", "num_speculative_tokens", "max_ngram", "min_ngram"},
                    "mtp": {"method", "num_speculative_tokens", "model"}}


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = the embedded tiny model
    tokenizer: str | None = None  # defaults to `model`
    skip_tokenizer_init: bool = False  # token ids in and out only (no text, no stop strings), as vLLM
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: 8192 (FastDeploy V1 scheduler)
    block_size: int = 64
    gpu_memory_utilization: float = 0.9  # GPU KV sizing; only the default is accepted on the CPU path
    kv_cache_ratio: float = 0.75  # FastDeploy's V0 scheduler; accepted only at its default (V1 has none)
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
    # prefill/decode disaggregation (serving/disagg.py), FastDeploy's names. Each P or D server's own two ports:
    # engine_worker_queue_port, where it takes its peers' messages (P: prompts from decode servers; D: prefill
    # servers' results), and cache_queue_port, its KV endpoint (P: sends blocks from it; D: receives them on it),
    # so pings and aborts never queue behind megabytes of KV. innode_prefill_ports: the prefill servers' queue
    # ports a decode server sends prompts to (comma-separated)
    engine_worker_queue_port: int | None = None
    innode_prefill_ports: str | None = None
    cache_queue_port: int | None = None
    # the path the KV bytes take between P and D (kv_protocols.py): "tcp" (our framing on the sockets above) or
    # FastDeploy's "rdma" / "ipc" (NIXL), a comma-separated preference list. FastDeploy defaults to "ipc"; here
    # "tcp", which needs no transfer engine installed (docs/kv-transfer.md)
    cache_transfer_protocol: str = "tcp"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    tool_parser_plugin: str | None = None
    chat_template: str | None = None
    guided_decoding_backend: str = "auto"  # "off": structured-output requests are refused
    enable_logprob: bool = True
    max_logprobs: int = 20
    seed: int = 0
    max_waiting_requests: int = 1024
    # SGLang's --stream-interval: a stream's responses carry at least this many new tokens (the first token and
    # the last response go out at once); a consumer that lags gets several steps' tokens in one response anyway
    stream_interval: int = 1
    # Time-based coalescing (serving/stream_pacing.py): a stream's next response waits until this many ms have
    # passed since its previous one, so at a GPU's step rate a response carries a few tokens instead of one and every
    # hop after the engine costs less a token. The first token and the final response never wait; a token waits at
    # most this long plus one engine step. 0: a response per step.
    stream_coalesce_ms: float = 0.0
    # vLLM v1's EngineCore split: a server's engine (scheduler, model runner, output processing) runs in a process of
    # its own, so ernie_moe's response side (tensors, pacing, sends on four threads) never holds the GIL the step loop
    # needs between device steps; one message a step each way (engine/core_client.py). None: on for a mixed-role
    # server; a prefill / decode server keeps it in process (its KV hand-off reads and writes the engine's cache), and
    # the offline LLM has no response side to split from
    engine_core_process: bool | None = None
    disable_progress_bar: bool = False
    # "reference": the Paddle CPU path (the oracle); "kernels": the triton-lang kernels (kernels_backend/) on a GPU,
    # or on the CPU under TRITON_INTERPRET=1; "auto": kernels when a GPU is visible, else reference;
    # "simulated": a benchmark instrument, never a model and never auto's pick (simulated_backend/): steps sleep for
    # the modeled step time of simulated_model on simulated_gpu, x simulated_time_scale, and replay fixed text
    execution_backend: str = "auto"
    simulated_gpu: str | None = None  # h200, h100, h800, a800 (simulated_backend/targets.py)
    simulated_model: str | None = None  # ernie-4.5-21b-a3b, ernie-4.5-300b-a47b
    simulated_time_scale: float = 1.0  # > 1 slows the simulated GPU down (a small host can then keep pace)
    use_cudagraph: bool = False  # decode steps replayed from CUDA graphs (kernels backend on a GPU)
    # vLLM's --async-scheduling: the forward and sampling run on a thread of their own, the next step is planned while
    # one runs (ahead of its tokens where no request's sampling reads its output), and outputs are made while the
    # next forward runs: the device waits for no host work between steps. Same tokens; a request that stops on eos
    # or a string computes a token or two more, which are dropped. None: on where the model runs on a device (no
    # CPU threads of its own: the kernels backend on a GPU, the simulated device) in a mixed role, off on the CPU
    # reference backend, whose forward needs the host's cores the overlap would take (LLMEngine).
    async_scheduling: bool | None = None
    # The dtype activations and float weights compute in: "auto" is what the backend runs well (bfloat16 on the
    # kernels backend's GPU, float32 in triton's interpreter; on the CPU reference backend the checkpoint's bfloat16
    # where its C kernels run it, else float32: reference_backend/support.resolve_auto_dtype); another value is checked
    # against the backend at start-up and refused with what it supports.
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):
            self.speculative_config = json.loads(self.speculative_config) if self.speculative_config else None
        if isinstance(self.innode_prefill_ports, (list, tuple)):
            self.innode_prefill_ports = ",".join(str(p) for p in self.innode_prefill_ports)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192
        if not self.enable_chunked_prefill:
            # Without chunking a whole prompt must fit one step.
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
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
        need(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[self.dtype]
        need(self.execution_backend in EXECUTION_BACKENDS, "execution_backend",
             f"must be one of {', '.join(EXECUTION_BACKENDS)}")
        self._check_simulated()
        need(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
             f"must be one of {', '.join(QUANTIZATIONS)}")
        need(self.splitwise_role in SPLITWISE_ROLES, "splitwise_role", f"must be one of {', '.join(SPLITWISE_ROLES)}")
        if self.guided_decoding_backend == "xgrammar":
            raise ValueError("guided_decoding_backend='xgrammar' is not available: structured outputs run on "
                             "llguidance here (docs/structured-outputs.md says why); use 'auto' or 'guidance', "
                             "or 'off'")
        need(self.guided_decoding_backend in GUIDED_DECODING_BACKENDS, "guided_decoding_backend",
             f"must be one of {', '.join(GUIDED_DECODING_BACKENDS)}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        for port in ("engine_worker_queue_port", "cache_queue_port"):
            need(getattr(self, port) is None or 0 < getattr(self, port) < 65536, port, "must be a TCP port")
        self._check_splitwise()
        need(self.swap_space is None or self.swap_space >= 0, "swap_space", "must be >= 0 GB")
        self._check_swap_space_fits()
        self._check_scheduler_env()
        need(self.max_logprobs <= 20, "max_logprobs", "must be <= 20")
        need(isinstance(self.stream_interval, int) and self.stream_interval >= 1, "stream_interval",
             "must be an integer >= 1 (tokens a streamed response carries at least)")
        need(isinstance(self.stream_coalesce_ms, (int, float)) and 0 <= self.stream_coalesce_ms <= 1000,
             "stream_coalesce_ms", "must be a number of milliseconds from 0 to 1000")
        self._check_speculative()
        if self.engine_core_process and self.splitwise_role != "mixed":
            raise ValueError(f"engine_core_process=True is not supported with splitwise_role="
                             f"{self.splitwise_role!r}: a prefill or decode server's KV hand-off runs in the engine's "
                             "process; leave --engine-core-process unset (or false) for the P/D roles")
        self._refuse_unbuilt()

    def _check_simulated(self) -> None:
        """The simulated_* fields belong to execution_backend='simulated', which needs a GPU and a model named (their
        names are checked by simulated_backend/support.py, with the engine's other start-up checks)."""
        if self.execution_backend != "simulated":
            given = [f"{name}={getattr(self, name)!r}" for name in SIMULATED_FIELDS
                     if getattr(self, name) != EngineConfig.__dataclass_fields__[name].default]
            if given:
                raise ValueError(f"{', '.join(given)} is not supported with execution_backend="
                                 f"{self.execution_backend!r}: the simulated_* fields configure "
                                 "execution_backend='simulated' (--execution-backend simulated)")
            return
        for name in ("simulated_gpu", "simulated_model"):
            if not getattr(self, name):
                raise ValueError(f"execution_backend='simulated' needs {name} (--{name.replace('_', '-')}): the "
                                 "target GPU and model shape whose step time it models")
        if not (isinstance(self.simulated_time_scale, (int, float)) and self.simulated_time_scale > 0):
            raise ValueError(f"simulated_time_scale must be > 0 (1: the modeled GPU's pace; S > 1: S times slower), "
                             f"got {self.simulated_time_scale!r}")
        self.simulated_time_scale = float(self.simulated_time_scale)

    def _check_swap_space_fits(self) -> None:
        """The CPU tier is allocated whole at start-up: one larger than the host's memory can only fail there, as a
        bare allocation error, so refuse it here naming the flag and both figures."""
        if not self.swap_space:
            return
        total, available = host_memory_bytes()
        if self.swap_space * (1 << 30) > total:
            raise ValueError(f"swap_space (--swap-space) is {self.swap_space:g} GiB but this host has "
                             f"{total / (1 << 30):.1f} GiB of memory ({available / (1 << 30):.1f} GiB available): "
                             "the CPU tier of the prefix cache lives in host memory; give at most that")

    @staticmethod
    def _check_scheduler_env() -> None:
        """FastDeploy's ENABLE_V1_KVCACHE_SCHEDULER: 1 (its default) is the V1 scheduler, the only one here."""
        value = os.environ.get("ENABLE_V1_KVCACHE_SCHEDULER", "1").strip().lower()
        if value not in ("1", "true", "yes", "on"):
            raise ValueError(f"ENABLE_V1_KVCACHE_SCHEDULER={value!r} is not supported: this engine has only the V1 "
                             "scheduler (one token budget shared by decodes and chunked prefills, one block pool "
                             "the engine manages, FastDeploy's default); unset it or set it to 1")

    def _check_speculative(self) -> None:
        spec = self.speculative_config
        if spec is None:
            return
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        method = spec.get("method")
        if method not in SPECULATIVE_KEYS:
            raise ValueError(f"speculative_config.method {method!r} is not available: supported: "
                             f"{', '.join(repr(m) for m in SPECULATIVE_KEYS)}")
        unknown = sorted(set(spec) - SPECULATIVE_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; "
                             f"known for {method!r}: {', '.join(sorted(SPECULATIVE_KEYS[method]))}")
        k = spec.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 5:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 5], got {k!r}")
        if method == "ngram":
            lo, hi = spec.get("min_ngram", 1), spec.get("max_ngram", 3)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError(f"speculative_config needs integers 1 <= min_ngram <= max_ngram, got {lo!r}, {hi!r}")
        elif spec.get("model") is not None and not isinstance(spec["model"], str):
            raise ValueError(f"speculative_config.model must be a checkpoint directory path, got {spec['model']!r}")

    @property
    def prefill_ports(self) -> list[int]:
        """innode_prefill_ports as a list."""
        raw = self.innode_prefill_ports or ""
        return [int(p) for p in raw.replace(" ", "").split(",") if p]

    def _check_splitwise(self) -> None:
        role = self.splitwise_role
        try:
            ports = self.prefill_ports
        except ValueError:
            raise ValueError(f"innode_prefill_ports must be comma-separated TCP ports, got "
                             f"{self.innode_prefill_ports!r}") from None
        if role == "decode" and not ports:
            raise ValueError("splitwise_role='decode' needs innode_prefill_ports: the engine_worker_queue_port of "
                             "each prefill server this decode server sends prompts to")
        if role != "decode" and ports:
            raise ValueError(f"innode_prefill_ports is for splitwise_role='decode', got splitwise_role={role!r}")
        if role == "prefill" and self.engine_worker_queue_port is None:
            raise ValueError("splitwise_role='prefill' needs engine_worker_queue_port: the port decode servers "
                             "send prompts to (they list it in --innode-prefill-ports)")
        for name in ("engine_worker_queue_port", "cache_queue_port"):
            if role == "mixed" and getattr(self, name) is not None:
                raise ValueError(f"{name} is a prefill or decode server's own queue port, where its P/D peers reach "
                                 f"it; a mixed server has none, got splitwise_role='mixed'")
            if getattr(self, name) in ports:
                raise ValueError(f"{name}={getattr(self, name)} is also in innode_prefill_ports: a decode server's "
                                 f"own ports are its own, the prefill servers' are theirs")
        if self.cache_queue_port is not None and self.cache_queue_port == self.engine_worker_queue_port:
            raise ValueError(f"cache_queue_port and engine_worker_queue_port must differ, both are "
                             f"{self.cache_queue_port}")
        if role == "mixed" and self.cache_transfer_protocol != kv_protocols.DEFAULT:
            raise ValueError(f"cache_transfer_protocol={self.cache_transfer_protocol!r} is how a prefill server's KV "
                             "reaches its decode servers; a mixed server moves no KV, got splitwise_role='mixed'")
        kv_protocols.check(self.cache_transfer_protocol)

    def _refuse_unbuilt(self) -> None:
        """FastDeploy flags this build does not implement yet: refused with what is supported, never ignored. What one
        execution backend cannot run is that backend's to say (its support.py; executor_factory.check_supported)."""
        def refuse(name: str, why: str) -> None:
            raise ValueError(f"{name}={getattr(self, name)!r} is not supported: {why}")

        if self.data_parallel_size != 1:
            refuse("data_parallel_size", "one engine is one replica: serve N replicas with ernie-serve "
                                         "--data-parallel-size N (N ernie_moe instances, one engine each); "
                                         "only 1 is supported here")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            refuse("enable_expert_parallel", "experts are split across the tensor-parallel ranks; it needs "
                                             "tensor_parallel_size > 1")
        if self.kv_cache_ratio != 0.75:
            refuse("kv_cache_ratio", "it belongs to FastDeploy's V0 scheduler; this V1 scheduler shares one block "
                                     "pool between prefill and decode (only the default 0.75 is accepted)")
        if self.load_choices != "default_v1":
            refuse("load_choices", "there is one checkpoint loader; only 'default_v1' is supported")

    def check_kv_pool(self, num_blocks: int, remedy: str) -> None:
        """A KV pool must hold at least one max_model_len sequence; `remedy` says how to get more blocks."""
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise ValueError(f"KV pool of {num_blocks} blocks cannot hold one max_model_len={self.max_model_len} "
                             f"sequence ({need} blocks of {self.block_size}); {remedy} or lower max_model_len")

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
    def num_lookahead_tokens(self) -> int:
        """KV slots a decoding request needs beyond this step's tokens: MTP drafting writes its own KV at
        the next positions in the same step (vLLM's num_lookahead_tokens)."""
        spec = self.speculative_config
        return spec.get("num_speculative_tokens", 1) if spec and spec.get("method") == "mtp" else 0

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


def host_memory_bytes() -> tuple[int, int]:
    """(total, available) host memory in bytes, from /proc/meminfo (sysconf where it is missing)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, info.get("MemAvailable", total)
