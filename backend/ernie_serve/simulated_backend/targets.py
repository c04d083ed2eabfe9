"""What the simulated backend can stand in for: GPUs (vendor datasheet figures), ERNIE-4.5 shapes (the published
configs, read by the engine's own ErnieModelConfig) and the constants of the step model. Plain data: the start-up
check and the benchmark read it without loading an engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ErnieModelConfig


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
    """An ERNIE-4.5 MoE shape (its config.json, read as the engine reads a checkpoint's) and the parameter counts
    the step model needs from it."""
    name: str
    config: ErnieModelConfig

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.config.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        c = self.config
        return 2 * c.hidden_size * (c.q_size + c.kv_size)

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.config.hidden_size * self.config.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.config.hidden_size * self.config.moe_intermediate_size

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one layer (one FFN of moe_num_shared_experts x moe_intermediate_size)."""
        return self.config.moe_num_shared_experts * self.expert_params

    @property
    def gate_params(self) -> int:
        return self.config.hidden_size * self.config.moe_num_experts

    @property
    def embedding_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one context token."""
        return 2 * self.num_layers * self.config.kv_size * dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (its moe_k experts, the lm_head; not the embedding gather)."""
        return (self.num_layers * self.attention_params + self.num_dense_layers * self.dense_ffn_params
                + self.num_moe_layers * (self.config.moe_k * self.expert_params + self.shared_expert_params
                                         + self.gate_params) + self.embedding_params)

    def describe(self) -> dict:
        """The name and the config.json fields, for a benchmark's JSON."""
        return {"name": self.name, **self.config.raw}


def _shape(name: str, **fields) -> ModelShape:
    return ModelShape(name, ErnieModelConfig.from_dict({"architectures": ["Ernie4_5_MoeForCausalLM"], **fields}))


# The published configs of ERNIE-4.5-21B-A3B (and -Thinking, the same shape) and ERNIE-4.5-300B-A47B.
MODELS: dict[str, ModelShape] = {m.name: m for m in (
    _shape("ernie-4.5-21b-a3b", hidden_size=2560, num_hidden_layers=28, num_attention_heads=20,
           num_key_value_heads=4, head_dim=128, intermediate_size=12288, moe_intermediate_size=1536,
           moe_num_experts=64, moe_k=6, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=27,
           moe_layer_interval=1, vocab_size=103424, tie_word_embeddings=True),
    _shape("ernie-4.5-300b-a47b", hidden_size=8192, num_hidden_layers=54, num_attention_heads=64,
           num_key_value_heads=8, head_dim=128, intermediate_size=28672, moe_intermediate_size=3584,
           moe_num_experts=64, moe_k=8, moe_num_shared_experts=0, moe_layer_start_index=3, moe_layer_end_index=53,
           moe_layer_interval=1, vocab_size=103424, tie_word_embeddings=False),
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
