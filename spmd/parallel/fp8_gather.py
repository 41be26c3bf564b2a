"""ZeRO-3's per-layer all-gather of a block's weight in e4m3 (--fp8-all-gather).

Each device quantizes its shard with its own per-tensor scale (amax / 448), the e4m3 shards
and the scales (one fp32 per device) are all-gathered, and each gathered block is multiplied
back by its own device's scale, in the param's dtype: half the bytes of a bf16 gather plus
4 bytes per device. The backward pass is the transpose of a plain gather: a reduce-scatter of
the gradient in its own dtype (fp8 gradients would lose too much: they are summed over the
data-parallel devices). torchtitan's float8 all-gather (FSDP2's pre/post all-gather hooks)
does the same with one scale for the whole tensor, which costs an all-reduce of the amax first.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = float(jnp.finfo(E4M3).max)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather(value: jax.Array, dim: int, axes: tuple[str, ...]) -> jax.Array:
    """`value` (this device's shard) all_gathered (tiled) along `dim` over the mesh `axes`
    through e4m3, returned in its own dtype."""
    scale = jnp.maximum(jnp.max(jnp.abs(value.astype(jnp.float32))), 1e-12) / E4M3_MAX
    quantized = jnp.clip(value.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    whole = lax.all_gather(quantized, axes, axis=dim, tiled=True)
    scales = lax.all_gather(scale[None], axes, axis=0, tiled=True)  # [devices]
    n = scales.shape[0]
    shape = whole.shape
    blocks = whole.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])
    per_block = scales.reshape((1,) * dim + (n, 1) + (1,) * (len(shape) - dim - 1))
    return (blocks.astype(jnp.float32) * per_block).reshape(shape).astype(value.dtype)


def _gather_fwd(value: jax.Array, dim: int, axes: tuple[str, ...]) -> tuple[jax.Array, None]:
    return gather(value, dim, axes), None


def _gather_bwd(dim: int, axes: tuple[str, ...], _: None, g: jax.Array) -> tuple[jax.Array]:
    return (lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True),)


gather.defvjp(_gather_fwd, _gather_bwd)
