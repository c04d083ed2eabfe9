"""The MoE router on the device: the gate's fp32 logits, then top-k with ERNIE's correction bias.

router_logits: hidden [T, H] @ gate [H, E] in IEEE fp32, never TF32. A framework's fp32 matmul is not that
everywhere: Paddle's cuBLAS GEMMs take TF32 tensor cores on Ampere and later by default (FLAGS_allow_tf32_cublas),
torch's do not unless asked (torch.backends.cuda.matmul.allow_tf32), and TF32's 10-bit mantissa moves a logit by
~1e-3 relative, enough to swap experts whose scores nearly tie. Here both frameworks, and the fp32 CPU reference,
pick the same experts. The IEEE dot runs on the FMA units, not tensor cores: 2*T*H*E flops, a gate of 64 columns.

router_topk: softmax over the experts, choose the k largest of probs + bias, weight each chosen expert by its
unbiased probability renormalized over the k (the sum clipped below at norm_min). One program per token; the
experts fit one tile."""

from __future__ import annotations

from typing import Any

from ernie_kernels._runtime import contiguous, new_tensor, next_pow2, tl, triton

LOGIT_ROWS = 32  # tokens a router_logits program takes
LOGIT_DEPTH = 32  # hidden channels a K step


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


@triton.jit
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, T, H, E, stride_h, stride_w, stride_o, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr, E_PAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = rows < T
    rows = rows.to(tl.int64)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k[:, None] * stride_w + e[None, :], mask=k_mask[:, None] & e_mask[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_o + e[None, :], acc, mask=t_mask[:, None] & e_mask[None, :])


def router_logits(hidden: Any, gate: Any) -> Any:
    """hidden [T, H] (any float dtype; widened to fp32 as loaded) @ gate [H, E] fp32 -> fp32 [T, E], IEEE fp32
    products and sums (see the module doc)."""
    t, h = hidden.shape
    h2, e = gate.shape
    if h2 != h:
        raise ValueError(f"router gate {list(gate.shape)} does not fit hidden [T, {h}]")
    if hidden.stride(1) != 1:
        hidden = contiguous(hidden)
    gate = contiguous(gate)
    out = new_tensor(gate, [t, e], "float32")
    if t:
        _router_logits_kernel[(triton.cdiv(t, LOGIT_ROWS),)](
            hidden, gate, out, t, h, e, hidden.stride(0), gate.stride(0), out.stride(0), BLOCK_T=LOGIT_ROWS,
            BLOCK_K=LOGIT_DEPTH, E_PAD=max(16, next_pow2(e)))
    return out
