"""Read and write the safetensors file format with numpy alone, one tensor at a time.

A safetensors file is an 8-byte little-endian header length N, a UTF-8 JSON header of N bytes
(`{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`), then the tensors' bytes, C-ordered little-endian, at those
offsets from the end of the header. Reading memory-maps one tensor (pages come from the file on
demand, so nothing else of the file is in memory); writing puts the header first (every shape
is known up front) and then each tensor as it is produced, so a writer holds one tensor at a
time too. bfloat16, the dtype most Llama checkpoints ship in, is numpy's `ml_dtypes.bfloat16`
(ml_dtypes comes with jax).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from spmd.errors import UsageError

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
HEADER_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned
MAX_HEADER_BYTES = 100 << 20  # a larger header means the file is not safetensors


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, dtype, shape and byte offset from the file start."""

    path: Path
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    def read(self) -> np.ndarray:
        """The tensor, memory-mapped read-only (its bytes are read when touched)."""
        if math.prod(self.shape) == 0:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, mode="r", offset=self.offset, shape=self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """({name: TensorInfo}, metadata) of one safetensors file; UsageError if it is not one."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise ValueError(f"header length {length} exceeds the file's {size} bytes")
            header = json.loads(f.read(length).decode("utf-8"))
        metadata = header.pop("__metadata__", None) or {}
        tensors = {}
        data_start = 8 + length
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            dtype = DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name} has dtype {entry['dtype']}, not one of {DTYPES}")
            shape = tuple(int(d) for d in entry["shape"])
            if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
                raise ValueError(f"tensor {name}'s offsets {begin}..{end} do not fit {shape}")
            tensors[name] = TensorInfo(path, name, dtype, shape, data_start + begin)
        return tensors, metadata
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise UsageError(f"{path} is not a readable safetensors file ({e})") from None


def write(
    path: Path,
    entries: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    produce: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a safetensors file of `entries` (name, shape, dtype), in order, calling
    `produce(name)` for each tensor's values only when it is written. The file appears under
    its name only once complete. Returns the bytes of tensor data written."""
    entries = list(entries)
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        code = CODES[np.dtype(dtype)]
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGN)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    with partial.open("wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype in entries:
            values = np.ascontiguousarray(produce(name))
            if values.shape != tuple(shape) or values.dtype != np.dtype(dtype):
                raise ValueError(
                    f"{name}: produced {values.shape} {values.dtype}, declared {shape} {dtype}"
                )
            f.write(values.reshape(-1).view(np.uint8).data)  # no copy; x86/ARM are little-endian
    os.replace(partial, path)
    return offset
