"""Logical axis names -> mesh axes: the table that turns a mesh into a parallelism strategy.

Models name the dimensions of their params and activations with logical names (`batch`,
`embed`, `mlp`, ...). This module maps those names onto the mesh axes of spmd.parallel.mesh, once
per
*role*: params, grads, optimizer state and activations differ only in whether the `fsdp` axis
shards the `embed` dimension, and that is exactly what the ZeRO stage says:

    zero 1: optimizer state sharded over fsdp;  zero 2: + gradients;  zero 3: + parameters.

Stage 0 is plain replication (DDP): nothing is sharded over fsdp, so a layout of stage 0 has
no fsdp axis (spmd.parallel.layout.Layout says so); it is the planner's name for its `dp=`
layouts, and the same value everywhere (`--zero 0`, `spmd.build(zero_stage=0)`).

Every dimension an axis splits must be divisible by that axis; otherwise `UsageError` names the
param, the dimension and the sizes that would work. Nothing is silently replicated.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd.errors import UsageError

Rules = dict[str, tuple[str, ...]]
ROLES = ("params", "grads", "opt_state", "activations")
ZERO_STAGES = (0, 1, 2, 3)  # 0: plain replication (DDP), no fsdp axis
ZERO_CHOICES = "0 (plain DDP, no fsdp axis), 1, 2 or 3"

# The default rules (docs/architecture.md). `embed` is handled per role below.
BASE_RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "mlp": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "length": ("context",),  # context parallelism: every activation's length
    # the length of the residual stream between tensor-parallel matmuls (embedding output,
    # norms, residual adds): split over `tensor` too under sequence parallelism
    "residual_length": (),
    "head_dim": (),
    "embed": (),
    # An MoE layer's experts: split over the expert axis and, when fsdp > 1, over the fsdp
    # devices too (expert parallelism over the data-parallel devices, as DeepSpeed-MoE does);
    # `data` replicates them (DDP). Tokens reach their experts by all_to_all over these axes,
    # in batch's order: with the experts over (expert, fsdp) instead, the partitioner followed
    # each of the auto executor's all-to-alls with a collective-permute of the same bytes.
    "expert": ("fsdp", "expert"),
}

# Logical dims that are replicated instead of split when the mesh axes outnumber them (and are
# a multiple of them): with tensor=8 and 4 kv heads, each kv head serves the devices of its
# query heads (grouped-query attention), as in Megatron.
REPLICATE_WHEN_FEWER = ("kv_heads",)

# The lowest ZeRO stage at which the fsdp axis shards each role's `embed` dimension.
_FSDP_FROM_STAGE = {"opt_state": 1, "grads": 2, "params": 3}


def rules_for(zero_stage: int, role: str, sequence_parallel: bool = False) -> Rules:
    """The logical -> mesh-axes table for one role ("params", "grads", "opt_state",
    "activations") at a ZeRO stage (0, 1, 2 or 3). With `sequence_parallel` (Megatron-SP) the
    activations' `residual_length` is split over `tensor` as well as wherever `length` is."""
    if zero_stage not in ZERO_STAGES:
        raise UsageError(f"ZeRO stage {zero_stage} is not one; use {ZERO_CHOICES}")
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    rules = dict(BASE_RULES)
    if role != "activations" and zero_stage >= _FSDP_FROM_STAGE[role]:
        rules["embed"] = ("fsdp",)
    rules["residual_length"] = rules["length"]
    if sequence_parallel and role == "activations":
        rules["residual_length"] = (*rules["length"], "tensor")
    return rules


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def partition_spec(
    names: tuple[str | None, ...],
    shape: tuple[int, ...],
    rules: Rules,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    what: str = "array",
) -> PartitionSpec:
    """Resolve one array's logical names to a PartitionSpec on `mesh`.

    Mesh axes of size 1 are left out (they would only add degenerate collectives); a mesh
    axis is used at most once per array. Raises UsageError if an axis does not divide its dim.
    """
    if len(names) != len(shape):
        raise ValueError(f"{what}: logical names {names} do not match shape {shape}")
    used: set[str] = set()
    spec = []
    for dim, (name, size) in enumerate(zip(names, shape, strict=True)):
        if name is not None and name not in rules:
            raise ValueError(f"{what}: unknown logical axis {name!r}; known: {sorted(rules)}")
        named = rules.get(name, ()) if name is not None else ()
        axes = tuple(a for a in named if mesh.shape[a] > 1 and a not in used)
        ways = math.prod(mesh.shape[a] for a in axes)
        if name in REPLICATE_WHEN_FEWER and ways > size and ways % size == 0:
            axes, ways = (), 1
        if size % ways:
            flags = ",".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise UsageError(
                f"mesh {flags} does not divide {name}={size} (dim {dim} of {what}, shape "
                f"{shape}); {name} can be split {_divisors(size)} ways"
            )
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)


def logical_axes(state: nnx.State) -> dict:
    """The logical names of every variable in an NNX state, as a pure dict of tuples.

    Variables created without names get a tuple of Nones (replicated unless a layout says
    otherwise)."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    return jax.tree.map(
        lambda spec, leaf: (
            tuple(spec)
            if isinstance(spec, PartitionSpec) and len(spec)
            else (None,) * len(leaf.shape)
        ),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def tree_shardings(
    names_tree: Any,
    shapes_tree: Any,
    mesh: jax.sharding.Mesh,
    zero_stage: int,
    role: str,
) -> Any:
    """NamedShardings for a pytree of arrays (shapes from `shapes_tree`) with logical names
    from `names_tree` (same structure, tuples as leaves), for one role at a ZeRO stage."""
    rules = rules_for(zero_stage, role)
    paths_names = jax.tree_util.tree_flatten_with_path(
        names_tree, is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    shapes, treedef = jax.tree.flatten(shapes_tree)
    out = []
    for (path, names), leaf in zip(paths_names, shapes, strict=True):
        what = f"param {jax.tree_util.keystr(path, simple=True, separator='/')}"
        out.append(NamedSharding(mesh, partition_spec(names, leaf.shape, rules, mesh, what)))
    return jax.tree.unflatten(treedef, out)
