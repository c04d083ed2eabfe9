"""NumPy references the kernels are tested against (framework free, so they also run on a torch-only
GPU box). Quantized inputs use the layouts and the dequantization of ernie_serve.quantization.formats,
restated here so this package does not import the engine."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float = 1e-5, residual: np.ndarray | None = None):
    h = x.astype(np.float32) + (0 if residual is None else residual.astype(np.float32))
    y = w.astype(np.float32) * (h / np.sqrt((h * h).mean(-1, keepdims=True) + eps))
    return y if residual is None else (y, h)


def unpack_int4(p: np.ndarray) -> np.ndarray:
    u = p.view(np.uint8).astype(np.int16)
    out = np.empty(p.shape[:-2] + (p.shape[-2] * 2, p.shape[-1]), np.float32)
    out[..., 0::2, :] = ((u & 15) ^ 8) - 8
    out[..., 1::2, :] = (((u >> 4) & 15) ^ 8) - 8
    return out


def dequant(w: np.ndarray, scale: np.ndarray | None, method: str | None) -> np.ndarray:
    """Dequantized float32 weights [..., K, N] for the kernels' method names."""
    if method is None:
        return w.astype(np.float32)
    if method == "wint8":
        return w.astype(np.float32) * scale[..., None, :]
    if method in ("wint4", "w4a8"):
        return unpack_int4(w) * scale[..., None, :]
    if method == "wint2":
        return wint2_dequant(w, scale)
    if method == "block_wise_fp8":
        k, n = w.shape[-2:]
        full = np.repeat(np.repeat(scale, 128, -2), 128, -1)[..., :k, :n]
        return w.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * full
    raise ValueError(method)


def wint2_dequant(codes: np.ndarray, s: dict) -> np.ndarray:
    """CCQ: byte b -> v = floor(b * code_scale + code_zp + 0.5); the weights at k = 4r..4r+3 are the 6-bit
    fields (v >> 9, 6, 3, 0) & 63 minus 32, times the 64-row group's 4-bit local scale (group 2j in the high
    nibble of byte j) times the channel's super scale."""
    b = codes.astype(np.float32)
    v = np.floor(b * s["code_scale"][..., None, :] + s["code_zp"][..., None, :] + 0.5).astype(np.int64)
    kq, n = codes.shape[-2:]
    fields = np.empty(codes.shape[:-2] + (kq * 4, n), np.float32)
    for i, shift in enumerate((9, 6, 3, 0)):
        fields[..., i::4, :] = ((v >> shift) & 63) - 32
    ls = s["weight_scale"].astype(np.int64)
    nib = np.stack([ls >> 4, ls & 15], axis=-2).reshape(ls.shape[:-2] + (-1, n))[..., : kq * 4 // 64, :]
    gs = nib.astype(np.float32) * s["super_scales"][..., None, :]
    return fields * np.repeat(gs, 64, axis=-2)


def weight_only_linear(x: np.ndarray, qweight: np.ndarray, scale: np.ndarray, method: str) -> np.ndarray:
    return fake_quant_act(x, method) @ dequant(qweight, scale, method)


def _round_half_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def fake_quant_act(x: np.ndarray, method: str | None, act_scale: float | None = None) -> np.ndarray:
    """What the kernel's A-tile quantization does to activations (identity for weight-only methods)."""
    x = x.astype(np.float32)
    if method == "block_wise_fp8":
        t, k = x.shape
        g = x.reshape(t, -1, 128)
        amax = np.abs(g).max(-1, keepdims=True)
        s = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
        q = np.clip(g / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return (q * s).reshape(t, k)
    if method == "w4a8":
        return np.clip(_round_half_away(x / np.float32(act_scale)), -127, 127) * np.float32(act_scale)
    return x


def fused_moe(x, up_gate, down, topk_ids, topk_weights, method=None, up_gate_scale=None, down_scale=None,
              up_gate_act_scale=None, down_act_scale=None, expert_start=0) -> np.ndarray:
    """Per (token, slot) loop over dequantized experts, activations fake-quantized like the kernel; slots routed
    outside the held experts [expert_start, expert_start + E) add nothing."""
    t, h = x.shape
    inter = up_gate.shape[-1] // 2
    ug = dequant(up_gate, up_gate_scale, method)
    dn = dequant(down, down_scale, method)
    out = np.zeros((t, h), np.float32)
    for i in range(t):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[i, j]) - expert_start
            if not 0 <= e < up_gate.shape[0]:
                continue
            a1 = None if up_gate_act_scale is None else up_gate_act_scale[e]
            hh = fake_quant_act(x[i:i + 1], method, a1) @ ug[e]
            g, u = hh[:, :inter], hh[:, inter:]
            mid = g / (1 + np.exp(-g)) * u
            a2 = None if down_act_scale is None else down_act_scale[e]
            out[i] += topk_weights[i, j] * (fake_quant_act(mid, method, a2) @ dn[e])[0]
    return out


def moe_align_block_size(topk_ids: np.ndarray, num_experts: int, block_m: int):
    """(sorted slot ids with sentinel padding, expert id per block, number of padded slots)."""
    flat = topk_ids.reshape(-1)
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        slots = np.nonzero(flat == e)[0].tolist()
        pad = -len(slots) % block_m
        sorted_ids += slots + [flat.size] * pad
        expert_ids += [e] * ((len(slots) + pad) // block_m)
    return np.array(sorted_ids, np.int32), np.array(expert_ids, np.int32), len(sorted_ids)


def _dequant_cache(c: np.ndarray, s) -> np.ndarray:
    c = c.astype(np.float32)
    if s is None:
        return c
    s = np.asarray(s, np.float32)
    kvh, d = c.shape[2:]
    return c * (s.reshape(1, 1, kvh, d) if s.ndim == 1 else s[:, None, :, None]) / 127.0


def unified_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sm_scale, k_scale=None,
                      v_scale=None):
    """Per sequence: gather its pages, dequantize, causal softmax attention of its new queries in fp32."""
    t, hq, d = q.shape
    kvh = k_cache.shape[2]
    page = k_cache.shape[1]
    kf, vf = _dequant_cache(k_cache, k_scale), _dequant_cache(v_cache, v_scale)
    out = np.zeros((t, hq, d), np.float32)
    for i in range(len(seq_lens)):
        a, b, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        pages = block_tables[i, : -(-n // page)]
        ks = kf[pages].reshape(-1, kvh, d)[:n]
        vs = vf[pages].reshape(-1, kvh, d)[:n]
        for j in range(b - a):
            pos = n - (b - a) + j
            for h in range(hq):
                kv = h // (hq // kvh)
                s = (q[a + j, h].astype(np.float32) @ ks[: pos + 1, kv].T) * sm_scale
                p = np.exp(s - s.max())
                out[a + j, h] = (p / p.sum()) @ vs[: pos + 1, kv]
    return out
