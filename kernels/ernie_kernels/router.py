"""MoE router top-k with ERNIE's correction bias: softmax over the experts, choose the k largest of
probs + bias, weight each chosen expert by its unbiased probability renormalized over the k (the sum
clipped below at norm_min). One program per token; the experts fit one tile."""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import new_tensor, next_pow2, tl, triton


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, norm_min, TOPK: tl.constexpr,
                        K_PAD: tl.constexpr, E_PAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=e_mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    score = tl.where(e_mask, p + tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32), float("-inf"))
    j = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    ws = tl.zeros([K_PAD], dtype=tl.float32)
    for step in tl.static_range(TOPK):
        top = tl.max(score, axis=0)
        best = tl.min(tl.where(score == top, e, E_PAD), axis=0)  # ties: the lowest expert id
        ids = tl.where(j == step, best, ids)
        ws = tl.where(j == step, tl.sum(tl.where(e == best, p, 0.0), axis=0), ws)
        score = tl.where(e == best, float("-inf"), score)
    ws = ws / tl.maximum(tl.sum(ws, axis=0), norm_min)
    tl.store(ids_ptr + t * TOPK + j, ids, mask=j < TOPK)
    tl.store(w_ptr + t * TOPK + j, ws, mask=j < TOPK)


def router_topk(logits: Any, bias: Any, top_k: int, norm_min: float) -> tuple[Any, Any]:
    """logits [T, E] (fp32 gate outputs), bias [E] -> (expert ids int32 [T, k], weights fp32 [T, k])."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    ids = new_tensor(logits, [t, top_k], "int32")
    weights = new_tensor(logits, [t, top_k], "float32")
    if t:
        _router_topk_kernel[(t,)](logits, bias, ids, weights, e, logits.stride(0), float(norm_min), TOPK=top_k,
                                  K_PAD=next_pow2(top_k), E_PAD=next_pow2(e))
    return ids, weights
