"""The `explicit` executor: the train and eval steps as one `jax.shard_map` over the whole mesh,
every collective written by hand (spmd.parallel.collectives).

The steps take and return the same (params, opt_state, batch) pytrees, with the same global
shardings, as the `auto` executor's, so checkpoints and the train loop do not care which one
ran. Inside, each device sees its local blocks:

1. cast the params to varying over the batch axes, so `grad` leaves each device's gradient
   unreduced (ZeRO-3 params are all_gathered per layer by the model; their gradients come back
   reduce-scattered over fsdp by autodiff);
2. with gradient accumulation, add up the local gradients of the micro-batches (a lax.scan);
3. reduce the gradients once: pmean (DDP, ZeRO-1), psum_scatter (ZeRO-2) or psum over data
   (ZeRO-3), per leaf from its PartitionSpecs;
4. slice params and grads down to the optimizer state's layout, update, all_gather back (an
   optimizer that is not elementwise, Muon, updates them gathered whole and keeps the slice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from spmd.engine import frozen, optim, precision
from spmd.engine.accumulate import micro_batches
from spmd.engine.options import StepOptions
from spmd.parallel import buckets, collectives, traced_layout
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import BATCH_AXES


def _specs(shardings: Any) -> Any:
    return jax.tree.map(lambda s: s.spec, shardings, is_leaf=lambda x: isinstance(x, NamedSharding))


def _zeros_like(x: jax.Array) -> jax.Array:
    """Zeros of x's shape, dtype and varying axes (a valid scan carry for x's sums)."""
    zeros = jnp.zeros(x.shape, x.dtype)
    vma = tuple(sorted(traced_layout.varying_axes(x)))
    return lax.pcast(zeros, vma, to="varying") if vma else zeros


def local_grads(
    grad_fn: Callable,
    params: Any,
    batch: dict[str, jax.Array],
    accum: int,
    reduce_dtype: Any,
    group: int = 1,
) -> tuple[jax.Array, Any]:
    """(mean loss, mean gradients) of this device's rows, unreduced across devices. With
    accum > 1 micro-batch i takes every accum-th local row (group of `group` rows: a pair's;
    the auto executor's rows) and the gradients are summed in `reduce_dtype` by a lax.scan."""
    if accum == 1:
        return grad_fn(params, batch)

    def split(x: jax.Array) -> jax.Array:
        return micro_batches(x, accum, group)

    def body(carry: tuple, micro: dict) -> tuple[tuple, None]:
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, micro)
        grad_sum = jax.tree.map(lambda s, g: s + g.astype(reduce_dtype), grad_sum, grads)
        return (loss_sum + loss, grad_sum), None

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: split(x)[0], batch))
    shapes = (shapes[0], jax.tree.map(lambda g: g.update(dtype=reduce_dtype), shapes[1]))
    zeros = jax.tree.map(_zeros_like, shapes)
    # Each device adds only its own gradients: nothing crosses the wire inside the loop
    # (except ZeRO-3's gathers and their reduce-scatters, which are per layer by design).
    (loss_sum, grad_sum), _ = lax.scan(body, zeros, jax.tree.map(split, batch))
    return loss_sum / accum, jax.tree.map(lambda g: g / accum, grad_sum)


def sliced_update(
    tx: optax.GradientTransformation,
    params: Any,
    grads: Any,
    opt_state: Any,
    loss_scale: Any,
    grad_norm: jax.Array,
    specs: dict[str, Any],
    policy: precision.Policy,
    whole: bool = False,
) -> tuple[Any, Any, Any]:
    """(params, opt_state, loss_scale) after the optimizer update. Each rank updates only its
    slice of the master weights (the optimizer state's layout: under bf16 / fp16 the master
    copy lives there already; under fp32 ZeRO-1/2 slice the replicated params), writes back
    the slice in the working dtype and all_gathers it to the params' layout (16-bit bytes under
    bf16 / fp16). An fp16 step whose (already globally reduced) gradient norm is not finite
    keeps every rank's slices as they were. `whole`: the update reads whole params (Muon),
    so it runs on them gathered (`whole_update`) and each rank keeps its slice."""
    take = collectives.take_slice
    loss_scale = precision.fp8_state.fold(loss_scale)  # delayed fp8: the step's amaxes
    master, inner = precision.split_opt_state(params, opt_state, policy)
    if not policy.has_master:
        master = jax.tree.map(take, params, specs["params"], specs["opt_per_param"])
    slice_grads = jax.tree.map(take, grads, specs["grads"], specs["opt_per_param"])
    if whole:
        updates, new_inner = whole_update(tx, slice_grads, inner, master, specs, policy)
    else:
        updates, new_inner = tx.update(slice_grads, inner, master)
    new_master = optax.apply_updates(master, updates)
    if policy.loss_scaling:
        finite = jnp.isfinite(grad_norm)
        new_master, new_inner = precision.keep_if_finite(
            finite, (new_master, new_inner), (master, inner)
        )
        loss_scale = precision.next_loss_scale(loss_scale, finite, policy)
    working = precision.cast(new_master, policy.param_dtype)
    gather = collectives.gather_whole
    params = jax.tree.map(gather, working, specs["opt_per_param"], specs["params"])
    return params, precision.join_opt_state(new_master, new_inner, policy), loss_scale


