"""Explicit ZeRO-3's param gathers: over which mesh axes each param is gathered before use, and
the gather itself, which the hooks (spmd.parallel.hooks: `gather`, `scan_layers`) call.

A param is stored split by the layout's param rules and computed with by its compute rules
(spmd.parallel.traced_layout.ExplicitLayout); the dims it is stored split along but computed
whole along (ZeRO-3's `embed` over `fsdp`) are all_gathered (tiled) inside the explicit
executor's shard_map, varying, so that the transpose is a reduce-scatter of the gradient. A
stacked block's matrix under --fp8-all-gather travels in e4m3 (spmd.parallel.fp8_gather). The
gathered value is tagged for the layer remat policy (spmd.parallel.layer_scan.tag_gathered).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.parallel import fp8_context, fp8_gather, layer_scan
from spmd.parallel import traced_layout as traced


def logical_names(variable: Any) -> tuple[str | None, ...]:
    """The logical axis names an NNX variable was created with (Nones when it has none)."""
    meta = variable.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    return tuple(names) if names else (None,) * variable[...].ndim


def gathered_axes(names: tuple[str | None, ...]) -> list[tuple[str, ...]]:
    """Per dim of a param with logical `names`: the mesh axes it is gathered over before use
    (stored split, computed whole; empty where nothing is gathered)."""
    layout = traced.tracing_explicit()
    used: set[str] = set()
    out = []
    for name in names:
        stored = [a for a in traced.mesh_axes(layout, layout.param_rules, name) if a not in used]
        used.update(stored)
        computed = traced.mesh_axes(layout, layout.compute_rules, name)
        out.append(tuple(a for a in stored if a not in computed))
    return out


def gather_value(value: jax.Array, names: tuple[str | None, ...], tag: bool = True) -> jax.Array:
    """`value` all_gathered over `gathered_axes(names)`, tagged for the remat policy (`tag`).
    A stacked block's matrix under --fp8-all-gather travels in e4m3 with its scales."""
    gathered = False
    dims = [(d, axes) for d, axes in enumerate(gathered_axes(names[-value.ndim :])) if axes]
    stacked = len(names) > value.ndim  # a block's param, its `layers` dim scanned away
    # a QLoRA base's integer codes and scale bits travel as they are (models/nf4.py)
    floating = jnp.issubdtype(value.dtype, jnp.floating)
    if (
        len(dims) == 1
        and stacked
        and floating
        and fp8_context.gather_in_fp8(_whole_shape(value, dims))
    ):
        value, dims = fp8_gather.gather(value, *dims[0]), []
        gathered = True
    for dim, axes in dims:
        value = lax.all_gather(value, axes, axis=dim, tiled=True)
        gathered = True
    return layer_scan.tag_gathered(value) if gathered and tag else value


def _whole_shape(value: jax.Array, dims: list[tuple[int, tuple[str, ...]]]) -> tuple[int, ...]:
    """The shape `value` has once gathered along `dims`."""
    mesh = traced.tracing_explicit().mesh
    shape = list(value.shape)
    for dim, axes in dims:
        shape[dim] *= math.prod(mesh.shape[a] for a in axes)
    return tuple(shape)


def gathering_axes() -> frozenset[str]:
    """The mesh axes the layout being traced gathers params over per layer (explicit ZeRO-3's
    `fsdp`; empty when it gathers none)."""
    layout = traced.explicit()
    if layout is None:
        return frozenset()
    return frozenset().union(
        *(
            set(traced.mesh_axes(layout, layout.param_rules, n))
            - set(traced.mesh_axes(layout, layout.compute_rules, n))
            for n in layout.param_rules
        )
    )
