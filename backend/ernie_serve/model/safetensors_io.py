"""Minimal safetensors reader/writer.

Loading reads with SafetensorsReader: plain positioned reads (no memory map, so what a rank holds is only what it
asked for), of a whole tensor or of the rows / columns one axis keeps (a tensor-parallel rank's slice), in the
stored dtype (bf16 as ml_dtypes.bfloat16). A slice along the first axis reads only its bytes; along a later axis
whole rows pass through a bounded scratch buffer (SCRATCH_BYTES) and only the kept columns stay.
iter_tensors (NumPy memory maps, bf16 widened to fp32) serves the callers that want every tensor whole.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
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


_STORED = {**_DTYPES, "BF16": ml_dtypes.bfloat16}  # fp8 stays its uint8 bytes, as iter_tensors gives it
SCRATCH_BYTES = 32 << 20  # whole rows read at once for a slice along a later axis


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lies in its file and what it holds."""

    code: str  # the safetensors dtype ("BF16", "F32", ...)
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    nbytes: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(_STORED[self.code])


class SafetensorsReader:
    """One safetensors file, read a tensor (or a slice of one) at a time into fresh arrays of its stored dtype."""

    def __init__(self, path: Path):
        self.path = Path(path)
        header, start = read_header(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in header.items():
            if info["dtype"] not in _STORED:
                raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
            a, b = info["data_offsets"]
            self.tensors[name] = TensorInfo(info["dtype"], tuple(info["shape"]), start + a, b - a)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read(self, name: str, axis: int | None = None, keep: np.ndarray | None = None,
             widen: bool = False, transpose: bool = False) -> np.ndarray:
        """Tensor `name`, or only indices `keep` (in that order) along `axis`, in its stored dtype; with widen,
        bf16 / f16 / f64 as float32 (as iter_tensors gives them); with transpose, a 2-D tensor transposed (a new
        C-contiguous array: a torch-layout weight in Paddle's [in, out])."""
        info = self.tensors[name]
        if axis is None:
            out = np.empty(info.shape, info.dtype)
            self._pread(out, info.offset)
        else:
            out = self._read_along(info, axis, np.asarray(keep, np.int64))
        if transpose:
            out = transposed(out)
        if widen and info.code in ("BF16", "F16", "F64"):
            out = out.astype(np.float32)
        return out

    def _read_along(self, info: TensorInfo, axis: int, keep: np.ndarray) -> np.ndarray:
        shape = info.shape
        outer, length, inner = int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1:]))
        if keep.size and (keep.min() < 0 or keep.max() >= length):
            raise IndexError(f"{self.path.name}: indices {keep.min()}..{keep.max()} outside axis {axis} of {shape}")
        out = np.empty((outer, keep.size, inner), info.dtype)
        row_bytes = length * inner * info.dtype.itemsize  # one step of the outer axes
        runs = _runs(keep)
        if outer == 1:  # the first axis (or only size-1 axes before it): each run is one contiguous read
            for pos, (a, b) in runs:
                self._pread(out[0, pos:pos + b - a], info.offset + a * inner * info.dtype.itemsize)
        else:
            chunk = max(1, SCRATCH_BYTES // row_bytes)
            scratch = np.empty((min(chunk, outer), length, inner), info.dtype)
            for first in range(0, outer, chunk):
                rows = scratch[:min(chunk, outer - first)]
                self._pread(rows, info.offset + first * row_bytes)
                for pos, (a, b) in runs:
                    out[first:first + len(rows), pos:pos + b - a] = rows[:, a:b]
        return out.reshape(shape[:axis] + (keep.size,) + shape[axis + 1:])

    def _pread(self, out: np.ndarray, offset: int) -> None:
        """Fill the contiguous array `out` with the file's bytes from `offset`."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path.name}: file ends at byte {offset + done}; the header says more data")
            done += n


def transposed(a: np.ndarray, block: int = 256) -> np.ndarray:
    """a.T as a new C-contiguous array, copied in tiles that stay in cache: a whole-matrix strided copy walks one
    side a column at a time, and was the largest cost of loading a torch-layout vocabulary (scripts/bench_loading.py)."""
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)
    for i in range(0, rows, block):
        for j in range(0, cols, 4 * block):
            out[j:j + 4 * block, i:i + block] = a[i:i + block, j:j + 4 * block].T
    return out


def _runs(keep: np.ndarray) -> list[tuple[int, tuple[int, int]]]:
    """keep as runs of consecutive indices: (position in keep, (first index, last index + 1))."""
    breaks = np.flatnonzero(np.diff(keep) != 1) + 1
    starts = np.concatenate([[0], breaks]).astype(int)
    ends = np.concatenate([breaks, [keep.size]]).astype(int)
    return [(int(s), (int(keep[s]), int(keep[e - 1]) + 1)) for s, e in zip(starts, ends) if e > s]