def whole_update(
    tx: optax.GradientTransformation,
    grads: Any,
    inner: Any,
    master: Any,
    specs: dict[str, Any],
    policy: precision.Policy,
) -> tuple[Any, Any]:
    """(this rank's slice of the updates, its slice of the new optimizer state) of an update
    that is not elementwise, from the slices of the gradients, the optimizer state `inner` and
    the master weights: all three all_gathered whole (replicated over the whole mesh), updated
    as on one device, then sliced back, so the result is one device's to the rounding of the
    collectives. Every rank repeats the whole update (not spread over the fsdp ranks), and
    holds a whole copy of the state while it runs."""
    whole, per_param = PartitionSpec(), specs["opt_per_param"]
    inner_specs = precision.split_opt_state(per_param, specs["opt_state"], policy)[1]
    gather, take = collectives.gather_whole, collectives.take_slice

    def gathered(tree: Any, tree_specs: Any) -> Any:
        return jax.tree.map(lambda x, spec: gather(x, spec, whole), tree, tree_specs)

    def sliced(tree: Any, tree_specs: Any) -> Any:
        return jax.tree.map(lambda x, spec: take(x, whole, spec), tree, tree_specs)

    updates, new_inner = tx.update(
        gathered(grads, per_param), gathered(inner, inner_specs), gathered(master, per_param)
    )
    return sliced(updates, per_param), sliced(new_inner, inner_specs)


