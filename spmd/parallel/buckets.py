"""Gradient bucketing for the `explicit` executor: one collective per bucket of about X MB.

PyTorch DDP's lesson: an all-reduce per tiny tensor pays the collective's latency once per
tensor; one all-reduce of everything cannot start before the last gradient exists. Buckets
of a few MB sit in between. Here the local gradients are grouped by how they are reduced
(dtype, psum_scatter axes, psum axes, varying axes: only those can share one collective),
each group is laid out flat in the reverse order the forward pass first uses its params
(the head's gradients, ready first in the backward pass, lead), and cut into buckets of
`bucket_bytes` of local gradient each. Every bucket is reduced by one psum (DDP, ZeRO-1, the
data-axis sum of ZeRO-3) or one psum_scatter (+ psum over the remaining batch axes, ZeRO-2),
then the pieces go back to the leaves' shapes. A group of G bytes takes ceil(G / bucket)
collectives. The elementwise sums are those of the per-leaf path (spmd.parallel.collectives
.reduce_grad), so the result is the same up to the order XLA adds the devices' values.

ZeRO-3's fsdp reduce-scatters are the transpose of each layer's parameter gather and happen
inside the backward scan, one per param and layer; bucketing does not touch them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from spmd.parallel import collectives
from spmd.parallel.traced_layout import explicit_mesh, tracing_explicit, varying_axes

MB = 2**20  # --bucket-mb counts binary megabytes (MiB)


class Reduction(NamedTuple):
    """How one local gradient is reduced: psum_scatter over `scatter` along `dim` (None: no
    scatter), then psum over `rest`."""

    dim: int | None
    scatter: tuple[str, ...]
    rest: tuple[str, ...]


def reduction(
    grad: jax.Array, param_spec: PartitionSpec, grad_spec: PartitionSpec, batch_axes: tuple
) -> Reduction | None:
    """The Reduction of `grad` (as collectives.reduce_grad does it), or None when it scatters
    along more than one dimension (then it is reduced on its own)."""
    dims_param = collectives._dim_axes(param_spec, grad.ndim)
    dims_grad = collectives._dim_axes(grad_spec, grad.ndim)
    scatters = [
        (dim, tuple(a for a in want if a not in have))
        for dim, (have, want) in enumerate(zip(dims_param, dims_grad, strict=True))
        if any(a not in have for a in want)
    ]
    if len(scatters) > 1:
        return None
    dim, scatter = scatters[0] if scatters else (None, ())
    rest = tuple(a for a in batch_axes if a not in collectives._spec_axes(grad_spec))
    return Reduction(dim, scatter, rest)


def first_use_order(fn: Callable, params: Any, *args: Any) -> list[int]:
    """Indices of the leaves of `params` in the order `fn(params, *args)` first uses them
    (read from its jaxpr; leaves it never uses come last, in pytree order)."""
    closed = jax.make_jaxpr(fn)(params, *args)
    n = len(jax.tree.leaves(params))
    index = {id(v): i for i, v in enumerate(closed.jaxpr.invars[:n])}
    order: dict[int, None] = {}
    for eqn in closed.jaxpr.eqns:
        for var in eqn.invars:
            if id(var) in index:
                order.setdefault(index[id(var)], None)
    return list(order) + [i for i in range(n) if i not in order]


def plan(sizes: list[int], bucket_bytes: int, itemsize: int, rows: int) -> list[tuple[int, int]]:
    """[(start, stop)) column ranges of a [rows, sum(sizes) // rows] buffer, one per bucket of
    about `bucket_bytes` (at least one column each)."""
    columns = sum(sizes) // rows
    width = max(bucket_bytes // (itemsize * rows), 1)
    return [(start, min(start + width, columns)) for start in range(0, columns, width)]


def _to_rows(grad: jax.Array, dim: int | None, rows: int) -> jax.Array:
    """[rows, size // rows]: row i holds block i of `dim` (what psum_scatter gives device i)."""
    if dim is None:
        return grad.reshape(1, -1)
    return jnp.moveaxis(grad, dim, 0).reshape(rows, -1)


def _from_rows(flat: jax.Array, like: jax.Array, dim: int | None, rows: int) -> jax.Array:
    """Inverse of `_to_rows` for this device's block (one row) of a scattered gradient."""
    if dim is None:
        return flat.reshape(like.shape)
    moved = jnp.moveaxis(like, dim, 0).shape
    block = (moved[0] // rows, *moved[1:])
    return jnp.moveaxis(flat.reshape(block), 0, dim)


def _reduce_group(
    grads: list[jax.Array], dims: list[int | None], how: Reduction, bucket_bytes: int
) -> list[jax.Array]:
    """Reduce the gradients of one group (scattered along `dims`) in buckets; the reduced
    leaves, in order."""
    mesh = tracing_explicit().mesh
    rows = math.prod(mesh.shape[a] for a in how.scatter) if how.scatter else 1
    pieces = [_to_rows(g, dim, rows) for g, dim in zip(grads, dims, strict=True)]
    buffer = jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]
    sizes = [g.size for g in grads]
    reduced = []
    for start, stop in plan(sizes, bucket_bytes, buffer.dtype.itemsize, rows):
        bucket = buffer[:, start:stop]
        if how.scatter:
            bucket = lax.psum_scatter(bucket, how.scatter, scatter_dimension=0, tiled=True)
        if how.rest:
            bucket = lax.psum(bucket, how.rest)
        reduced.append(bucket)
    flat = jnp.concatenate(reduced, axis=1) if len(reduced) > 1 else reduced[0]
    out, offset = [], 0
    for grad, piece, dim in zip(grads, pieces, dims, strict=True):
        width = piece.shape[1]
        out.append(_from_rows(flat[:, offset : offset + width], grad, dim, rows))
        offset += width
    return out


def reduce_grads(
    grads: Any,
    param_specs: Any,
    grad_specs: Any,
    batch_axes: tuple[str, ...],
    bucket_bytes: int,
    order: list[int] | None = None,
) -> Any:
    """The mean over the data-parallel devices of every local gradient (as
    collectives.reduce_grad), with the collectives of each reduction group merged into buckets
    of `bucket_bytes` of local gradient. `order`: leaf indices in the order the forward pass
    uses them (the buckets run in reverse). bucket_bytes <= 0: one collective per leaf."""
    # Any: jaxlib's PyTreeDef (flatten_up_to, unflatten) has no stub mypy reads
    leaves, structure = jax.tree.flatten(grads)
    treedef: Any = structure
    p_specs = treedef.flatten_up_to(param_specs)
    g_specs = treedef.flatten_up_to(grad_specs)
    if bucket_bytes <= 0:
        reduced = [
            collectives.reduce_grad(g, p, s, batch_axes)
            for g, p, s in zip(leaves, p_specs, g_specs, strict=True)
        ]
        return treedef.unflatten(reduced)
    mesh = explicit_mesh()
    shards = math.prod(mesh.shape[a] for a in batch_axes) if mesh else 1
    out: list[jax.Array | None] = [None] * len(leaves)
    # Leaves share a collective when dtype, scatter axes, psum axes and varying axes agree
    # (the scatter dimension may differ: each leaf is laid out with it first).
    groups: dict[tuple, list[tuple[int, int | None]]] = {}
    hows = [
        reduction(g, p, s, batch_axes) for g, p, s in zip(leaves, p_specs, g_specs, strict=True)
    ]
    for i, how in enumerate(hows):
        if how is None or (not how.scatter and not how.rest):  # nothing to merge
            out[i] = collectives.reduce_grad(leaves[i], p_specs[i], g_specs[i], batch_axes)
    for i in reversed(order if order is not None else range(len(leaves))):
        if out[i] is None:
            how = hows[i]
            assert how is not None  # a leaf without a reduction was reduced above
            key = (leaves[i].dtype, how.scatter, how.rest, varying_axes(leaves[i]))
            groups.setdefault(key, []).append((i, how.dim))
    for (dtype, scatter, rest, _), members in groups.items():
        # As reduce_grad: 16-bit sums are divided first (overflow), fp32 ones after.
        predivide = shards > 1 and jnp.dtype(dtype).itemsize < 4
        grads_in = [leaves[i] / shards if predivide else leaves[i] for i, _ in members]
        dims = [dim for _, dim in members]
        how = Reduction(None, scatter, rest)
        reduced = _reduce_group(grads_in, dims, how, bucket_bytes)
        for (i, _), g in zip(members, reduced, strict=True):
            out[i] = g if predivide or shards == 1 else g / shards
    return treedef.unflatten(out)
