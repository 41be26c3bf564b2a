"""fp8 matmuls: inputs and weights quantized to e4m3 in the forward pass, the output gradient
to e4m3 (rowwise scaling) or e5m2 (per-tensor scaling) in the backward pass, each dot an
`lax.dot_general` of fp8 operands with a 32-bit `preferred_element_type` (what XLA:GPU turns
into cuBLASLt fp8 GEMMs on Hopper; XLA:CPU converts the operands and emulates), its result
multiplied by the two operands' scales.

Scaling (`Site.recipe`, spmd.parallel.fp8_context):

- tensorwise: one scale per tensor, amax(|t|) / max(fp8), computed from the tensor itself (current
  scaling, torchtitan's default);
- rowwise: one scale per row of the left operand and per column of the right one (the dims
  that are not contracted), so one outlier token or channel costs only its own row;
- delayed: per-tensor scales from an amax history of earlier steps (Transformer Engine's and
  Flax's recipe); the amaxes this step saw come back as the cotangent of `site.probe`.

The gradient's format is `Site.grad_format` (fp8_context.GRAD_FORMAT says why per recipe):
e4m3's extra mantissa bit where per-row scales bound the range, e5m2's range where one scale
covers a whole gradient tensor.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.parallel.hooks import Fp8Site, fp8_vary_like

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}  # Site.grad_format's names
TINY = 1e-12  # amax floor: an all-zero tensor gets scale TINY / max instead of a 0 division


def fp8_max(dtype: Any) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, axis: int | None = None) -> jax.Array:
    """max |x| in fp32, over every element (axis None) or over `axis` kept as a size-1 dim."""
    a = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=axis is not None)
    return jnp.maximum(a, TINY)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """x / scale, clipped to the fp8 range, as `dtype` (scale broadcasts against x)."""
    limit = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def _scaled_dot(
    a: jax.Array,
    b: jax.Array,
    a_dtype: Any,
    b_dtype: Any,
    recipe: str,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """a [..., m, k] @ b [..., k, n] (shared leading batch dims) with both quantized: per row
    of a and per column of b (rowwise), per tensor from themselves (tensorwise) or by the
    given per-tensor `scales` (delayed). fp32 result."""
    if scales is not None:  # an empty history (0) scales by the current amax
        sa = jnp.where(scales[0] > 0, scales[0], amax(a) / fp8_max(a_dtype))
        sb = jnp.where(scales[1] > 0, scales[1], amax(b) / fp8_max(b_dtype))
    elif recipe == "rowwise":
        sa, sb = amax(a, -1) / fp8_max(a_dtype), amax(b, -2) / fp8_max(b_dtype)
    else:
        sa, sb = amax(a) / fp8_max(a_dtype), amax(b) / fp8_max(b_dtype)
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim - 2,)), (batch, batch))
    out = lax.dot_general(
        quantize(a, sa, a_dtype), quantize(b, sb, b_dtype), dims, preferred_element_type=jnp.float32
    )
    return out * sa * sb


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def matmul(x: jax.Array, w: jax.Array, site: Fp8Site) -> jax.Array:
    """x [..., m, k] @ w [..., k, n] in fp8 by `site`'s recipe, in x's dtype. Differentiable:
    the gradients of x and w are fp8 dots too (the gradient in `site.grad_format` against the
    e4m3 operands)."""
    if site.recipe != "delayed":
        probe = scales = jnp.zeros((3,), jnp.float32)
    else:
        scales, probe = site.scales, site.probe
    return _matmul(site.recipe, site.grad_format, x, w, scales, probe)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _matmul(
    recipe: str, grad: str, x: jax.Array, w: jax.Array, scales: jax.Array, probe: jax.Array
) -> jax.Array:
    delayed = (scales[0], scales[1]) if recipe == "delayed" else None
    return _scaled_dot(x, w, E4M3, E4M3, recipe, delayed).astype(x.dtype)


def _matmul_fwd(
    recipe: str, grad: str, x: jax.Array, w: jax.Array, scales: jax.Array, probe: jax.Array
) -> tuple[jax.Array, tuple]:
    return _matmul(recipe, grad, x, w, scales, probe), (x, w, scales, probe)


def _matmul_bwd(recipe: str, grad: str, residuals: tuple, g: jax.Array) -> tuple:
    x, w, scales, probe = residuals
    g_dtype = FORMATS[grad]
    if recipe == "delayed":
        gx = _scaled_dot(g, _t(w), g_dtype, E4M3, recipe, (scales[2], scales[1]))
        gw = _scaled_dot(_t(x), g, E4M3, g_dtype, recipe, (scales[0], scales[2]))
        seen = jnp.stack([amax(x), amax(w), amax(g)])
        seen = fp8_vary_like(seen, probe)  # the probe's devices (explicit executor)
    else:
        gx = _scaled_dot(g, _t(w), g_dtype, E4M3, recipe)
        gw = _scaled_dot(_t(x), g, E4M3, g_dtype, recipe)
        seen = jnp.zeros_like(probe)
    return gx.astype(x.dtype), gw.astype(w.dtype), jnp.zeros_like(scales), seen


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