def explicit_steps(
    local_loss: Callable,
    tx: optax.GradientTransformation,
    layout: Layout,
    shardings: dict[str, Any],
    options: StepOptions,
) -> tuple[Callable, Callable]:
    """(train_step, eval_step) as shard_maps over the layout's mesh, not yet jitted.

    `local_loss(params, batch)` is the loss of each device's local blocks (the model's loss, or
    a pipeline schedule's). `shardings` holds the layout's NamedShardings: pytrees "params",
    "grads", "opt_state" and "opt_state_per_param" (the optimizer state's layout of each
    param-shaped leaf), and the "batch" sharding of a [batch, ...] array. From `options`:
    the policy (accumulation dtype, fp16 loss scaling), accum (micro-batches the step loops
    over), bucket_mb (> 0: the gradients reduced in buckets of about that many MiB,
    spmd.parallel.buckets; 0: one collective per param) and prefetch (under ZeRO-3 the model's
    layer scan gathers each layer's params while the layer before it computes,
    spmd.parallel.layer_scan). The layout's sequence parallelism splits the residual stream
    along length over `tensor` (the model's tp hooks become all_gather / psum_scatter). The
    signature and the steps' are spmd.engine.auto.auto_steps's."""
    mesh, zero_stage, sequence_parallel = layout.mesh, layout.zero_stage, layout.sequence_parallel
    accum, policy, bucket_bytes = options.accum, options.policy, options.bucket_bytes
    whole = not options.elementwise  # the update gathers whole params (sliced_update)
    specs = {
        "params": _specs(shardings["params"]),
        "grads": _specs(shardings["grads"]),
        "opt_state": _specs(shardings["opt_state"]),
        "opt_per_param": _specs(shardings["opt_state_per_param"]),
    }
    # Gradients are averaged over every axis that splits the tokens: the batch axes and
    # `context` (each of its devices holds a share of every sequence).
    batch_axes = tuple(a for a in (*BATCH_AXES, "context") if mesh.shape[a] > 1)
    # what the gradients and the update see: the trainable params (spmd.engine.frozen)
    trained = specs | {"params": frozen.trainable(specs["params"])}
    pipelined = options.pipelined(mesh)

    @contextlib.contextmanager
    def traced_on_devices() -> Iterator[None]:
        # the hooks become collectives; the auto executor's activation constraints are off
        with (
            traced_layout.explicit_layout(
                mesh, zero_stage, sequence_parallel, prefetch=options.prefetch
            ),
            traced_layout.no_activation_layout(),
            traced_layout.context_attention(layout.cp_mode),
        ):
            yield

    def train_step(params: Any, opt_state: Any, loss_scale: Any, batch: dict[str, jax.Array]):
        with traced_on_devices(), traced_layout.training(optim.update_count(opt_state)):
            params, fixed = frozen.split(params)  # frozen params: constants, passed through
            held = fixed
            if pipelined and fixed is not None:
                # the schedule's custom_vjp returns a gradient for every param it takes, per
                # device (varying over the batch axes): its frozen inputs must vary as well
                held = collectives.vary_over(fixed, batch_axes)
            loss, grads = reduced_grads(
                frozen.bind(local_loss, held),
                params,
                loss_scale,
                batch,
                accum,
                policy,
                trained,
                batch_axes,
                bucket_bytes,
                options.row_group,
            )
            grad_norm = collectives.global_norm(grads)
            params, opt_state, loss_scale = sliced_update(
                tx, params, grads, opt_state, loss_scale, grad_norm, trained, policy, whole
            )
            params = frozen.join(params, fixed)
            metrics = {
                "loss": loss.astype(policy.output_dtype),
                "grad_norm": grad_norm,
                "loss_scale": loss_scale["scale"],
                "skipped_steps": loss_scale["skipped_steps"],
            }
            return params, opt_state, loss_scale, metrics

    def eval_step(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with traced_on_devices():
            loss = local_loss(params, batch)
            return lax.pmean(loss, batch_axes) if batch_axes else loss

    return _shard_mapped(train_step, eval_step, mesh, specs, shardings["batch"])


def _shard_mapped(
    train_step: Callable,
    eval_step: Callable,
    mesh: jax.sharding.Mesh,
    specs: dict[str, Any],
    batch_sharding: NamedSharding,
) -> tuple[Callable, Callable]:
    """The per-device steps as shard_maps over the whole mesh (vma checked: without it the
    tensor-parallel gradients are silently wrong)."""
    batch_spec = PartitionSpec(batch_sharding.spec[0])  # a prefix for every batch leaf
    train = jax.shard_map(
        train_step,
        mesh=mesh,
        in_specs=(specs["params"], specs["opt_state"], PartitionSpec(), batch_spec),
        out_specs=(specs["params"], specs["opt_state"], PartitionSpec(), PartitionSpec()),
        check_vma=True,
    )
    evaluate = jax.shard_map(
        eval_step,
        mesh=mesh,
        in_specs=(specs["params"], batch_spec),
        out_specs=PartitionSpec(),
        check_vma=True,
    )
    return train, evaluate


def reduced_grads(
    local_loss: Callable,
    params: Any,
    loss_scale: Any,
    batch: dict[str, jax.Array],
    accum: int,
    policy: precision.Policy,
    specs: dict[str, Any],
    batch_axes: tuple[str, ...],
    bucket_bytes: int,
    group: int = 1,
) -> tuple[jax.Array, Any]:
    """(the loss averaged over `batch_axes`, the gradients in the layout of specs["grads"],
    in the master dtype, unscaled): each device's local gradients of `local_loss`, summed over
    the micro-batches (`group` rows kept together: local_grads), then reduced once per param
    or per bucket."""
    grad_fn = precision.scaled_value_and_grad(local_loss, loss_scale, policy)
    # Gradients come out, are accumulated and reduced in the reduce dtype.
    varying = precision.cast(collectives.vary_over(params, batch_axes), policy.reduce_dtype)
    loss, grads = local_grads(grad_fn, varying, batch, accum, policy.reduce_dtype, group)
    # Buckets run in the reverse order of the forward pass's first use of each param.
    order = buckets.first_use_order(local_loss, varying, batch) if bucket_bytes > 0 else None
    grads = buckets.reduce_grads(
        grads, specs["params"], specs["grads"], batch_axes, bucket_bytes, order
    )
    loss = lax.pmean(loss, batch_axes) if batch_axes else loss
    grads = precision.cast(grads, policy.master_dtype)
    return loss, precision.unscale(grads, loss_scale, policy)
