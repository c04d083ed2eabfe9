"""Quantized weight / activation / KV-cache formats (FastDeploy's), in NumPy.

Everything here is host-side and framework free so the same bytes can feed the Paddle CPU layers
(layers.py), the triton kernels (ernie_kernels) and a quantize script. Weights are in Paddle Linear
layout [K=in, N=out]; MoE experts are stacked on a leading axis [E, K, N] and every function below
accepts any number of leading axes. Scales are float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

METHODS = ("wint8", "wint4", "block_wise_fp8", "wint2", "w4a8")
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128
WINT2_GROUP = 64
# CCQ code parameters used by our wint2 encoder. Chosen by a small search that minimises the MSE of the
# 256-entry codebook on Gaussian 4-vectors (about 0.134 sigma^2 per weight, close to an optimal 2-bit
# scalar quantizer's 0.118). Real checkpoints carry their own per-channel code_scale / code_zp.
WINT2_CODE_SCALE = 100.0
WINT2_CODE_ZP = 12288.0
_WINT2_UNIT_SCALE = 0.06  # the codebook's best step for unit-variance weights (same search)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round half away from zero: the runtime rounding (activations, KV) of paddle.round and of the
    kernels, which need no libdevice for it. Offline weight rounding uses np.rint; ties don't matter there."""
    x = np.asarray(x, np.float32)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"weight-only bits must be 4 or 8, got {bits}")
    return 7 if bits == 4 else 127


# ---------------------------------------------------------------- wint8 / wint4 (weight only)

