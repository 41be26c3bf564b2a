"""Build the jitted, sharded train and eval steps for (model, loss, optimizer, layout).

The state is two pytrees of plain dicts: `params` (the model's nnx.Param values) and
`opt_state` (optax's), each laid out by the rules of spmd.rules for the layout's ZeRO stage.
`jax.jit` gets those shardings as in/out shardings, donates the state buffers, and XLA's SPMD
partitioner inserts the collectives (the `auto` executor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd import rules
from spmd.errors import UsageError
from spmd.mesh import BATCH_AXES

LossFn = Callable[[nnx.Module, dict[str, jax.Array]], jax.Array]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the state and the batch live: a mesh and the ZeRO stage of its fsdp axis."""

    mesh: jax.sharding.Mesh
    zero_stage: int = 3

    @property
    def data_parallel(self) -> int:
        """Number of ways the batch is split (product of the data-parallel axes)."""
        return math.prod(self.mesh.shape[a] for a in BATCH_AXES)

    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        """Sharding of a [batch, ...] array: the batch split over every data-parallel axis."""
        axes = tuple(a for a in BATCH_AXES if self.mesh.shape[a] > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None, *[None] * (ndim - 1)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


@dataclasses.dataclass
class Program:
    """The compiled-on-first-use functions of one training run and the shardings they use."""

    layout: Layout
    graphdef: Any
    names: Any  # logical axis names per param (pure dict of tuples)
    abstract_params: Any  # ShapeDtypeStructs with shardings
    abstract_opt_state: Any
    init: Callable[[], tuple[Any, Any]]  # () -> (params, opt_state), sharded
    train_step: Callable  # (params, opt_state, batch) -> (params, opt_state, metrics)
    eval_step: Callable  # (params, batch) -> mean loss
    accum: int

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        sharding = self.layout.batch_sharding()
        spec = jax.ShapeDtypeStruct((global_batch, seq_len), jnp.int32, sharding=sharding)
        return {"inputs": spec, "targets": spec}

    def compile_train_step(self, global_batch: int, seq_len: int) -> Any:
        """Lower and compile the train step for a batch shape (AOT; nothing runs)."""
        batch = self.abstract_batch(global_batch, seq_len)
        return self.train_step.lower(self.abstract_params, self.abstract_opt_state, batch).compile()


def check_batch(global_batch: int, layout: Layout, accum: int) -> None:
    """UsageError unless the global batch splits evenly into accum micro-batches per device."""
    if accum < 1:
        raise UsageError(f"--accum {accum} must be a positive number of micro-batches")
    ways = layout.data_parallel * accum
    if global_batch < 1 or global_batch % ways:
        raise UsageError(
            f"--batch {global_batch} is not divisible by data-parallel size "
            f"{layout.data_parallel} x accum {accum} = {ways}; use a multiple of {ways}"
        )


def _with_sharding(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )


def opt_state_shardings(
    tx: optax.GradientTransformation, abstract_params: Any, names: Any, layout: Layout
) -> tuple[Any, Any]:
    """(abstract opt state, its shardings): param-shaped leaves (Adam's m and v) follow the
    opt_state rules; scalars such as the step count are replicated."""
    shapes = jax.eval_shape(tx.init, abstract_params)
    per_param = rules.tree_shardings(
        names, abstract_params, layout.mesh, layout.zero_stage, "opt_state"
    )
    shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        shapes,
        per_param,
        transform_non_params=lambda _: layout.replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return shapes, shardings


def sharded_bytes(abstract: Any) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding else leaf.shape
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def state_bytes_per_device(compiled: Any, program: Program) -> dict[str, int]:
    """Bytes of params and of optimizer state one device holds, read from the shardings the
    compiled train step takes them in."""
    (param_sh, opt_sh, _), _ = compiled.input_shardings
    return {
        "params": sharded_bytes(_with_sharding(program.abstract_params, param_sh)),
        "opt_state": sharded_bytes(_with_sharding(program.abstract_opt_state, opt_sh)),
    }


def build_program(
    make_model: Callable[[int], nnx.Module],
    loss_fn: LossFn,
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    layout: Layout,
    seed: int = 0,
    accum: int = 1,
    pipeline: Any = None,
) -> Program:
    """Shardings and jitted steps for a model built by `make_model(seed)` (an NNX module whose
    params carry logical axis names), trained with `loss_fn(model, batch)` and `tx` (or
    `tx(names)`, given the logical names of every param, e.g. for a weight-decay mask).
    With a `pipeline` (spmd.pipeline.Pipeline) and a `pipeline` mesh axis over 1, the loss and
    its gradients come from that pipeline schedule instead of `loss_fn`.

    Raises UsageError up front if a mesh axis does not divide a dimension it must split."""
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: make_model(seed)))
    names = rules.logical_axes(abstract_state)
    shapes = nnx.to_pure_dict(abstract_state)
    if not isinstance(tx, optax.GradientTransformation):
        tx = tx(names)
    mesh, zero = layout.mesh, layout.zero_stage
    param_sh = rules.tree_shardings(names, shapes, mesh, zero, "params")
    grad_sh = rules.tree_shardings(names, shapes, mesh, zero, "grads")
    opt_shapes, opt_sh = opt_state_shardings(tx, shapes, names, layout)
    batch_sh = layout.batch_sharding()
    micro_sh = NamedSharding(mesh, PartitionSpec(None, *batch_sh.spec))

    def init() -> tuple[Any, Any]:
        with nnx.use_eager_sharding(False):
            params = nnx.to_pure_dict(nnx.state(make_model(seed)))
        return params, tx.init(params)

    def loss_of(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, params), batch)

    # --- pipeline parallelism: the schedule computes the loss and its gradients ---
    if pipeline is not None and mesh.shape["pipeline"] > 1:
        from spmd.pipeline import pipelined_loss

        loss_of = pipelined_loss(graphdef, names, layout, pipeline)  # noqa: F811
    # --- end pipeline ---

    grad_fn = jax.value_and_grad(loss_of)

    def accumulate(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        # Micro-batch i takes every accum-th row, so each device's rows stay on that device.
        def split(x: jax.Array) -> jax.Array:
            x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, micro_sh)

        def body(carry: tuple, micro: dict) -> tuple[tuple, None]:
            loss_sum, grad_sum = carry
            loss, grads = grad_fn(params, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), grad_sh)
        (loss_sum, grad_sum), _ = jax.lax.scan(
            body, (jnp.zeros((), jnp.float32), zeros), jax.tree.map(split, batch)
        )
        return loss_sum / accum, jax.tree.map(lambda g: g / accum, grad_sum)

    def train_step(params: Any, opt_state: Any, batch: dict[str, jax.Array]):
        with rules.activation_layout(mesh, zero):
            if accum == 1:
                loss, grads = grad_fn(params, batch)
            else:
                loss, grads = accumulate(params, batch)
        grads = jax.lax.with_sharding_constraint(grads, grad_sh)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with rules.activation_layout(mesh, zero):
            return loss_of(params, batch)

    replicated = layout.replicated
    return Program(
        layout=layout,
        graphdef=graphdef,
        names=names,
        abstract_params=_with_sharding(shapes, param_sh),
        abstract_opt_state=_with_sharding(opt_shapes, opt_sh),
        init=jax.jit(init, out_shardings=(param_sh, opt_sh)),
        train_step=jax.jit(
            train_step,
            in_shardings=(param_sh, opt_sh, batch_sh),
            out_shardings=(param_sh, opt_sh, replicated),
            donate_argnums=(0, 1),
        ),
        eval_step=jax.jit(eval_step, in_shardings=(param_sh, batch_sh), out_shardings=replicated),
        accum=accum,
    )
