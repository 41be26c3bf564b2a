"""Hand-written collectives of the `explicit` executor, and the hooks the model calls.

The explicit step runs under `jax.shard_map`: every array is the local block of one device and
nothing crosses the wire unless written here. The textbook layouts are then a few calls each,
chosen per param leaf by comparing its PartitionSpecs in the three roles (params, grads,
optimizer state) of spmd.rules:

    DDP      grads: psum over (data, fsdp) / N                       (pmean)
    ZeRO-1   grads: pmean; update this rank's 1/N slice; all_gather the params
    ZeRO-2   grads: psum_scatter over fsdp (+ psum over data); update the slice; all_gather
    ZeRO-3   params stay shards; the model all_gathers each one just before use (`gather`),
             and autodiff turns that gather into the psum_scatter of its gradient
    Megatron column-parallel matmuls on local heads / MLP columns / vocab rows; row-parallel
             matmuls end in a psum over `tensor` (`tp_reduce`, Megatron's g); `tp_enter`
             (Megatron's f) marks where the backward pass must psum over `tensor`

The model names logical axes only (`heads`, `vocab`, ...); `explicit_layout` maps them to mesh
axes while the explicit step traces. Outside that context every hook is a no-op, so the same
model runs unchanged under the `auto` executor (jit + XLA's partitioner) and on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from spmd import rules

# checkpoint_name of a param gathered for use; the layer remat policy never saves it, so the
# backward pass gathers it again instead of keeping every layer whole (ZeRO-3's memory).
GATHERED = "spmd_gathered_param"


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: jax.sharding.Mesh
    param_rules: rules.Rules
    compute_rules: rules.Rules


_ACTIVE: list[_Layout] = []


@contextlib.contextmanager
def explicit_layout(mesh: jax.sharding.Mesh, zero_stage: int) -> Iterator[None]:
    """While tracing inside a shard_map over `mesh`, make the hooks below real collectives."""
    param_rules = rules.rules_for(zero_stage, "params")
    _ACTIVE.append(_Layout(mesh, param_rules, rules.rules_for(zero_stage, "activations")))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _mesh_axes(layout: _Layout, table: rules.Rules, name: str | None) -> tuple[str, ...]:
    return tuple(a for a in table.get(name, ()) if layout.mesh.shape[a] > 1)


def _split_axes(name: str) -> tuple[str, ...]:
    """Mesh axes that split activations' logical dimension `name` (() when none is active)."""
    return _mesh_axes(_ACTIVE[-1], _ACTIVE[-1].compute_rules, name) if _ACTIVE else ()


def varying_axes(x: Any) -> frozenset:
    """Mesh axes over which `x` (an array or abstract value) varies inside shard_map; empty
    outside. jax 0.10 keeps them in `manual_axis_type.varying`, earlier versions in `vma`."""
    abstract = isinstance(x, jax.ShapeDtypeStruct | jax.core.AbstractValue)
    aval = x if abstract else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


# --- hooks the model calls (no-ops without explicit_layout) ---------------------------------


def logical_names(variable: Any) -> tuple[str | None, ...]:
    """The logical axis names an NNX variable was created with (Nones when it has none)."""
    meta = variable.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(names) if names else (None,) * variable[...].ndim


def gather(variable: Any) -> jax.Array:
    """The value of a param, whole along the dims its storage shards but compute does not
    (ZeRO-3's `embed` over `fsdp`): a tiled all_gather, varying, so that its transpose is a
    reduce-scatter of the gradient. Names are read from the end: a stacked `layers` dim is
    scanned away by the time a layer uses its params."""
    value = variable[...]
    if not _ACTIVE:
        return value
    layout = _ACTIVE[-1]
    names = logical_names(variable)[-value.ndim :]
    used: set[str] = set()
    gathered = False
    for dim, name in enumerate(names):
        stored = tuple(a for a in _mesh_axes(layout, layout.param_rules, name) if a not in used)
        used.update(stored)
        axes = tuple(a for a in stored if a not in _mesh_axes(layout, layout.compute_rules, name))
        if axes:
            value = lax.all_gather(value, axes, axis=dim, tiled=True)
            gathered = True
    return checkpoint_name(value, GATHERED) if gathered else value


def tp_enter(x: jax.Array, name: str) -> jax.Array:
    """Megatron's f before column-parallel matmuls over `name`: identity forward; in backward
    the partial input gradients of the `name` shards are summed (one psum)."""
    axes = tuple(a for a in _split_axes(name) if a not in varying_axes(x))
    return lax.pcast(x, axes, to="varying") if axes else x


def tp_sum(x: jax.Array, name: str) -> jax.Array:
    """Sum of partial results over the shards of the split dimension `name` (psum)."""
    axes = _split_axes(name)
    return lax.psum(x, axes) if axes else x


def tp_reduce(x: jax.Array, name: str) -> jax.Array:
    """Megatron's g after a row-parallel matmul contracting `name`: psum of partial sums."""
    return tp_sum(x, name)


def tp_max(x: jax.Array, name: str) -> jax.Array:
    """Max over the shards of the split dimension `name` (pmax; not differentiable)."""
    axes = _split_axes(name)
    return lax.pmax(x, axes) if axes else x


def tp_rank(name: str) -> jax.Array | int:
    """Which block of the split dimension `name` this device holds (0 when unsplit)."""
    axes = _split_axes(name)
    return lax.axis_index(axes) if axes else 0


# Ops that only re-lay out their input: free to recompute, and saving one that reads a gathered
# param (e.g. a norm scale broadcast to the activations' rank) would keep that param whole.
_LAYOUT_OPS = ("broadcast_in_dim", "reshape", "transpose", "convert_element_type", "squeeze")


def _not_saved(primitive: Any, params: dict) -> bool:
    if primitive.name == "name":
        return params.get("name") == GATHERED
    return primitive.name in ("all_gather", "all_gather_invariant", *_LAYOUT_OPS)


def layer_remat(policy: Any) -> Any:
    """The remat policy for a scanned layer (None: no remat). While params are gathered per
    layer (explicit ZeRO-3) it is `policy` minus the gathered params: the backward pass
    gathers them again, so only one layer is ever whole."""
    if not _ACTIVE:
        return policy
    layout = _ACTIVE[-1]
    gathering = any(
        set(_mesh_axes(layout, layout.param_rules, n))
        - set(_mesh_axes(layout, layout.compute_rules, n))
        for n in layout.param_rules
    )
    if not gathering:
        return policy

    def saveable(primitive: Any, *avals: Any, **params: Any) -> bool:
        if _not_saved(primitive, params):
            return False
        return True if policy is None else policy(primitive, *avals, **params)

    return saveable


# --- step-level building blocks, driven by PartitionSpecs ------------------------------------


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
    for dim, (have, want) in enumerate(zip(dims_param, dims_grad, strict=True)):
        scatter = tuple(a for a in want if a not in have)
        if scatter:
            grad = lax.psum_scatter(grad, scatter, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in batch_axes if a not in _spec_axes(grad_spec))
    if rest:
        grad = lax.psum(grad, rest)
    shards = math.prod(_ACTIVE[-1].mesh.shape[a] for a in batch_axes) if _ACTIVE else 1
    return grad / shards if shards > 1 else grad


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
        size = x.shape[dim] // math.prod(_ACTIVE[-1].mesh.shape[a] for a in extra)
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
