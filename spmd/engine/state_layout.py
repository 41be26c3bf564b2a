"""Where a run's state lives: the shardings of params, gradients and optimizer state for a
layout (the rules of spmd.parallel.rules at its ZeRO stage), and the bytes a device holds of
them. `program` arguments are spmd.engine.step.Program's (typed Any: step imports this
module)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from spmd.engine import frozen, precision
from spmd.parallel import rules
from spmd.parallel.layout import Layout

if TYPE_CHECKING:
    from spmd.engine.diloco import AnyCompiled


def state_shardings(
    tx: optax.GradientTransformation,
    names: Any,
    shapes: Any,
    layout: Layout,
    policy: precision.Policy,
) -> tuple[dict[str, Any], Any]:
    """(the layout's shardings by role, the optimizer state's ShapeDtypeStructs): "params",
    "grads", "opt_state", "opt_state_per_param" (the optimizer layout of each param-shaped
    leaf) and "batch" (a prefix sharding splitting dim 0 of any batch leaf). Gradients and
    optimizer state are the trainable params' only (spmd.engine.frozen)."""
    mesh, zero = layout.mesh, layout.zero_stage
    t_names, t_shapes = frozen.trainable(names), frozen.trainable(shapes)
    master_shapes = master_like(t_shapes, policy)
    opt_shapes, opt_sh = opt_state_shardings(tx, master_shapes, t_names, layout, policy)
    shardings = {
        "params": rules.tree_shardings(names, shapes, mesh, zero, "params"),
        "grads": rules.tree_shardings(t_names, t_shapes, mesh, zero, "grads"),
        "opt_state": opt_sh,
        "opt_state_per_param": rules.tree_shardings(t_names, t_shapes, mesh, zero, "opt_state"),
        "batch": layout.batch_sharding(ndim=1),
    }
    return shardings, opt_shapes


def with_sharding(shapes: Any, shardings: Any) -> Any:
    """`shapes` (ShapeDtypeStructs) carrying the matching leaves of `shardings`; where one is
    None (a compiled step's input it never reads, as Adafactor's size-1 placeholders), the
    leaf keeps its own sharding."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh or s.sharding),
        shapes,
        shardings,
    )


def opt_state_shardings(
    tx: optax.GradientTransformation,
    master: Any,
    names: Any,
    layout: Layout,
    policy: precision.Policy,
) -> tuple[Any, Any]:
    """(abstract opt state, its shardings) for master weights `master` (ShapeDtypeStructs):
    the master copy and the param-shaped leaves of the optimizer (Adam's m and v) follow the
    opt_state rules; scalars such as the step count are replicated."""
    shapes = jax.eval_shape(lambda m: precision.init_opt_state(tx, m, policy), master)
    per_param = rules.tree_shardings(names, master, layout.mesh, layout.zero_stage, "opt_state")
    _, inner_shapes = precision.split_opt_state(master, shapes, policy)
    inner = optimizer_shardings(inner_shapes, per_param, layout.replicated, master)
    return shapes, precision.join_opt_state(per_param, inner, policy)


def optimizer_shardings(
    opt_shapes: Any, per_param: Any, replicated: Any, param_shapes: Any = None
) -> Any:
    """Shardings of an optimizer state `opt_shapes`: a param-shaped leaf (Adam's m and v, Muon's
    momentum) takes the sharding in `per_param` of the param it copies, the rest (step counts,
    Muon's Newton-Schulz coefficients) `replicated`. A state leaf copies a param when its key
    path ends with the param's and the shapes agree: optax keeps each param-shaped tree whole
    under a field of its state, however deep partitions and masks nest it (optax's own
    tree_map_params needs an init that takes one placeholder for the whole tree, which
    optax.contrib.muon's does not). With `param_shapes` (the params' ShapeDtypeStructs) the
    shapes must be equal: a leaf at a param's path of another shape (Adafactor's row and column
    means, its size-1 placeholders) is replicated."""
    shape_of = {
        tuple(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    }
    by_path = {
        tuple(path): sharding
        for path, sharding in jax.tree_util.tree_flatten_with_path(
            per_param, is_leaf=lambda x: isinstance(x, NamedSharding)
        )[0]
    }
    depths = sorted({len(path) for path in by_path}, reverse=True)

    def sharding_of(path: tuple, leaf: Any) -> Any:
        for depth in depths:  # the longest param path that ends the leaf's
            if depth > len(path):
                continue
            key = tuple(path[len(path) - depth :])
            sharding = by_path.get(key)
            if param_shapes is not None and shape_of.get(key) != tuple(getattr(leaf, "shape", ())):
                continue
            if sharding is not None and _fits(sharding, leaf):
                return sharding
        return replicated

    return jax.tree_util.tree_map_with_path(sharding_of, opt_shapes)


def _fits(sharding: NamedSharding, leaf: Any) -> bool:
    """Whether `leaf` has as many dims as `sharding` names (a param-shaped leaf, not a scalar
    at the same key)."""
    return len(getattr(leaf, "shape", ())) >= len(sharding.spec) and getattr(leaf, "ndim", 0) > 0


def sharded_bytes(abstract: Any) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


class HasAbstractState(Protocol):
    """What a program's state bytes are read from: a Program or a DilocoProgram (declared
    here, below both, so this module imports neither)."""

    abstract_params: Any  # ShapeDtypeStructs with shardings
    abstract_opt_state: Any


def state_bytes_per_device(
    compiled: AnyCompiled,  # a jax.stages.Compiled, or DiLoCo's pair (spmd.engine.diloco.Compiled)
    program: HasAbstractState,
    measure: Callable[[Any], Any] = sharded_bytes,
) -> dict[str, Any]:
    """Bytes of params and of optimizer state one device holds, read from the shardings the
    compiled train step takes them in; `measure` sizes each (sharded_bytes: an int)."""
    (param_sh, opt_sh, *_), _ = compiled.input_shardings
    return {
        "params": measure(with_sharding(program.abstract_params, param_sh)),
        "opt_state": measure(with_sharding(program.abstract_opt_state, opt_sh)),
    }


def abstract_state(
    shapes: Any,
    opt_shapes: Any,
    shardings: dict[str, Any],
    layout: Layout,
    policy: precision.Policy,
) -> dict[str, Any]:
    """The Program's abstract state on the mesh (ShapeDtypeStructs with shardings): params,
    optimizer state, loss scale (replicated scalars) and the fp32 master weights laid out
    like the params (e.g. to load them)."""
    param_sh = shardings["params"]
    scale_shapes = jax.eval_shape(lambda: precision.init_loss_scale(policy))
    master_shapes = master_like(shapes, policy)
    return {
        "abstract_params": with_sharding(shapes, param_sh),
        "abstract_opt_state": with_sharding(opt_shapes, shardings["opt_state"]),
        "abstract_loss_scale": jax.tree.map(
            lambda s: s.update(sharding=layout.replicated), scale_shapes
        ),
        "abstract_master": with_sharding(master_shapes, param_sh),
    }


def master_like(shapes: Any, policy: precision.Policy) -> Any:
    """`shapes` (ShapeDtypeStructs) in the policy's master-weight dtype (fp32)."""
    return jax.tree.map(lambda s: s.update(dtype=policy.master_dtype), shapes)
