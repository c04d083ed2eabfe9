"""What the simulated backend can stand in for: GPUs (vendor datasheet figures), ERNIE-4.5 shapes (the real configs,
/work/shared/reference/ernie45-model.md) and the constants of the step model. Plain data, importing nothing of the
package, so the config check and the benchmark read it without loading an engine."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as its vendor datasheet gives it (SXM parts; dense figures, no sparsity)."""
    name: str
    hbm_bytes: float  # the datasheet's memory size, in decimal bytes
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense bfloat16 tensor-core FLOP/s
    host_link_bandwidth: float  # bytes/s one way between host and GPU (PCIe), what a KV swap moves over
    source: str


# NVIDIA datasheets: H200 SXM (141 GB HBM3e, 4.8 TB/s), H100 SXM5 and H800 SXM5 (80 GB HBM3, 3.35 TB/s; the H800
# differs in NVLink only), A800 SXM4 80 GB (HBM2e, 2,039 GB/s). Hopper: 989 dense bf16 TFLOPS (1,979 is with 2:4
# sparsity), PCIe Gen5 x16; Ampere: 312 dense bf16 TFLOPS, PCIe Gen4 x16.
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("h200", 141e9, 4.8e12, 989e12, 64e9, "NVIDIA H200 SXM datasheet"),
    GpuSpec("h100", 80e9, 3.35e12, 989e12, 64e9, "NVIDIA H100 SXM5 datasheet"),
    GpuSpec("h800", 80e9, 3.35e12, 989e12, 64e9, "NVIDIA H800 SXM5 datasheet"),
    GpuSpec("a800", 80e9, 2.039e12, 312e12, 32e9, "NVIDIA A800 SXM4 80GB datasheet"),
)}


@dataclass(frozen=True)
class ModelShape:
    """An ERNIE-4.5 MoE shape, field for field from its config.json (MoE layers: start..end, interval 1)."""
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dense_intermediate: int  # the dense FFN of the layers before moe_layer_start
    moe_intermediate: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    moe_layer_start: int
    moe_layer_end: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_start <= i <= self.moe_layer_end for i in range(self.num_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        h, d = self.hidden_size, self.head_dim
        return 2 * h * self.num_heads * d + 2 * h * self.num_kv_heads * d

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one layer (one FFN of num_shared_experts x moe_intermediate)."""
        return self.num_shared_experts * self.expert_params

    @property
    def gate_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one context token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (its top_k experts, the lm_head; not the embedding gather)."""
        return (self.num_layers * self.attention_params + self.num_dense_layers * self.dense_ffn_params
                + self.num_moe_layers * (self.top_k * self.expert_params + self.shared_expert_params
                                         + self.gate_params) + self.embedding_params)


# The published configs of ERNIE-4.5-21B-A3B (and -Thinking, the same shape) and ERNIE-4.5-300B-A47B.
MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("ernie-4.5-21b-a3b", 2560, 28, 20, 4, 128, 12288, 1536, 64, 6, 2, 1, 27, 103424, True),
    ModelShape("ernie-4.5-300b-a47b", 8192, 54, 64, 8, 128, 28672, 3584, 64, 8, 0, 3, 53, 103424, False),
)}

# --quantization -> bytes a quantized weight (FastDeploy's weight-only formats; per-channel scales left out: under
# 1% of the bytes). None: the float weights' bfloat16. Embedding, lm_head stay bfloat16 and the router fp32.
WEIGHT_BYTES = {None: 2.0, "wint8": 1.0, "block_wise_fp8": 1.0, "wint4": 0.5, "w4a8": 0.5, "wint2": 0.25}


@dataclass(frozen=True)
class SimulationConstants:
    """Every number of the step model that is not a datasheet figure or a config field: chosen, not measured.
    The benchmark writes them into its JSON beside its figures."""
    memory_efficiency: float = 0.70  # achieved / datasheet HBM bandwidth of decode's streaming reads (65-75% seen)
    compute_efficiency: float = 0.60  # achieved / datasheet dense bf16 FLOP/s of a prefill's GEMMs
    host_link_efficiency: float = 0.80  # achieved / datasheet PCIe bandwidth of a KV block swap
    fixed_step_seconds: float = 300e-6  # a step's launches, sampling kernels and the ids' copy to the host
    allreduce_seconds: float = 10e-6  # one all-reduce of a step's activations over NVLink (two a layer), with TP
    kv_dtype_bytes: int = 2  # the KV cache in bfloat16
    router_bytes: int = 4  # the router's weights stay fp32
    float_weight_bytes: int = 2  # embedding and lm_head in bfloat16
    activation_reserve_bytes: float = 2 * 2**30  # CUDA context, GEMM workspaces, graph pools: kept out of the KV pool
    activation_copies: int = 16  # live [tokens, hidden] bfloat16 buffers per batched token, kept out of the KV pool
    replay_memo_entries: int = 1 << 16  # requests whose replay start is remembered (see replay.py)


@dataclass(frozen=True)
class Target:
    """What one simulated engine stands for: a GPU (times tensor_parallel_size), a shape, its weights' bytes."""
    gpu: GpuSpec
    model: ModelShape
    quantization: str | None
    tensor_parallel_size: int = 1
    time_scale: float = 1.0
    constants: SimulationConstants = field(default_factory=SimulationConstants)

    @property
    def weight_bytes(self) -> float:
        return WEIGHT_BYTES[self.quantization]

    def describe(self) -> str:
        tp = f"{self.tensor_parallel_size} x " if self.tensor_parallel_size > 1 else ""
        return (f"{self.model.name} ({self.quantization or 'bfloat16'}) on {tp}{self.gpu.name}, "
                f"time scale {self.time_scale:g}")


def unknown_target(gpu: str | None, model: str | None) -> list[str]:
    """Why these names are not a target (empty: both are known), each naming the supported ones."""
    reasons = []
    if gpu not in GPUS:
        reasons.append(f"simulated_gpu={gpu!r} is not supported: the simulated backend knows "
                       f"{', '.join(GPUS)} (--simulated-gpu)")
    if model not in MODELS:
        reasons.append(f"simulated_model={model!r} is not supported: the simulated backend knows "
                       f"{', '.join(MODELS)} (--simulated-model)")
    return reasons
