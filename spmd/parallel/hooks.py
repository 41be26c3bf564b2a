"""The hooks a model calls, and the layout contexts that make them real.

Models speak logical axis names only (`embed`, `heads`, `vocab`, ...) and import nothing of
spmd but this module. Each hook is a no-op unless the step being traced opened a layout:

    constrain(x, names)       auto executor: pin an activation to the layout's sharding
    gather(param)             explicit ZeRO-3: all_gather a param's shards just before use
    tp_enter(x, name)         Megatron's f: identity forward, psum over `tensor` in backward
    tp_reduce(x, name)        Megatron's g: psum of a row-parallel matmul's partial sums
    tp_sum / tp_max / tp_rank the vocab-parallel cross-entropy's reductions and block index
    layer_remat(policy)       the scanned layer's remat policy (never saves gathered params)
    note(what, choice)        record a choice made while tracing (which attention kernel ran)

`activation_layout` (auto: jit + XLA's partitioner) and `explicit_layout` (explicit: inside
`jax.shard_map`, where the hooks become the hand-written collectives of the textbook layouts)
are opened by spmd.engine.step and spmd.parallel.explicit while they trace. Outside both, the
same model runs unchanged on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from spmd.parallel import rules

# checkpoint_name of a param gathered for use; the layer remat policy never saves it, so the
# backward pass gathers it again instead of keeping every layer whole (ZeRO-3's memory).
GATHERED = "spmd_gathered_param"


@dataclasses.dataclass(frozen=True)
class _Layout:
    mesh: jax.sharding.Mesh
    param_rules: rules.Rules
    compute_rules: rules.Rules


_EXPLICIT: list[_Layout] = []


@contextlib.contextmanager
def explicit_layout(mesh: jax.sharding.Mesh, zero_stage: int) -> Iterator[None]:
    """While tracing inside a shard_map over `mesh`, make the hooks below real collectives."""
    param_rules = rules.rules_for(zero_stage, "params")
    _EXPLICIT.append(_Layout(mesh, param_rules, rules.rules_for(zero_stage, "activations")))
    try:
        yield
    finally:
        _EXPLICIT.pop()


def explicit_mesh() -> jax.sharding.Mesh | None:
    """The mesh of the explicit step being traced (None outside `explicit_layout`)."""
    return _EXPLICIT[-1].mesh if _EXPLICIT else None


def _mesh_axes(layout: _Layout, table: rules.Rules, name: str | None) -> tuple[str, ...]:
    return tuple(a for a in table.get(name, ()) if layout.mesh.shape[a] > 1)


def _split_axes(name: str) -> tuple[str, ...]:
    """Mesh axes that split activations' logical dimension `name` (() when none is active)."""
    return _mesh_axes(_EXPLICIT[-1], _EXPLICIT[-1].compute_rules, name) if _EXPLICIT else ()


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
    if not _EXPLICIT:
        return value
    layout = _EXPLICIT[-1]
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
    if not _EXPLICIT:
        return policy
    layout = _EXPLICIT[-1]
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


# --- activation constraints -------------------------------------------------------------
# The model calls `constrain(x, names)` on a few activations; it is a no-op unless a layout is
# active (auto executor), so models stay runnable without any mesh.

_ACTIVE_ACTIVATIONS: list[tuple[jax.sharding.Mesh, rules.Rules]] = []


@contextlib.contextmanager
def activation_layout(
    mesh: jax.sharding.Mesh, zero_stage: int, exclude: tuple[str, ...] = ()
) -> Iterator[None]:
    """Within this context, `constrain` pins activations to the layout's shardings. Mesh axes
    in `exclude` are left out of every rule (e.g. axes a `vmap(spmd_axis_name=...)` owns)."""
    table = rules.rules_for(zero_stage, "activations")
    _ACTIVE_ACTIVATIONS.append(
        (mesh, {k: tuple(a for a in v if a not in exclude) for k, v in table.items()})
    )
    try:
        yield
    finally:
        _ACTIVE_ACTIVATIONS.pop()


@contextlib.contextmanager
def no_activation_layout() -> Iterator[None]:
    """Within this context `constrain` does nothing (e.g. inside a manual shard_map)."""
    saved = list(_ACTIVE_ACTIVATIONS)
    _ACTIVE_ACTIVATIONS.clear()
    try:
        yield
    finally:
        _ACTIVE_ACTIVATIONS.extend(saved)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Hint the partitioner that activation `x` (logical `names`) is laid out by the layout."""
    if not _ACTIVE_ACTIVATIONS:
        return x
    mesh, table = _ACTIVE_ACTIVATIONS[-1]
    spec = rules.partition_spec(names, x.shape, table, mesh, f"activation {names}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


_NOTES: dict[str, str] = {}


def note(what: str, choice: str) -> None:
    """Record a choice the model made while being traced (e.g. which attention kernel ran), so
    the run can report it; the latest trace wins."""
    _NOTES[what] = choice


def notes() -> dict[str, str]:
    """The choices `note` recorded so far, e.g. {"attention": "cudnn"}."""
    return dict(_NOTES)
