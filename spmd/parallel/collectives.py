"""Hand-written collectives of the `explicit` executor, driven by PartitionSpecs.

The explicit step runs under `jax.shard_map`: every array is the local block of one device and
nothing crosses the wire unless written here or in the model hooks (spmd.parallel.hooks). The
textbook layouts are then a few calls each, chosen per param leaf by comparing its
PartitionSpecs in the three roles (params, grads, optimizer state) of spmd.parallel.rules:

    DDP      grads: psum over (data, fsdp) / N                       (pmean)
    ZeRO-1   grads: pmean; update this rank's 1/N slice; all_gather the params
    ZeRO-2   grads: psum_scatter over fsdp (+ psum over data); update the slice; all_gather
    ZeRO-3   params stay shards; the model all_gathers each one just before use (hooks.gather),
             and autodiff turns that gather into the psum_scatter of its gradient
    Megatron column-parallel matmuls on local heads / MLP columns / vocab rows; row-parallel
             matmuls end in a psum over `tensor` (hooks.tp_reduce, Megatron's g)
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from spmd.parallel.traced_layout import explicit_mesh, tracing_explicit, varying_axes


def _dim_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes per dimension of an array laid out by `spec`."""
    out = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return out


def _spec_axes(spec: PartitionSpec) -> set[str]:
    return {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}


def vary_over(tree: Any, axes: tuple[str, ...]) -> Any:
    """Cast every leaf to varying over `axes` (those it does not vary over yet). Done to the
    params before `grad`, so that the gradients come back per device, unreduced, and are
    reduced once by `reduce_grad` instead of inside the backward pass."""

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def reduce_grad(
    grad: jax.Array,
    param_spec: PartitionSpec,
    grad_spec: PartitionSpec,
    batch_axes: tuple[str, ...],
) -> jax.Array:
    """Mean over the data-parallel devices of one local gradient, laid out by `grad_spec`.

    Dims the grad layout splits but the params do not get a psum_scatter (ZeRO-2); the other
    batch axes get a psum (DDP, ZeRO-1; over `data` only for ZeRO-3, whose fsdp sum already
    happened in the transpose of `gather`). Then divide by the number of batch shards."""
    dims_param, dims_grad = (_dim_axes(s, grad.ndim) for s in (param_spec, grad_spec))
    shards = math.prod(mesh.shape[a] for a in batch_axes) if (mesh := explicit_mesh()) else 1
    # A 16-bit sum over N devices can overflow where each addend does not (fp16 tops out at
    # 65504, and its loss-scaled gradients sit near it): divide first, as PyTorch DDP's
    # gradient pre-divide does. fp32 keeps sum-then-divide.
    predivide = shards > 1 and jnp.dtype(grad.dtype).itemsize < 4
    if predivide:
        grad = grad / shards
    for dim, (have, want) in enumerate(zip(dims_param, dims_grad, strict=True)):
        scatter = tuple(a for a in want if a not in have)
        if scatter:
            grad = lax.psum_scatter(grad, scatter, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in batch_axes if a not in _spec_axes(grad_spec))
    if rest:
        grad = lax.psum(grad, rest)
    return grad / shards if shards > 1 and not predivide else grad


def take_slice(x: jax.Array, have: PartitionSpec, want: PartitionSpec) -> jax.Array:
    """This device's block of `x` (laid out by `have`) under the finer layout `want`: e.g. the
    1/N slice of a replicated param that a ZeRO-1/2 rank updates. No communication."""
    pairs = zip(_dim_axes(have, x.ndim), _dim_axes(want, x.ndim), strict=True)
    for dim, (h, w) in enumerate(pairs):
        extra = tuple(a for a in w if a not in h)
        if not extra:
            continue
        if h:
            raise ValueError(f"cannot refine dim {dim} from {have} to {want}")
        size = x.shape[dim] // math.prod(tracing_explicit().mesh.shape[a] for a in extra)
        x = lax.dynamic_slice_in_dim(x, lax.axis_index(extra) * size, size, axis=dim)
    return x


def gather_whole(x: jax.Array, have: PartitionSpec, want: PartitionSpec) -> jax.Array:
    """The inverse of `take_slice`: all_gather the blocks of `x` (laid out by `have`) into the
    coarser layout `want`, replicated (invariant) over the gathered axes."""
    pairs = zip(_dim_axes(have, x.ndim), _dim_axes(want, x.ndim), strict=True)
    for dim, (h, w) in enumerate(pairs):
        extra = tuple(a for a in h if a not in w)
        if extra:
            x = lax.all_gather(x, extra, axis=dim, tiled=True, to="invarying")
    return x


def global_norm(tree: Any) -> jax.Array:
    """L2 norm of all leaves together. Inside shard_map each leaf's squared norm is summed
    over the axes it is split over (its varying axes): one psum per distinct axis set.
    Outside shard_map this equals optax.global_norm."""
    groups: dict[frozenset, jax.Array] = defaultdict(lambda: jnp.zeros((), jnp.float32))
    for leaf in jax.tree.leaves(tree):
        axes = varying_axes(leaf)
        groups[axes] = groups[axes] + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    total = jnp.zeros((), jnp.float32)
    for axes, squares in groups.items():
        total = total + (lax.psum(squares, tuple(sorted(axes))) if axes else squares)
    return jnp.sqrt(total)
