"""The smallest pieces of the decoders: a param with its logical axis names, RMSNorm (and
Gemma's (1 + scale) form, and HeadsRMSNorm over all heads' features at once), the dense
projection every matmul with a weight goes through, the SwiGLU and GeGLU activations, and
`creator`: a family's `create` from its model class.

Params are created in fp32 (the master copy); callers cast them to the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from models import adapter, fp8, nf4
from models.matmul import matmul
from spmd.model_shape import REMATS, Remat
from spmd.parallel.hooks import fp8_site, gather, tp_sum

if TYPE_CHECKING:  # models.contract imports the families, which import this module
    from models.contract import ModelConfig

__all__ = ["REMAT_POLICIES", "REMATS", "Remat"]  # re-exported: the families' remat field

# each remat choice's jax.checkpoint policy (spmd.model_shape.Remat lists and explains them)
REMAT_POLICIES = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # dots_saveable's matmul outputs, kept in host memory until the backward pass reads them
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
assert tuple(REMAT_POLICIES) == REMATS

# Residual-stream activations (embedding output, norms, residual adds). Their length is split
# over `tensor` under sequence parallelism; the matmuls' inputs are whole along `length`.
RESIDUAL = ("batch", "residual_length", "embed")
WHOLE = ("batch", "length", "embed")


Model = TypeVar("Model", bound=nnx.Module)


def creator(model: Callable[[Any, nnx.Rngs, Any], Model]) -> Callable[..., Model]:
    """A family's `create` (models/contract.py) for a model class built as `model(cfg, rngs,
    dtype)`: (cfg, seed, dtype=fp32) -> the model freshly initialised from `seed`, with
    abstract shardings (eager and unsharded; spmd.engine.step creates it sharded)."""

    def create(cfg: ModelConfig, seed: int, dtype: Any = jnp.float32) -> Model:
        with nnx.use_eager_sharding(False):
            return model(cfg, nnx.Rngs(seed), dtype)

    return create


def param(
    rngs: nnx.Rngs, std: float, shape: tuple[int, ...], names: tuple[str | None, ...]
) -> nnx.Param:
    """A param of normal(0, std) values, or of ones when `std` is 0 (a norm's scale)."""
    init = jax.nn.initializers.normal(std) if std else jax.nn.initializers.ones
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)


def zeros(shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """A param of zeros (a bias: the layer starts as if it had none)."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale over the last dim (`names` is its logical name: `embed` for the
    residual stream, `head_dim` for Qwen3's per-head q and k norms); computed in fp32.
    `plus_one`: Gemma's form, x / rms(x) * (1 + scale) with the scale stored as its offset
    from 1 (initialised to zeros), the sum taken in fp32 as well."""

    def __init__(
        self,
        dim: int,
        eps: float,
        rngs: nnx.Rngs,
        names: tuple[str, ...] = ("embed",),
        plus_one: bool = False,
    ):
        self.scale = zeros((dim,), names) if plus_one else param(rngs, 0.0, (dim,), names)
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = gather(self.scale)
        return (normed * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


class HeadsRMSNorm(nnx.Module):
    """x / rms(x) * scale over the last two dims [heads, head_dim] at once: every head's
    features as one vector of heads x head_dim, with one scale of that shape (OLMo 2's q and k
    norms over the whole projection; `name` is the heads' logical name, `heads` or
    `kv_heads`). Computed in fp32.

    Under tensor parallelism a device holds some of the heads (x's heads dim shorter than
    `heads`), so the sum of squares is summed over the devices that split `name`. Where the
    heads are replicated instead (kv heads when tensor parallelism exceeds them) x holds all
    of them and nothing is summed: a sum over devices would count each head several times."""

    def __init__(self, heads: int, dim: int, eps: float, rngs: nnx.Rngs, name: str):
        self.scale = param(rngs, 0.0, (heads, dim), (name, "head_dim"))
        self.eps, self.heads, self.name = eps, heads, name

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        squares = jnp.sum(x32 * x32, axis=(-2, -1), keepdims=True)
        if x.shape[-2] < self.heads:  # this device's heads only (explicit executor)
            squares = tp_sum(squares, self.name)
        mean = squares / (self.heads * x.shape[-1])
        return (x32 * jax.lax.rsqrt(mean + self.eps) * gather(self.scale)).astype(x.dtype)


@jax.checkpoint
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, elementwise, whose backward pass recomputes silu(gate) from gate (kept
    anyway, as a matmul's output) instead of keeping it and its sigmoid: under the layer scan
    every kept activation is written into a stacked buffer and read back. Gradients are the
    same to the bit; the CPU benchmark's forward + backward (docs/speed.md) took 302.8 ms
    instead of 336.6, its compiled temp memory 238 MB instead of 302."""
    return jax.nn.silu(gate) * up


@jax.checkpoint
def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gelu(gate) * up with GELU's tanh approximation (Gemma's gelu_pytorch_tanh), its backward
    pass recomputing gelu(gate) from gate as `swiglu` does."""
    return jax.nn.gelu(gate, approximate=True) * up


Weight = jax.Array | adapter.Adapted  # what `dense` multiplies: a weight, or one with its adapter


def stored(module: nnx.Module, name: str) -> jax.Array:
    """The param `name` of `module`, gathered (hooks.gather) and, where a QLoRA base holds it
    as NF4 or int8 codes (models/nf4.py), dequantized to the compute dtype: this layer's slice
    only inside the layer scan, never the whole model's weights at once."""
    value = gather(getattr(module, name))
    quantized = nf4.site_of(module, name)
    return value if quantized is None else quantized.dequantize(value)


def weight(module: nnx.Module, name: str) -> Weight:
    """The weight `name` of `module` as `stored` reads it, with its LoRA adapter where a LoRA
    model put one beside it (models/adapter.py): what `dense` multiplies."""
    w = stored(module, name)
    site = getattr(module, name + adapter.SUFFIX, None)
    return w if site is None else site.beside(w)


def slice_out(w: Weight, start: jax.Array | int, size: int, axis: int) -> Weight:
    """`w` (a weight with one input dim, or a bias) sliced along its dim `axis`, its adapter's
    B with it."""
    if isinstance(w, adapter.Adapted):
        return w.slice_out(start, size, axis)
    return jax.lax.dynamic_slice_in_dim(w, start, size, axis=axis)


def dense(x: jax.Array, w: Weight, inputs: int = 1) -> jax.Array:
    """x [..., *in] times a weight w [*in, *out] (its first `inputs` dims contracted) ->
    [..., *out] in x's dtype, computed as models.matmul writes it (one 2-D matmul of merged
    rows where the partitioner allows).

    Under --precision fp8 a stacked block's matmul whose k and n reach the size rule is an
    fp8 dot (models/fp8.py, spmd.parallel.fp8_context). A weight with a LoRA adapter
    (`weight`) adds its x A B beside x W (models/adapter.py)."""
    if isinstance(w, adapter.Adapted):
        return adapter.dense(x, w, inputs, dense(x, w.w, inputs))
    lead, ins, outs = x.shape[: x.ndim - inputs], w.shape[:inputs], w.shape[inputs:]
    site = fp8_site(math.prod(ins), math.prod(outs))
    if site is None:
        return matmul(x, w, inputs)
    rows = x.reshape(math.prod(lead), math.prod(ins))
    matrix = w.astype(x.dtype).reshape(math.prod(ins), math.prod(outs))
    return fp8.matmul(rows, matrix, site).reshape(*lead, *outs)


def expert_dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """Each expert's rows times its own weight: x [expert, batch, capacity, in] and w [expert,
    in, out] -> [expert, batch, capacity, out] in x's dtype (an fp8 dot per expert under
    --precision fp8 when in and out reach the size rule, as `dense`)."""
    n, b, c, k = x.shape
    matrix = w.astype(x.dtype)
    site = fp8_site(k, w.shape[-1])
    if site is None:
        return jnp.einsum("nbce,nem->nbcm", x, matrix)
    return fp8.matmul(x.reshape(n, b * c, k), matrix, site).reshape(n, b, c, -1)
