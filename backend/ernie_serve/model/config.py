"""ERNIE-4.5 architecture hyper-parameters, read from a checkpoint's config.json.

One dataclass for the dense (Ernie4_5ForCausalLM) and MoE (Ernie4_5_MoeForCausalLM) models and for
both checkpoint dialects (HF "-PT" and "-Paddle"), so the rest of the code never looks at raw JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")


@dataclass
class ErnieModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    # MoE (moe_num_experts == 0 means a dense model)
    moe_num_experts: int = 0
    moe_k: int = 0
    moe_intermediate_size: int = 0
    moe_num_shared_experts: int = 0
    moe_layer_start_index: int = 0
    moe_layer_end_index: int = -1
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    num_nextn_predict_layers: int = 0
    compression_ratio: float = 1.0
    bos_token_id: int = 1
    eos_token_id: int | list[int] = 2
    pad_token_id: int = 0
    quantization_config: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def checkpoint_dtype(self) -> str:
        """The dtype the checkpoint declares (HF's torch_dtype, `dtype` from transformers 5 on), float32 if none."""
        return str(self.raw.get("torch_dtype") or self.raw.get("dtype") or "float32")

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """The HF / ERNIEKit rule: (L+1) % interval == 0 and start <= L <= end."""
        if not self.is_moe:
            return False
        end = self.moe_layer_end_index if self.moe_layer_end_index >= 0 else self.num_hidden_layers - 1
        return (layer + 1) % self.moe_layer_interval == 0 and self.moe_layer_start_index <= layer <= end

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ErnieModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            # Paddle checkpoints sometimes name the architecture differently; the MoE fields decide.
            if any(a.startswith("Ernie4_5") for a in archs):
                arch = "Ernie4_5_MoeForCausalLM" if cfg.get("moe_num_experts") else "Ernie4_5ForCausalLM"
            else:
                raise ValueError(
                    f"config.json: unsupported architectures {archs!r}; expected one of {SUPPORTED_ARCHITECTURES}"
                )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"config.json: missing required field {key!r}")
        heads = int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        experts = cfg.get("moe_num_experts") or 0
        if isinstance(experts, list):  # multimodal configs list [text, vision]
            experts = experts[0]
        moe_k = cfg.get("moe_k", cfg.get("num_experts_per_tok", 0)) or 0
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 500000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            moe_num_experts=int(experts) if arch == "Ernie4_5_MoeForCausalLM" else 0,
            moe_k=int(moe_k),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
            moe_num_shared_experts=int(cfg.get("moe_num_shared_experts", 0) or 0),
            moe_layer_start_index=int(_first(cfg.get("moe_layer_start_index", 0))),
            moe_layer_end_index=int(_first(cfg.get("moe_layer_end_index", -1))),
            moe_layer_interval=int(cfg.get("moe_layer_interval", 1) or 1),
            moe_norm_min=float(cfg.get("moe_norm_min", 1e-12)),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
            compression_ratio=float(cfg.get("compression_ratio", 1.0) or 1.0),
            bos_token_id=int(cfg.get("bos_token_id", 1)),
            eos_token_id=cfg.get("eos_token_id", 2),
            pad_token_id=int(cfg.get("pad_token_id", 0) or 0),
            quantization_config=cfg.get("quantization_config"),
            raw=dict(cfg),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ErnieModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: --model must be a checkpoint directory with config.json")
        return cls.from_dict(json.loads(path.read_text()))


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value
