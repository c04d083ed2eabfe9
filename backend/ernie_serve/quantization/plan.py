"""Which weights are quantized how: from `--quantization` or a checkpoint's `quantization_config`.

One method applies to the dense linears (attention qkv/o, dense MLPs, shared experts) and one to the
routed MoE experts, optionally per layer range (FastDeploy's 2-bit 300B: wint4 experts in layers
0-6, wint2 in 7-53). Embeddings, norms, the fp32 router gate and its bias, and lm_head are never
quantized. FastDeploy's wint2 and W4A8 are MoE formats: their dense linears use wint8.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .formats import METHODS

KV_CACHE_TYPES = ("int8",)
_DENSE_FOR = {"wint8": "wint8", "wint4": "wint4", "block_wise_fp8": "block_wise_fp8", "wint2": "wint8",
              "w4a8": "wint8"}


@dataclass
class QuantPlan:
    dense: str | None = None
    moe: str | None = None
    moe_ranges: list[tuple[int, int, str]] = field(default_factory=list)  # (first, last, method) overrides
    kv_cache: str | None = None  # "int8": the C8 cache
    prequantized: bool = False  # the checkpoint holds quant_weight/... tensors

    def moe_method(self, layer: int) -> str | None:
        for first, last, method in self.moe_ranges:
            if first <= layer <= last:
                return method
        return self.moe

    @property
    def quantizes_weights(self) -> bool:
        return bool(self.dense or self.moe or self.moe_ranges)

    @classmethod
    def for_method(cls, method: str) -> "QuantPlan":
        _check(method, "quantization")
        return cls(dense=_DENSE_FOR[method], moe=method)

    @classmethod
    def resolve(cls, quantization: str | None, quantization_config: dict[str, Any] | None) -> "QuantPlan | None":
        """The plan for a load: the checkpoint's pre-quantized config wins (a different --quantization is
        an error); otherwise --quantization, else the config's types (online quantization)."""
        from_ckpt = cls.from_config(quantization_config) if quantization_config else None
        if from_ckpt is not None and from_ckpt.prequantized:
            if quantization and quantization != from_ckpt.method_name:
                raise ValueError(f"--quantization {quantization} conflicts with this pre-quantized checkpoint "
                                 f"({from_ckpt.method_name}); drop the flag to serve it as it is")
            return from_ckpt
        if quantization:
            plan = cls.for_method(quantization)
            plan.kv_cache = from_ckpt.kv_cache if from_ckpt else None
            return plan
        return from_ckpt if from_ckpt and (from_ckpt.quantizes_weights or from_ckpt.kv_cache) else None

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> "QuantPlan":
        """FastDeploy's quantization_config: {quantization: "mix_quant" | "wint2" | <method>,
        dense_quant_type, moe_quant_type, kv_cache_quant_type, is_quantized, is_permuted,
        moe_quant_config: {<name>: {quant_type, quant_start_layer, quant_end_layer}}}."""
        if qc.get("is_permuted"):
            raise ValueError("quantization_config.is_permuted: this checkpoint's weights are in FastDeploy's "
                             "permuted (CUTLASS-interleaved) layout, which this server does not read; "
                             "quantize the bf16 checkpoint with scripts/quantize_checkpoint.py instead")
        if qc.get("hadamard_block_size"):
            raise ValueError("quantization_config.hadamard_block_size: Hadamard-rotated weights are not supported")
        name = qc.get("quantization")
        base = _DENSE_FOR.get(name) and cls.for_method(name)
        dense = qc.get("dense_quant_type", base.dense if base else None)
        moe = qc.get("moe_quant_type", base.moe if base else None)
        ranges = []
        for sub in (qc.get("moe_quant_config") or {}).values():
            if isinstance(sub, dict) and "quant_type" in sub:
                ranges.append((int(sub.get("quant_start_layer", 0)), int(sub.get("quant_end_layer", 1 << 30)),
                               _check(sub["quant_type"], "moe_quant_config.quant_type")))
        if ranges and moe not in METHODS:
            moe = None  # e.g. FastDeploy's "w4w2": the ranges say it all
        kv = qc.get("kv_cache_quant_type") or None
        if kv is not None and kv not in KV_CACHE_TYPES:
            raise ValueError(f"quantization_config.kv_cache_quant_type must be one of {KV_CACHE_TYPES}, got {kv!r}")
        return cls(dense=_check(dense, "dense_quant_type"), moe=_check(moe, "moe_quant_type"), moe_ranges=ranges,
                   kv_cache=kv, prequantized=bool(qc.get("is_quantized", False)))

    @property
    def method_name(self) -> str:
        """The --quantization value this plan corresponds to ("mix_quant" when it is none of them)."""
        for m in METHODS:
            if self.dense == _DENSE_FOR[m] and self.moe == m and not self.moe_ranges:
                return m
        return "mix_quant"

    def to_config(self, prequantized: bool) -> dict[str, Any]:
        """quantization_config for a checkpoint's config.json."""
        qc: dict[str, Any] = {"quantization": self.method_name, "dense_quant_type": self.dense,
                              "moe_quant_type": self.moe, "is_quantized": prequantized, "is_permuted": False}
        if self.kv_cache:
            qc["kv_cache_quant_type"] = self.kv_cache
        if self.moe_ranges:
            qc["moe_quant_config"] = {f"moe_{m}_quant_config": {"quant_type": m, "quant_start_layer": a,
                                                                "quant_end_layer": b}
                                      for a, b, m in self.moe_ranges}
        return qc


def _check(method: str | None, what: str) -> str | None:
    if method in (None, "", "none", "None"):
        return None
    if method not in METHODS:
        raise ValueError(f"{what} must be one of {', '.join(METHODS)}, got {method!r}")
    return method