def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int4 values [..., K, N] (int8 in [-8, 7]) into int8 [..., K//2, N].

    Byte [k2, n] holds k = 2*k2 in its low nibble and k = 2*k2+1 in its high nibble, both two's
    complement. K must be even.
    """
    if q.shape[-2] % 2:
        raise ValueError(f"int4 packing needs an even K (in_features), got K={q.shape[-2]}")
    u = q.astype(np.int16) & 0xF
    lo, hi = u[..., 0::2, :], u[..., 1::2, :]
    return (lo | (hi << 4)).astype(np.uint8).view(np.int8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_int4: int8 [..., K//2, N] -> int8 [..., K, N] in [-8, 7]."""
    u = packed.view(np.uint8).astype(np.int16)
    lo = ((u & 0xF) ^ 8) - 8
    hi = (((u >> 4) & 0xF) ^ 8) - 8
    out = np.empty(packed.shape[:-2] + (packed.shape[-2] * 2, packed.shape[-1]), np.int8)
    out[..., 0::2, :] = lo
    out[..., 1::2, :] = hi
    return out


def quantize_weight_only(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel weight-only quantization of w [..., K, N].

    Returns (qweight, scale [..., N] float32) with scale = absmax over K / 127 (bits=8) or / 7 (bits=4);
    qweight is int8 [..., K, N] for bits=8 and pack_int4's int8 [..., K//2, N] for bits=4.
    A channel of zeros gets scale 1 so dequantization never divides by zero.
    """
    qmax = _qmax(bits)
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -qmax, qmax).astype(np.int8)
    return (pack_int4(q) if bits == 4 else q), scale


def dequantize_weight_only(qweight: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """qweight (layout as quantize_weight_only) * scale[..., None, :] -> float32 [..., K, N]."""
    _qmax(bits)
    q = unpack_int4(qweight) if bits == 4 else qweight
    return q.astype(np.float32) * np.asarray(scale, np.float32)[..., None, :]


# ---------------------------------------------------------------- block_wise_fp8

def fp8_e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> e4m3fn bytes (uint8), round to nearest even, saturating at +-448 (no inf in e4m3fn)."""
    x = np.clip(np.asarray(x, np.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp8_e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """e4m3fn bytes (uint8) -> float32."""
    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _block_amax(x: np.ndarray, bk: int, bn: int) -> np.ndarray:
    *lead, k, n = x.shape
    kb, nb = -(-k // bk), -(-n // bn)
    pad = np.zeros((*lead, kb * bk, nb * bn), np.float32)
    pad[..., :k, :n] = np.abs(x)
    return pad.reshape(*lead, kb, bk, nb, bn).max(axis=(-3, -1))


def quantize_block_fp8(w: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K, N] -> (e4m3 codes uint8 [..., K, N], weight_scale_inv f32 [..., ceil(K/128), ceil(N/128)]).

    One scale per 128x128 block, scale_inv = block amax / 448, code = e4m3(w / scale_inv);
    dequantized w = decode(code) * scale_inv[k // 128, n // 128]. (Checkpoints in torch layout [N, K]
    carry the transposed scale [ceil(N/128), ceil(K/128)]; transpose both to use this layout.)
    """
    w = np.asarray(w, np.float32)
    amax = _block_amax(w, block, block)
    scale_inv = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    full = _expand_blocks(scale_inv, w.shape[-2], w.shape[-1], block)
    return fp8_e4m3_encode(w / full), scale_inv


def _expand_blocks(s: np.ndarray, k: int, n: int, block: int) -> np.ndarray:
    return np.repeat(np.repeat(s, block, axis=-2), block, axis=-1)[..., :k, :n]


def dequantize_block_fp8(codes: np.ndarray, scale_inv: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray:
    """Inverse of quantize_block_fp8 -> float32 [..., K, N]."""
    k, n = codes.shape[-2:]
    return fp8_e4m3_decode(codes) * _expand_blocks(np.asarray(scale_inv, np.float32), k, n, block)


def quantize_act_fp8(x: np.ndarray, group: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic per-token, per-128-channel-group activation quantization of x [T, K].

    Returns (e4m3 codes uint8 [T, K], scale f32 [T, ceil(K/128)]) with scale = group amax / 448
    (1 for an all-zero group); x ~= decode(code) * scale[t, k // 128].
    """
    x = np.asarray(x, np.float32)
    t, k = x.shape
    amax = _block_amax(x, 1, group).reshape(t, -1)
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    full = np.repeat(scale, group, axis=-1)[:, :k]
    return fp8_e4m3_encode(x / full), scale


def dequantize_act_fp8(codes: np.ndarray, scale: np.ndarray, group: int = FP8_BLOCK) -> np.ndarray:
    k = codes.shape[-1]
    return fp8_e4m3_decode(codes) * np.repeat(scale, group, axis=-1)[..., :k]


# ---------------------------------------------------------------- wint2 (CCQ)

def wint2_fields(codes: np.ndarray, code_scale: np.ndarray, code_zp: np.ndarray) -> np.ndarray:
    """Decode CCQ bytes into 6-bit weight fields.

    codes uint8 [..., K//4, N]; code_scale / code_zp f32 [..., N]. Each byte b gives an integer code
    v = floor(b * code_scale + code_zp + 0.5) whose overlapping 6-bit fields
    (v>>9)&63, (v>>6)&63, (v>>3)&63, v&63, each minus 32, are the weights at k = 4r+0 .. 4r+3.
    Returns int8 [..., K, N] in [-32, 31].
    """
    b = np.asarray(codes, np.uint8).astype(np.float32)
    v = np.floor(b * code_scale[..., None, :] + code_zp[..., None, :] + 0.5).astype(np.int32)
    kq, n = codes.shape[-2:]
    out = np.empty(codes.shape[:-2] + (kq * 4, n), np.int8)
    for i, shift in enumerate((9, 6, 3, 0)):
        out[..., i::4, :] = ((v >> shift) & 63) - 32
    return out


def wint2_group_scales(local_scale: np.ndarray, super_scales: np.ndarray, k: int) -> np.ndarray:
    """Per-group scales f32 [..., K//64, N] from packed 4-bit local scales and per-channel super scales.

    local_scale uint8 [..., ceil(K/128), N]: byte j holds group 2j in its HIGH nibble and group 2j+1 in
    its LOW nibble (FastDeploy's order); group scale = nibble * super_scales[..., n].
    """
    ls = np.asarray(local_scale, np.uint8)
    groups = k // WINT2_GROUP
    nib = np.empty(ls.shape[:-2] + (ls.shape[-2] * 2, ls.shape[-1]), np.float32)
    nib[..., 0::2, :] = ls >> 4
    nib[..., 1::2, :] = ls & 0xF
    return nib[..., :groups, :] * np.asarray(super_scales, np.float32)[..., None, :]


def dequantize_wint2(codes: np.ndarray, local_scale: np.ndarray, code_scale: np.ndarray,
                     code_zp: np.ndarray, super_scales: np.ndarray) -> np.ndarray:
    """w[k, n] = field[k, n] * local4[k // 64, n] * super_scales[n] -> float32 [..., K, N]."""
    fields = wint2_fields(codes, code_scale, code_zp).astype(np.float32)
    k = fields.shape[-2]
    gs = wint2_group_scales(local_scale, super_scales, k)
    return fields * np.repeat(gs, WINT2_GROUP, axis=-2)


def _wint2_codebook(code_scale: float, code_zp: float) -> np.ndarray:
    ones = np.ones((256,), np.float32)
    b = np.arange(256, dtype=np.uint8)[None, :]  # one packed row, the 256 byte values as channels
    f = wint2_fields(b, ones * code_scale, ones * code_zp)  # [4, 256]
    return f.T.astype(np.float32)  # [256 codes, 4 weights]


def quantize_wint2(w: np.ndarray, code_scale: float = WINT2_CODE_SCALE,
                   code_zp: float = WINT2_CODE_ZP) -> dict[str, np.ndarray]:
    """A simple CCQ encoder for w [..., K, N] (K a multiple of 64) that round-trips dequantize_wint2.

    Not FastDeploy's encoder: one fixed (code_scale, code_zp) for every channel, group step chosen from
    the group RMS, then each run of 4 weights along K takes the nearest of the 256 codewords (exhaustive
    vector quantization). Expect a relative RMS error of about 0.4 on Gaussian weights: 2 bits per weight.
    Returns checkpoint-named tensors: quant_weight uint8 [..., K//4, N], weight_scale uint8
    [..., ceil(K/128), N] (packed local scales), super_scales / code_scale / code_zp f32 [..., N].
    """
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    if k % WINT2_GROUP:
        raise ValueError(f"wint2 needs K (in_features) to be a multiple of {WINT2_GROUP}, got K={k}")
    groups = k // WINT2_GROUP
    wg = w.reshape(*lead, groups, WINT2_GROUP, n)
    step = _WINT2_UNIT_SCALE * np.sqrt((wg ** 2).mean(axis=-2))  # [..., G, N]
    super_scales = np.maximum(step.max(axis=-2) / 15.0, 1e-30).astype(np.float32)
    local = np.clip(np.rint(step / super_scales[..., None, :]), 1, 15).astype(np.uint8)
    scale = local.astype(np.float32) * super_scales[..., None, :]  # [..., G, N]

    book = _wint2_codebook(code_scale, code_zp)  # [256, 4]
    # [..., G, 16 runs, 4, N] -> runs as rows of 4 values in units of the group step
    runs = (wg / scale[..., None, :]).reshape(*lead, groups, WINT2_GROUP // 4, 4, n)
    runs = np.moveaxis(runs, -2, -1).reshape(-1, 4)
    best = np.empty(runs.shape[0], np.uint8)
    b2 = (book ** 2).sum(1)
    for s in range(0, runs.shape[0], 8192):
        r = runs[s:s + 8192]
        best[s:s + 8192] = np.argmin(b2[None, :] - 2.0 * r @ book.T, axis=1)
    codes = best.reshape(*lead, groups, WINT2_GROUP // 4, n).reshape(*lead, k // 4, n)

    if groups % 2:  # an odd group count leaves the last byte's low nibble unused
        local = np.concatenate([local, np.zeros_like(local[..., :1, :])], axis=-2)
    packed = (local[..., 0::2, :] << 4) | local[..., 1::2, :]
    ones = np.ones((*lead, n), np.float32)
    return {"quant_weight": codes, "weight_scale": packed.astype(np.uint8), "super_scales": super_scales,
            "code_scale": ones * code_scale, "code_zp": ones * code_zp}


# ---------------------------------------------------------------- W4A8

def quantize_act_int8_static(x: np.ndarray, activation_scale: float | np.ndarray) -> np.ndarray:
    """x -> int8 clip(round_half_away(x / activation_scale), -127, 127); scale = calibrated absmax / 127."""
    a = np.asarray(activation_scale, np.float32)
    return np.clip(round_half_away(np.asarray(x, np.float32) / a), -127, 127).astype(np.int8)


def calibrate_activation_scale(x: np.ndarray) -> np.float32:
    """Static per-tensor activation scale from calibration activations: absmax / 127 (1 if all zero)."""
    amax = float(np.abs(np.asarray(x, np.float32)).max(initial=0.0))
    return np.float32(amax / 127.0 if amax > 0 else 1.0)


def quantize_w4a8(w: np.ndarray, activation_scale: float | np.ndarray) -> dict[str, np.ndarray]:
    """W4A8 = wint4 weights (quantize_weight_only(w, 4)) + a static activation scale per matrix/expert.

    y = (int8(x) @ int4(w)) * activation_scale * weight_scale[n], the matmul exact in int32.
    activation_scale: scalar, or [E] for stacked experts.
    """
    q, s = quantize_weight_only(w, 4)
    a = np.asarray(activation_scale, np.float32).reshape(np.shape(w)[:-2])
    return {"quant_weight": q, "weight_scale": s, "activation_scale": a}


# ---------------------------------------------------------------- C8 KV cache

def quantize_kv_static(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x [..., kv_heads, head_dim] -> int8 clip(round_half_away(x * 127 / s), -127, 127).

    scale f32 [kv_heads * head_dim] is the channel-wise static scale (a calibrated absmax per channel,
    FastDeploy's cachek/cachev_matmul.activation_scale).
    """
    s = np.asarray(scale, np.float32).reshape(x.shape[-2:])
    return np.clip(round_half_away(np.asarray(x, np.float32) * 127.0 / s), -127, 127).astype(np.int8)


def dequantize_kv_static(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 [..., kv_heads, head_dim] -> q * s / 127 (float32)."""
    s = np.asarray(scale, np.float32).reshape(q.shape[-2:])
    return q.astype(np.float32) * s / 127.0


def calibrate_kv_scale(x: np.ndarray) -> np.ndarray:
    """Channel-wise absmax of calibration K or V [..., kv_heads, head_dim] -> f32 [kv_heads*head_dim]."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x.reshape(-1, x.shape[-2] * x.shape[-1])).max(axis=0)
    return np.where(amax > 0, amax, 1.0).astype(np.float32)


def quantize_kv_dynamic(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-(cache block, kv head) scales when a checkpoint has no static ones.

    x f32 [num_blocks, block_size, kv_heads, head_dim] -> (int8 same shape, scale f32 [num_blocks,
    kv_heads]) with scale = absmax over (block_size, head_dim), q = round(x * 127 / scale). A block is
    quantized once it is full (or rescaled whole when it is appended to).
    """
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=(1, 3))
    scale = np.where(amax > 0, amax, 1.0).astype(np.float32)
    q = np.clip(round_half_away(x * 127.0 / scale[:, None, :, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_kv_dynamic(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.asarray(scale, np.float32)[:, None, :, None] / 127.0


# ---------------------------------------------------------------- checkpoint tensors

def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {', '.join(METHODS)}")
    return method


# Checkpoint tensors (suffixes after `<layer>.`) each method needs; block_wise_fp8's scale may also be
# named weight_scale in a checkpoint and is renamed weight_scale_inv on load.
REQUIRED_TENSORS = {"wint8": ("quant_weight", "weight_scale"), "wint4": ("quant_weight", "weight_scale"),
                    "block_wise_fp8": ("quant_weight", "weight_scale_inv"),
                    "wint2": ("quant_weight", "weight_scale", "super_scales", "code_scale", "code_zp"),
                    "w4a8": ("quant_weight", "weight_scale", "activation_scale")}
QUANT_TENSOR_SUFFIXES = ("quant_weight", "weight_scale", "weight_scale_inv", "super_scales", "code_scale",
                         "code_zp", "activation_scale")


def quantize_float(w_KN: np.ndarray, method: str, *, activation_scale: float | None = None,
                   calib_x: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Quantize an fp32 weight [K, N] into checkpoint-named tensors (see REQUIRED_TENSORS)."""
    method = check_method(method)
    w = np.asarray(w_KN, np.float32)
    if method in ("wint8", "wint4"):
        q, s = quantize_weight_only(w, 8 if method == "wint8" else 4)
        return {"quant_weight": q, "weight_scale": s}
    if method == "block_wise_fp8":
        q, s = quantize_block_fp8(w)
        return {"quant_weight": q, "weight_scale_inv": s}
    if method == "wint2":
        return quantize_wint2(w)
    if activation_scale is None:
        if calib_x is None:
            raise ValueError("w4a8 needs a static activation scale: pass activation_scale= or calib_x= "
                             "(or write a calibrated checkpoint with scripts/quantize_checkpoint.py)")
        activation_scale = calibrate_activation_scale(calib_x)
    return quantize_w4a8(w, activation_scale)


ROWS_PER_CODE_ROW = {"wint8": 1, "wint4": 2, "w4a8": 2, "wint2": 4}


def quantized_shape(method: str, quant_weight_shape: tuple, *, transposed: bool = False) -> tuple[int, int]:
    """The [K, N] weight a quant_weight of this shape holds (transposed: a torch-layout fp8 [N, K])."""
    if method == "block_wise_fp8":
        k, n = quant_weight_shape[::-1] if transposed else quant_weight_shape
        return int(k), int(n)
    return int(quant_weight_shape[0]) * ROWS_PER_CODE_ROW[method], int(quant_weight_shape[1])


def normalize_quantized(method: str, tensors: dict[str, np.ndarray], in_features: int, out_features: int, *,
                        transposed: bool = False) -> dict[str, np.ndarray]:
    """A quantized weight's checkpoint tensors in the layouts every consumer reads: quant_weight [K.., N]
    (fp8 codes as ml_dtypes float8_e4m3fn), block_wise_fp8's scale named weight_scale_inv, scales float32
    except wint2's packed uint8 local scales, w4a8's activation_scale as one value [1]. Checks that every
    tensor the method needs is there and that quant_weight is a [in_features, out_features] weight.
    transposed=True takes a block_wise_fp8 weight in torch layout [N, K] with scale [N/128, K/128]."""
    method = check_method(method)
    t = {k: np.asarray(v) for k, v in tensors.items()}
    if method == "block_wise_fp8" and "weight_scale_inv" not in t and "weight_scale" in t:
        t["weight_scale_inv"] = t.pop("weight_scale")
    missing = [m for m in REQUIRED_TENSORS[method] if m not in t]
    if missing:
        raise ValueError(f"{method} checkpoint tensors missing {missing}; got {sorted(tensors)}")
    qw = t.pop("quant_weight")
    if method == "block_wise_fp8":
        s = t.pop("weight_scale_inv")
        if transposed:
            qw, s = qw.T, s.T
        out = {"quant_weight": np.ascontiguousarray(qw).view(np.uint8).view(ml_dtypes.float8_e4m3fn),
               "weight_scale_inv": np.ascontiguousarray(s, np.float32)}
        shape = qw.shape
    else:
        shape = (qw.shape[0] * ROWS_PER_CODE_ROW[method], qw.shape[1])
        out = {"quant_weight": np.ascontiguousarray(qw)}
        for name, arr in t.items():
            out[name] = arr if arr.dtype == np.uint8 else arr.astype(np.float32)
    if tuple(shape) != (in_features, out_features):
        raise ValueError(f"{method} quant_weight of {list(qw.shape)} is a [{shape[0]}, {shape[1]}] weight, "
                         f"expected [{in_features}, {out_features}] (Paddle [in, out] layout)")
    if method == "w4a8":
        a = out["activation_scale"].reshape(-1)
        if a.size != 1:
            raise ValueError(f"w4a8 activation_scale must be one value per matrix, got shape {list(a.shape)}")
        out["activation_scale"] = a
    return out


# ---------------------------------------------------------------- tensor-parallel slices

def _whole_groups(keep: np.ndarray, g: int) -> np.ndarray | None:
    """The full-tensor group ids when `keep` is whole, aligned groups of g indices in order; else None."""
    if keep.size % g:
        return None
    runs = keep.reshape(-1, g)
    first = runs[:, 0]
    ok = (first % g == 0).all() and (runs == first[:, None] + np.arange(g)).all()
    return first // g if ok else None


def _covering_blocks(keep: np.ndarray, g: int) -> np.ndarray | None:
    """Block scales of g indices: for each local block of g kept indices, the one full block all of them
    fall in (the local tensor's block j then reads that block's scale); None when one straddles two."""
    full = keep // g
    starts = full[::g]
    return starts if (full == np.repeat(starts, g)[: keep.size]).all() else None


def shard_quantized(method: str, t: dict[str, np.ndarray], axis: int, keep: np.ndarray,
                    what: str = "weight") -> dict[str, np.ndarray]:
    """A tensor-parallel rank's part of a quantized weight (normalize_quantized's layouts, [K.., N]):
    rows (axis 0, K: a row-parallel linear) or columns (axis 1, N: a column-parallel one) `keep` of the
    full weight, with their scales. The result is bit for bit what the rank would hold had the full
    weight been quantized and then split, so every rank count serves the same quantized model.
    Formats that pack rows or share a scale across a block need the split to respect that grouping;
    a split that does not is refused, naming it."""
    method = check_method(method)
    keep = np.asarray(keep, np.int64)

    def refuse(unit: str, g: int) -> ValueError:
        return ValueError(f"{what}: this tensor-parallel rank's {'rows' if axis == 0 else 'columns'} "
                          f"[{keep[0]}..{keep[-1]}] ({keep.size} of them) do not fall on {method}'s {g}-{unit} "
                          f"groups, so its quantized tensors cannot be split there; choose a "
                          f"tensor_parallel_size whose split sizes are multiples of {g}")

    out = dict(t)
    if axis == 1:  # every method keeps per-column data in its last axis
        for name, arr in t.items():
            if name == "activation_scale":
                continue
            if name == "weight_scale_inv":
                blocks = _covering_blocks(keep, FP8_BLOCK)
                if blocks is None:
                    raise refuse("column", FP8_BLOCK)
                out[name] = np.ascontiguousarray(arr[:, blocks])
            else:
                out[name] = np.ascontiguousarray(arr[..., keep])
        return out
    if axis != 0:
        raise ValueError(f"shard_quantized: axis must be 0 (rows) or 1 (columns), got {axis}")
    qw = t["quant_weight"]
    if method == "wint8":
        out["quant_weight"] = np.ascontiguousarray(qw[keep])
    elif method in ("wint4", "w4a8"):
        pairs = _whole_groups(keep, 2)
        if pairs is None:
            raise refuse("row packed", 2)
        out["quant_weight"] = np.ascontiguousarray(qw[pairs])
    elif method == "block_wise_fp8":
        blocks = _covering_blocks(keep, FP8_BLOCK)
        if blocks is None:
            raise refuse("row", FP8_BLOCK)
        out["quant_weight"] = np.ascontiguousarray(qw[keep])
        out["weight_scale_inv"] = np.ascontiguousarray(t["weight_scale_inv"][blocks])
    else:  # wint2: 4 rows per code row, one packed 4-bit scale per 64-row group
        groups = _whole_groups(keep, WINT2_GROUP)
        if groups is None:
            raise refuse("row", WINT2_GROUP)
        quads = _whole_groups(keep, 4)
        out["quant_weight"] = np.ascontiguousarray(qw[quads])
        ls = t["weight_scale"]
        nib = np.empty((ls.shape[0] * 2, ls.shape[1]), np.uint8)
        nib[0::2], nib[1::2] = ls >> 4, ls & 0xF
        local = nib[groups]
        if local.shape[0] % 2:
            local = np.concatenate([local, np.zeros_like(local[:1])])
        out["weight_scale"] = ((local[0::2] << 4) | local[1::2]).astype(np.uint8)
    return out
