"""MXFP4 expert weights as GPT-OSS releases store them (`*_blocks` and `*_scales` tensors),
dequantized to floats on import, by the rule transformers applies
(transformers.integrations.mxfp4.convert_moe_packed_tensors).

The format (OCP microscaling, MX): values in blocks of 32 along a matrix's input dim, each
value a 4-bit e2m1 float (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6
and their negatives), each block sharing one 8-bit e8m0 scale (a power of two, 2^(s - 127)).

    blocks  uint8 [..., out, G, 16]   two values per byte: the low nibble first, then the high
    scales  uint8 [..., out, G]       one per block of 32 values
    ->      [..., in, out]            in = G x 32, transposed as transformers' experts hold
                                      their weights (gate_up_proj [E, hidden, 2 x mlp])

Every e2m1 value times a power of two is exact in fp32 (and in bf16) while the exponent stays
in range, so the result does not depend on the dtype it is computed in.

On import (models/hf_io.py) a checkpoint's pair `<name>_blocks`, `<name>_scales` reads as one
fp32 tensor `<name>`, the layout of an unquantized checkpoint, so a family's tensor table
names only that (`unpacked`); the export writes the dequantized values.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spmd.errors import UsageError
from spmd.io.safetensors_io import TensorInfo

# e2m1's 16 codes, sign bit highest: what each nibble stands for
E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127  # e8m0: the scale is 2^(code - 127)


def dequantize(blocks: np.ndarray, scales: np.ndarray, name: str = "tensor") -> np.ndarray:
    """fp32 [..., in, out] of MXFP4 `blocks` uint8 [..., out, G, 16] and `scales` uint8
    [..., out, G] (module docstring); UsageError naming `name` for arrays that are not that
    format."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise UsageError(
            f"{name}: MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.ndim < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise UsageError(
            f"{name}: MXFP4 blocks {blocks.shape} and scales {scales.shape} must be "
            f"[..., out, G, {BLOCK // 2}] and [..., out, G]"
        )
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]  # the low nibble is the earlier value
    values[..., 1::2] = E2M1[blocks >> 4]
    exponent = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponent[..., None])
    *lead, out, groups, _ = values.shape
    return np.swapaxes(values.reshape(*lead, out, groups * BLOCK), -1, -2)


@dataclasses.dataclass(frozen=True)
class Packed(TensorInfo):
    """An MXFP4 pair read as the fp32 tensor it dequantizes to (`name`, `shape` [..., in,
    out]): TensorInfo's fields describe the result, `blocks` and `scales` where it lives."""

    blocks: TensorInfo | None = None
    scales: TensorInfo | None = None

    def read(self) -> np.ndarray:
        assert self.blocks is not None and self.scales is not None
        return dequantize(self.blocks.read(), self.scales.read(), self.name)


def unpacked(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` (a checkpoint's, by name) with each pair `<name>_blocks` [..., out, G, 16]
    uint8 and `<name>_scales` [..., out, G] uint8 replaced by one `Packed` tensor `<name>`
    [..., G x 32, out] fp32; the rest as they are."""
    out = dict(tensors)
    for name, blocks in tensors.items():
        base = name.removesuffix("_blocks")
        scales = tensors.get(base + "_scales")
        if base == name or scales is None or not _pair(blocks, scales):
            continue  # (a pair of another format stays as it is: the table names it)
        *lead, rows, groups, _ = blocks.shape
        shape = (*lead, groups * BLOCK, rows)
        out[base] = Packed(blocks.path, base, np.dtype(np.float32), shape, 0, blocks, scales)
        del out[name], out[base + "_scales"]
    return out


def _pair(blocks: TensorInfo, scales: TensorInfo) -> bool:
    """Whether two tensors have MXFP4's dtypes and shapes (`dequantize`'s)."""
    shapes = len(blocks.shape) >= 3 and blocks.shape[-1] == BLOCK // 2
    shapes = shapes and blocks.shape[:-1] == scales.shape
    return shapes and blocks.dtype == np.uint8 and scales.dtype == np.uint8
