"""The model a run trains, traced without allocating anything: its graph, the logical axis
names of every param (with the data-parallel fallback for a model that names none) and the
param shapes in the working dtype."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from spmd.engine import precision
from spmd.errors import UsageError
from spmd.log import say
from spmd.parallel import rules
from spmd.parallel.layout import Layout


def abstract_model(
    make_model: Callable[[int], nnx.Module],
    seed: int,
    layout: Layout,
    policy: precision.Policy,
    executor: str,
) -> tuple[Any, Any, Any]:
    """(graphdef, logical names, param ShapeDtypeStructs in the policy's working dtype) of the model
    `make_model(seed)` builds, traced without allocating anything."""
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: make_model(seed)))
    names = rules.logical_axes(abstract_state)
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, precision.working_dtype(s.dtype, policy)),
        nnx.to_pure_dict(abstract_state),
    )
    return graphdef, unnamed_model_names(names, shapes, layout, executor), shapes


def unnamed_model_names(names: Any, shapes: Any, layout: Layout, executor: str) -> Any:
    """`names` as given when any param names a logical axis. For a model that names none, the
    data-parallel fallback: each param's largest dimension that the fsdp axis divides is called
    `embed` (the dimension the ZeRO stage's rules split over fsdp), and one line says what was
    split. UsageError where the mesh needs names (tensor or pipeline axes over 1)."""
    leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    if any(name is not None for leaf in leaves for name in leaf):
        return names
    mesh = layout.mesh
    needs_names = [f"{a}={mesh.shape[a]}" for a in ("tensor", "pipeline") if mesh.shape[a] > 1]
    if needs_names:
        raise UsageError(
            f"the model names no logical axes, so it can only be split over data and fsdp, "
            f"not {', '.join(needs_names)}; give its params logical names (nnx.Param(..., "
            f"out_sharding=('embed', 'mlp'))) or drop those axes from the mesh"
        )
    ways = mesh.shape["fsdp"]
    if ways == 1:
        return names
    if executor == "explicit" and layout.zero_stage == 3:
        raise UsageError(
            "--collectives explicit with ZeRO-3 needs a model that reads its params through "
            "spmd.gather and names their logical axes; this model names none: use the auto "
            "executor, or ZeRO 1 or 2"
        )

    def fallback(shape: jax.ShapeDtypeStruct) -> tuple[str | None, ...]:
        divisible = [d for d, size in enumerate(shape.shape) if size % ways == 0]
        if not divisible:
            return (None,) * len(shape.shape)
        largest = max(divisible, key=lambda d: shape.shape[d])
        return tuple("embed" if d == largest else None for d in range(len(shape.shape)))

    new_names = jax.tree.map(fallback, shapes)
    shape_leaves = jax.tree.leaves(shapes)
    name_leaves = jax.tree.leaves(new_names, is_leaf=_is_names)
    split = [
        math.prod(s.shape) for s, n in zip(shape_leaves, name_leaves, strict=True) if "embed" in n
    ]
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
    say(
        f"spmd: the model names no logical axes: fsdp={ways} splits the largest divisible "
        f"dimension of {len(split)} of {len(leaves)} params ({sum(split):,} of {total:,} "
        f"scalars, ZeRO-{layout.zero_stage}); the rest are replicated"
    )
    return new_names


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple)
