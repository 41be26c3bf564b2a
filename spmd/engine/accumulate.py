"""Gradient accumulation inside one jitted step, with one gradient reduction per optimizer step.

`--accum k` splits the global batch into k micro-batches and runs them in a `lax.scan` inside
the jitted train step. We do this rather than `optax.MultiSteps` because MultiSteps calls the
step once per micro-batch: every call must return reduced gradients (one all-reduce per
micro-batch), it keeps a persistent gradient accumulator in the optimizer state (+1 copy of the
params' bytes per device), and the host dispatches k programs per optimizer step.

A plain scan that adds the (global) gradients of each micro-batch is not enough either: the
SPMD partitioner reduces each micro-batch's gradients inside the loop (verified on XLA:CPU:
the all-reduce over `data` runs accum times per step). So the accumulator keeps one
*unreduced* gradient per data-parallel replica: a leading dimension of size R sharded over the
replica axes, filled by `vmap(grad, spmd_axis_name=replica axes)` over the micro-batch's per-
replica slices. Each device then adds only its own gradient, and one sum over that dimension
after the loop is the single all-reduce (or reduce-scatter) of the step.

Replica axes are the batch axes along which gradients are replicated: always `data`, and
`fsdp` at ZeRO-1. At ZeRO-2/3 the gradients are sharded over `fsdp`, and each micro-batch's
reduce-scatter over `fsdp` stays inside the loop on purpose: deferring it would hold a full,
unsharded gradient per device, which is the memory ZeRO-2 exists to save (DeepSpeed reduces
every micro-step for the same reason; PyTorch FSDP's `no_sync` makes the opposite trade).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spmd.parallel import traced_layout
from spmd.parallel.mesh import BATCH_AXES

GradFn = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, Any]]


def replica_axes(mesh: jax.sharding.Mesh, zero_stage: int) -> tuple[str, ...]:
    """Data-parallel mesh axes (size > 1) over which gradients are replicated, outermost first:
    `data`, plus `fsdp` at ZeRO-1. Always a prefix of the batch's sharding axes."""
    split = [a for a in BATCH_AXES if mesh.shape[a] > 1]
    return tuple(a for a in split if a == "data" or zero_stage == 1)


def micro_batches(x: jax.Array, accum: int, group: int = 1) -> jax.Array:
    """[B, ...] -> [accum, B / accum, ...]: micro-batch i takes every accum-th group of `group`
    consecutive rows, starting at group i (both executors' rule: a device's rows stay its)."""
    x = x.reshape(x.shape[0] // (accum * group), accum, group, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(accum, x.shape[1] * group, *x.shape[3:])


def accumulated_grads(
    grad_fn: GradFn,
    params: Any,
    batch: dict[str, jax.Array],
    accum: int,
    mesh: jax.sharding.Mesh,
    zero_stage: int,
    grad_shardings: Any,
    reduce_dtype: Any = jnp.float32,
    exclude: tuple[str, ...] = (),
    group: int = 1,
) -> tuple[jax.Array, Any]:
    """(loss, grads) of the whole batch from `accum` micro-batches, where `grad_fn(params,
    micro)` gives a micro-batch's per-token mean loss and its gradients.

    Every micro-batch of every replica holds the same number of tokens (batch / (accum * R)
    sequences of equal length, no padding), so the mean of those per-token means is the
    per-token mean of the whole batch: accum k trains exactly like one batch of k times the
    size. Gradients are accumulated in `reduce_dtype`. Mesh axes in `exclude` belong to an
    enclosing `vmap(spmd_axis_name=...)` (spmd.engine.diloco's replicas) and are left alone.
    `group` consecutive rows stay in one micro-batch (2: a preference pair's chosen and
    rejected rows, spmd.io.pairs)."""
    replicas = tuple(a for a in replica_axes(mesh, zero_stage) if a not in exclude)
    n_replicas = math.prod(mesh.shape[a] for a in replicas)
    within = tuple(
        a for a in BATCH_AXES if mesh.shape[a] > 1 and a not in replicas and a not in exclude
    )

    def split(x: jax.Array) -> jax.Array:
        # [B, ...] -> [accum, R, B / (accum R), ...]. Micro-batch i takes every accum-th row
        # (group of rows), so each device's rows stay on that device and replica r's rows are
        # replica r's.
        rows = x.shape[0] // (accum * n_replicas)
        x = micro_batches(x, accum, group)
        x = x.reshape(accum, n_replicas, rows, *x.shape[2:])
        spec = PartitionSpec(None, replicas or None, within or None)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def stacked(sharding: NamedSharding) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(replicas or None, *sharding.spec))

    accum_shardings = jax.tree.map(stacked, grad_shardings)
    loss_sharding = stacked(NamedSharding(mesh, PartitionSpec()))
    per_replica = jax.vmap(grad_fn, in_axes=(None, 0), spmd_axis_name=replicas or None)

    def body(carry: tuple, micro: dict) -> tuple[tuple, None]:
        loss_sum, grad_sum = carry
        with traced_layout.activation_layout(mesh, zero_stage, exclude=(*replicas, *exclude)):
            losses, grads = per_replica(params, micro)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(reduce_dtype), grad_sum, grads)
        grad_sum = jax.lax.with_sharding_constraint(grad_sum, accum_shardings)
        return (loss_sum + losses, grad_sum), None

    zeros = jax.tree.map(lambda p: jnp.zeros((n_replicas, *p.shape), reduce_dtype), params)
    zeros = jax.lax.with_sharding_constraint(zeros, accum_shardings)
    # Per-replica loss sums too, so the loss is reduced once, with the gradients.
    zero_losses = jax.lax.with_sharding_constraint(
        jnp.zeros((n_replicas,), jnp.float32), loss_sharding
    )
    (loss_sum, grad_sum), _ = jax.lax.scan(body, (zero_losses, zeros), jax.tree.map(split, batch))
    count = accum * n_replicas
    grads = jax.tree.map(lambda g: g.sum(0) / count, grad_sum)  # the one reduction
    return loss_sum.sum() / count, jax.lax.with_sharding_constraint(grads, grad_shardings)
