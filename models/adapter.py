"""A LoRA adapter beside its base matmul, in peft's form: y = x W + scale * dropout(x) A B.

models/lora.py puts a `Site` on each adapted projection's module (attribute `<weight>_lora`,
e.g. `wq_lora` beside `wq`) in a transient copy of the base model; the families read their
weights through `models.layers.weight`, which returns the plain weight or, where a site is,
an `Adapted` (W, A, B) that `models.layers.dense` multiplies in two parts. The base matmul is
the one full fine-tuning runs; the adapter adds x A [.., r] and (x A) B. The backward pass then
forms the gradients of A and B from x A and dy B^T, never the [in, out] gradient of W.

Tensor parallelism needs no collective of its own: A follows W's input axes and B its output
axes, so for a column-parallel W (x whole, W split on its output) x A is whole and (x A) B is
this device's block of outputs; for a row-parallel W (x split on its input, as A is) x A is a
partial sum, (x A) B too, and the block's own reduction after the matmul (tp_reduce) sums it
with x W's partial sums, (x A) B being linear in x A.

Dropout (--lora-dropout P): each element of the adapter's input is zeroed with probability P
and the rest scaled by 1 / (1 - P), in the train step only (`noise`, which models/lora.py opens
there). An element's fate is a hash of (the run's seed, the optimizer step, its row's tokens, its
position in the sequence, the layer, the projection, its feature index): the same on every
layout (the mask of the global [batch, length, in] shape, each device computing its own block
of it), the same on a resume (the step is the optimizer state's update count), new when a
window comes back in a later epoch, and recomputed rather than stored by the backward pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from models.matmul import matmul
from spmd.parallel.hooks import gather, sequence_sum, token_positions, tp_rank, tp_ways

SUFFIX = "_lora"  # a site's attribute: the weight's name + SUFFIX

_NOISE: list[jax.Array] = []  # the per-token keys [batch, length] of the step being traced


@contextlib.contextmanager
def noise(keys: jax.Array) -> Iterator[None]:
    """Dropout on while tracing inside: `keys` [batch, length] uint32 (`token_keys`)."""
    _NOISE.append(keys)
    try:
        yield
    finally:
        _NOISE.pop()


def _mix(x: jax.Array) -> jax.Array:
    """A uint32 hash of uint32 x, elementwise (Wellons' lowbias32: every bit of the input
    flips about half the output's)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def token_keys(tokens: jax.Array, seed: int, step: jax.Array | None = None) -> jax.Array:
    """Per-token dropout keys [batch, length] uint32 of token ids [batch, length] (this
    device's, in the layout's sequence order): a hash of the seed, the optimizer step (None:
    the same keys at every step), the row's tokens (an order-free sum, so that context
    parallelism's chunks add up to it) and the position."""
    row = jnp.sum(_mix(tokens.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)), axis=1)
    row = sequence_sum(row.astype(jnp.uint32))  # the row's other chunks (cp)
    positions = token_positions(tokens[..., None], whole=True).astype(jnp.uint32)
    run = jnp.uint32(seed & 0xFFFFFFFF)
    if step is not None:  # a window seen again in a later epoch gets new masks
        run = run ^ _mix(jnp.asarray(step).astype(jnp.uint32) + jnp.uint32(0x85EBCA6B))
    return _mix(_mix(row[:, None] ^ run) + positions)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapted:
    """A base weight w [*in, *out] with its adapter: a [*in, r], b [r, *out] (this layer's,
    gathered), the layer's index (a float scalar: it rides in the layer scan's params), and
    what the site knows: scale, dropout rate, the projection's number and its input's logical
    names."""

    w: jax.Array
    a: jax.Array
    b: jax.Array
    layer: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))
    rate: float = dataclasses.field(metadata=dict(static=True))
    site: int = dataclasses.field(metadata=dict(static=True))
    in_names: tuple[str | None, ...] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def slice_out(self, start: jax.Array | int, size: int, axis: int) -> Adapted:
        """W and B sliced along output dim `axis` (a single-input weight's: W [in, *out] and
        B [r, *out] hold their outputs at the same positions)."""
        w = jax.lax.dynamic_slice_in_dim(self.w, start, size, axis=axis)
        b = jax.lax.dynamic_slice_in_dim(self.b, start, size, axis=axis)
        return dataclasses.replace(self, w=w, b=b)


class Site(nnx.Module):
    """An adapter's place beside a base weight: A and B (the LoRA model's params, stacked as
    the weight is), the layer indices [layers] (float; dropout only), scale and rate."""

    def __init__(
        self,
        a: nnx.Param,
        b: nnx.Param,
        layers: nnx.Variable | None,
        scale: float,
        rate: float,
        site: int,
        inputs: int,
    ):
        self.a, self.b, self.layers = a, b, layers
        self.scale, self.rate, self.site = scale, rate, site
        names = a.get_metadata().get("out_sharding") or (None,) * a[...].ndim
        self.in_names = tuple(names[-inputs - 1 : -1])

    def beside(self, w: jax.Array) -> Adapted:
        """`w` (gathered) with this site's adapter (gathered)."""
        layer = self.layers[...] if self.layers is not None else jnp.zeros((), jnp.float32)
        a, b = gather(self.a), gather(self.b)
        return Adapted(w, a, b, layer, self.scale, self.rate, self.site, self.in_names)


def _feature_ids(local: tuple[int, ...], names: tuple[str | None, ...]) -> jax.Array:
    """The global row-major index [*local] uint32 of each input feature this device holds
    (its blocks of the dims `names` split over devices; all of them under auto)."""
    index = jnp.zeros(local, jnp.uint32)
    for dim, (size, name) in enumerate(zip(local, names, strict=True)):
        whole = size * (tp_ways(name) if name else 1)
        first = tp_rank(name) * size if name else 0
        coords = jax.lax.broadcasted_iota(jnp.uint32, local, dim) + jnp.uint32(first)
        index = index * jnp.uint32(whole) + coords
    return index


def _dropped(x: jax.Array, w: Adapted, inputs: int, keys: jax.Array) -> jax.Array:
    """x [batch, length, *in] with the adapter's dropout applied (module docstring)."""
    salt = _mix(w.layer.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B) + jnp.uint32(w.site + 1))
    features = _mix(_feature_ids(x.shape[-inputs:], w.in_names) ^ salt)
    key = keys.reshape(*keys.shape, *(1,) * inputs)
    bits = _mix(key ^ features)
    keep = bits >= jnp.uint32(min(int(w.rate * 2**32), 2**32 - 1))
    return jnp.where(keep, x / jnp.asarray(1.0 - w.rate, x.dtype), jnp.zeros((), x.dtype))


def dense(x: jax.Array, w: Adapted, inputs: int, base: jax.Array) -> jax.Array:
    """`base` (x W) plus the adapter's scale * dropout(x) A B, in base's dtype."""
    if w.rate and _NOISE:
        x = _dropped(x, w, inputs, _NOISE[-1])
    low = matmul(x, w.a, inputs)  # [..., r]
    return base + (w.scale * matmul(low, w.b, 1)).astype(base.dtype)
