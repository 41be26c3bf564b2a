"""--lora-base-dtype int8: a frozen LoRA base's block matrices stored as int8 with one absmax
scale per block of 64 values, the blocks along the same `embed` dim as NF4's (models/nf4.py,
whose machinery stores, shards, gathers and dequantizes both; this module is int8's numbers).

A block of 64 consecutive values gets step = absmax / 127 (fp32); a value becomes
round(x / step) clipped to [-127, 127] (symmetric: -128 is never written), and is q * step
again: at most step / 2 from x, and exactly x where x is a multiple of the step. The scale
is kept as its fp32 step (as the bits of an fp32, uint32, like NF4's absmax: the engine casts
floating params to the working dtype). 1 B per value plus 4 B per 64 values: 1.0625 B/param,
0.53x bf16's 2 B, about twice NF4's 0.5625 and about 1/8 of its error.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BLOCK = 64  # values per scale: NF4's (models/nf4.py), so that both share the block rule
LEVELS = 127  # the largest code: symmetric int8
TINY = 1e-12  # absmax floor: an all-zero block dequantizes to zeros, not NaN


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes, steps) of x [..., n] (n a multiple of BLOCK) along the last dim: codes [..., n]
    int8, steps [..., n / BLOCK] fp32 (each block's absmax / 127)."""
    *lead, n = x.shape
    if n % BLOCK:
        raise ValueError(f"int8 blocks of {BLOCK}: a last dim of {n} does not split into them")
    blocks = x.astype(jnp.float32).reshape(*lead, n // BLOCK, BLOCK)
    absmax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), TINY)
    step = absmax / LEVELS
    codes = jnp.clip(jnp.round(blocks / step), -LEVELS, LEVELS).astype(jnp.int8)
    return codes.reshape(*lead, n), step[..., 0]


def dequantize_blocks(codes: jax.Array, step: jax.Array, dtype: Any) -> jax.Array:
    """`quantize_blocks`' inverse, code * step: x [..., codes' last dim] in `dtype`."""
    *lead, n = codes.shape
    blocks = codes.astype(jnp.float32).reshape(*lead, n // BLOCK, BLOCK)
    return (blocks * step.astype(jnp.float32)[..., None]).reshape(*lead, n).astype(dtype)
