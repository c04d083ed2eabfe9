"""Minimal safetensors reader/writer on numpy memory maps.

numpy has no bfloat16, and ERNIE checkpoints are bf16 on disk; reading the format directly lets us
widen bf16 to fp32 one tensor at a time straight from the mapped file, so loading streams shard
by shard without ever holding a second copy of a shard.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": np.uint8,
}
_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8",
          np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
          np.dtype(np.int16): "I16", np.dtype(np.float64): "F64",
          np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3"}  # read back as its uint8 bytes


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def iter_tensors(path: Path, widen: bool = True) -> Iterator[tuple[str, np.ndarray, str]]:
    """Yield (name, array, dtype code). With widen, bf16/f16 become float32 copies; else views."""
    header, offset = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        code = info["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {code}")
        start, end = info["data_offsets"]
        raw = mm[offset + start : offset + end].view(_DTYPES[code]).reshape(info["shape"])
        if widen and code == "BF16":
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        elif widen and code in ("F16", "F64"):
            arr = raw.astype(np.float32)
        else:
            arr = raw
        yield name, arr, code


def save_file(tensors: dict[str, np.ndarray], path: Path, bf16: set[str] | frozenset = frozenset()) -> None:
    """Write tensors; names in `bf16` are rounded to bfloat16 (round-to-nearest-even)."""
    header, blobs, pos = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if name in bf16:
            u = arr.astype(np.float32).view(np.uint32)
            arr = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            code = "BF16"
        else:
            code = _CODES[arr.dtype]
        data = arr.tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
