"""triton-lang kernels for ERNIE-4.5 serving. Each is tested against a reference: a NumPy one in `reference`,
or the engine's own reference layer for what the engine already defines (RoPE, the router, the C8 cache).

Launchers are imported lazily so `import ernie_kernels` (and the engine) works without triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAUNCHERS = {
    "rms_norm": "rmsnorm",
    "weight_only_linear": "weight_only_gemm",
    "moe_align_block_size": "moe_align",
    "fused_moe": "moe_fused",
    "unified_attention": "unified_attention",
    "kv_write": "kv_write",
    "rope_inplace": "rope",
    "silu_and_mul": "activation",
    "router_logits": "router",
    "router_topk": "router",
}

__all__ = list(_LAUNCHERS)


def __getattr__(name: str) -> Any:
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(f"ernie_kernels.{_LAUNCHERS[name]}"), name)
    raise AttributeError(f"module 'ernie_kernels' has no attribute {name!r}")
