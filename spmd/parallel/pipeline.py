"""Pipeline parallelism over the `pipeline` mesh axis, in SPMD, driven by a static tick table.

`pipelined_loss(...)` returns a drop-in `loss(params, batch)` for spmd.engine.step: its value is the
mean loss of the batch, and `jax.value_and_grad` of it runs a whole pipeline schedule (GPipe,
1F1B or interleaved; spmd.parallel.schedules) in one pass, because the loss is a scalar: the
forward of
its `custom_vjp` already computes every gradient, the backward only scales them.

How it runs. A `jax.shard_map` is manual over `pipeline` and over the batch axes whose
gradients are one all-reduce per step (`data`; `fsdp` too under ZeRO-1: manual_batch_axes);
`tensor` and a ZeRO-2/3 `fsdp` stay with the executor (auto: XLA's partitioner, as outside the
pipeline). Each stage
takes its own column of the tick table and one `lax.scan` walks the ticks. Per tick a stage
runs its forward slot (a chunk of layers on a stashed input), then its backward slot
(`jax.vjp` of a chunk on its stashed input and the output gradient from its inbox: the chunk's
forward is recomputed, so only chunk inputs are stashed), then one `ppermute` forward and one
backward. A slot runs under a `lax.cond` on the stage's own table entry, so idle slots (the
bubble) cost no compute and a tick lasts as long as the busiest stage's slots: the ticks where
no stage has a backward (warm-up) or a forward (cool-down) cost only the other kind, which is
what the table's `phases` count. (Splitting the scan into one scan per phase drops the same
slots statically, but XLA inlines the one-tick warm-up and cool-down loops of pp=2 and then
keeps their buffers apart: +3.2 MB of temp memory on the tiny model's 5.6 MB, measured, which
put 1F1B above GPipe; at pp=4 both came to the same bytes. One loop body also compiles less.)

Where the embedding and the head live. Both are kept replicated over `pipeline` (and sharded
over fsdp / tensor as the rules say): a param cannot live on one stage of an SPMD axis. They
are *run* on one stage only: the lookup on stage 0 when it starts a micro-batch, the head
(final norm, logits, loss) on the last stage right after the last chunk, each under a
`lax.cond` on the stage's table entry (no collective over `pipeline` is inside a cond). Cost:
their params and Adam state are held p times, and their gradients are summed over `pipeline`
once per step (an all-reduce of embed + head bytes); the last stage's ticks are longer by the
head's time, which every stage waits for.

Interleaved layout. Chunk c (layers [c L/C, (c+1) L/C), C = p v) lives on stage c % p. The
stored stack keeps the model's order (stage s holds layers [s L/p, (s+1) L/p)), so checkpoints,
evaluation and other meshes see one layout; at the step boundary the stack is reshaped
[L, ...] -> [v, p, L/C, ...] and the partitioner moves each chunk to its stage (for v > 1 a
resharding of (p-1)/p of the block params each step, and the same for their gradients back;
for v = 1 the reshape is free).

Composition with the explicit executor: `stage_step` is the per-stage program (local arrays
in, loss and local gradients out) and needs only the `pipeline` axis to be manual, so an
executor whose shard_map is manual over more axes can call it inside its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from spmd.errors import UsageError
from spmd.parallel import hooks, schedules
from spmd.parallel.pipeline_stage import AXIS, LogitsLoss, stage_step


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How to pipeline a model over the `pipeline` axis. The model must provide
    `embed_tokens(tokens)`, `apply_blocks(x)` (runs whatever layers its stack holds; with a
    document mask `apply_blocks(x, segments)`) and `head_logits(x)`; its stacked params are
    those whose first logical axis is `layers`."""

    schedule: str  # one of schedules.SCHEDULES
    microbatches: int  # per pipeline pass (per accumulation micro-step); 0: 2 x stages
    virtual: int  # chunks per stage (interleaved)
    logits_loss: LogitsLoss  # mean loss of one micro-batch's logits and targets

    def resolved_microbatches(self, stages: int) -> int:
        """M: as given, or 2 x stages for 0 (bubble (p-1)/(3p-1), about a third)."""
        return self.microbatches or 2 * stages


def with_accumulation(pipe: Pipeline, stages: int, accum: int) -> Pipeline:
    """The pipeline that runs `accum` accumulation micro-steps of M micro-batches each as one
    schedule over accum x M micro-batches: the same mean loss and gradients (every micro-batch
    holds the same rows), one gradient reduction per optimizer step, and a bubble accum times
    smaller than running the schedule accum times."""
    return dataclasses.replace(pipe, microbatches=pipe.resolved_microbatches(stages) * accum)


def table(pipe: Pipeline, stages: int, backward: bool = True) -> schedules.Table:
    """The checked tick table this pipeline runs on `stages` stages."""
    return schedules.build(
        pipe.schedule, stages, pipe.resolved_microbatches(stages), pipe.virtual, backward
    )


def check(pipe: Pipeline, layout: Any, n_layers: int, batch: int, accum: int) -> None:
    """UsageError unless the layers, micro-batches and batch split as the schedule needs."""
    stages = layout.mesh.shape[AXIS]
    microbatches = pipe.resolved_microbatches(stages)
    schedules.check_settings(pipe.schedule, stages, microbatches, pipe.virtual)
    chunks = stages * pipe.virtual
    if n_layers % chunks:
        raise UsageError(
            f"--n-layers {n_layers} does not split into pp {stages} x pp-virtual "
            f"{pipe.virtual} = {chunks} equal chunks; use a multiple of {chunks} layers"
        )
    ways = layout.data_parallel * accum * microbatches
    if batch % ways:
        raise UsageError(
            f"--batch {batch} is not divisible by data-parallel size {layout.data_parallel} x "
            f"accum {accum} x microbatches {microbatches} = {ways}; use a multiple of {ways}"
        )


def check_composition(executor: str, policy: Any, pipe: Pipeline) -> None:
    """UsageError for what a pipeline does not compose with: the interleaved schedule under
    the explicit executor (moving chunks to their stages is a resharding the explicit step
    does not write by hand), and fp16 loss scaling (the schedule's backward runs inside the
    loss's custom_vjp, before the scale could apply, so it would have no underflow
    protection)."""
    if executor == "explicit" and pipe.virtual > 1:
        raise UsageError(
            f"--collectives explicit runs --pp-schedule gpipe and 1f1b, not interleaved "
            f"(--pp-virtual {pipe.virtual}); use --collectives auto for interleaved"
        )
    if policy.loss_scaling:
        raise UsageError(
            f"--precision {policy.name} needs loss scaling, which pipelines (pp > 1) do not "
            f"apply inside their schedule; use --precision bf16 or fp32"
        )


def _is_stacked(names: tuple) -> bool:
    return bool(names) and names[0] == "layers"


def manual_batch_axes(mesh: Any, zero_stage: int) -> tuple[str, ...]:
    """The token axes the auto executor's pipeline shard_map makes manual besides `pipeline`:
    those over which the gradient is one all-reduce per step. Left to the partitioner, a
    gradient accumulator that is replicated over a batch axis is all-reduced after every
    micro-batch's backward slot (measured: 8.6x the gradient bytes at dp=4,pp=2, M=4). `data`
    always replicates params and gradients; `fsdp` does too under ZeRO-1. Under ZeRO-2/3 the
    fsdp axis stays with the partitioner: their accumulators are sharded over it, so each
    micro-batch's gradient is reduce-scattered, as with --accum (no whole gradient is held).
    `context` (which splits the length, not the rows) replicates params too, and must be
    manual anyway: the ring's ppermutes cannot sit in a shard_map nested in this one."""
    axes = ["data"] + (["fsdp"] if zero_stage == 1 else []) + ["context"]
    return tuple(a for a in axes if mesh.shape[a] > 1)


def pipelined_loss(graphdef: Any, names: Any, layout: Any, pipe: Pipeline) -> Callable:
    """`loss(params, batch)` (pure-dict params, batch of [batch, length] `inputs`/`targets` and
    optionally `segments`/`weights`, which travel with their micro-batches) whose value and
    gradients are computed by the pipeline schedule over `layout.mesh`."""
    mesh = layout.mesh
    stages = mesh.shape[AXIS]
    virtual, chunks = pipe.virtual, mesh.shape[AXIS] * pipe.virtual
    microbatches = pipe.resolved_microbatches(stages)
    train_table, eval_table = table(pipe, stages), table(pipe, stages, backward=False)
    batch_axes = manual_batch_axes(mesh, layout.zero_stage)
    flags = jax.tree.leaves(
        jax.tree.map(_is_stacked, names, is_leaf=lambda x: isinstance(x, tuple))
    )
    name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    stacked_names = [n for n, f in zip(name_leaves, flags, strict=True) if f]
    outer_names = [n for n, f in zip(name_leaves, flags, strict=True) if not f]

    def split_params(params: Any) -> tuple[list, list, Any]:
        leaves, treedef = jax.tree.flatten(params)
        stacked = [x for x, f in zip(leaves, flags, strict=True) if f]
        outer = [x for x, f in zip(leaves, flags, strict=True) if not f]
        return stacked, outer, treedef

    def join_params(stacked: list, outer: list, treedef: Any) -> Any:
        it_s, it_o = iter(stacked), iter(outer)
        return jax.tree.unflatten(treedef, [next(it_s) if f else next(it_o) for f in flags])

    def split_batch(x: jax.Array) -> jax.Array:
        # Micro-batch i takes every M-th row, so each device's rows stay on that device. The
        # active activation layout pins it (it leaves out the axes an accumulation vmap owns).
        x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return hooks.constrain(x, (None, "batch", "length"))

    def run(params: Any, batch: dict, sched: schedules.Table) -> tuple[jax.Array, Any]:
        stacked, outer, treedef = split_params(params)
        n_layers = stacked[0].shape[0]
        if n_layers % chunks:
            raise UsageError(f"{n_layers} layers do not split into {chunks} equal chunks")
        # [L, ...] -> [v, p, L/C, ...]: chunk k*p + s is local chunk k of stage s.
        chunked = [x.reshape(virtual, stages, n_layers // chunks, *x.shape[1:]) for x in stacked]
        step = stage_step(
            sched,
            lambda s, o: nnx.merge(graphdef, join_params(s, o, treedef)),
            pipe.logits_loss,
            stacked_names,
            outer_names,
        )
        stage_spec = PartitionSpec(None, AXIS)
        row_axes = tuple(a for a in batch_axes if a != "context")
        rows = PartitionSpec(None, row_axes or None, "context" if "context" in batch_axes else None)
        micro = {key: split_batch(x) for key, x in hooks.split_sequences(batch).items()}
        sharded = jax.shard_map(
            lambda s, o, b: step(s, o, b, layout.zero_stage, batch_axes=batch_axes),
            mesh=mesh,
            in_specs=(
                [stage_spec] * len(chunked),
                [PartitionSpec()] * len(outer),
                {key: rows for key in micro},
            ),
            out_specs=(
                PartitionSpec(),
                [stage_spec] * len(chunked),
                [PartitionSpec()] * len(outer),
            ),
            axis_names={AXIS, *batch_axes},
            check_vma=True,
        )
        loss, g_chunked, g_outer = sharded(chunked, outer, micro)
        g_stacked = [g.reshape(x.shape) for g, x in zip(g_chunked, stacked, strict=True)]
        return loss, join_params(g_stacked, g_outer, treedef)

    @jax.custom_vjp
    def loss(params: Any, batch: dict) -> jax.Array:
        return run(params, batch, eval_table)[0]

    def loss_fwd(params: Any, batch: dict) -> tuple[jax.Array, Any]:
        return run(params, batch, train_table)

    def loss_bwd(grads: Any, cotangent: jax.Array) -> tuple[Any, None]:
        return jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads), None

    loss.defvjp(loss_fwd, loss_bwd)
    return loss


def manual_pipelined_loss(graphdef: Any, names: Any, pipe: Pipeline, stages: int) -> Callable:
    """`loss(params, batch)` on one device's local blocks inside a shard_map that is manual
    over every mesh axis (the explicit executor): the schedule runs as in `pipelined_loss`,
    its value is the mean loss of the local rows, and its gradients are this device's
    (summed over stages for the params every stage holds; not yet reduced over the batch
    axes, which the executor does). gpipe and 1f1b only (one chunk per stage)."""
    microbatches = pipe.resolved_microbatches(stages)
    train_table, eval_table = table(pipe, stages), table(pipe, stages, backward=False)
    name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    flags = [_is_stacked(n) for n in name_leaves]
    stacked_names = [n for n, f in zip(name_leaves, flags, strict=True) if f]
    outer_names = [n for n, f in zip(name_leaves, flags, strict=True) if not f]

    def run(params: Any, batch: dict, sched: schedules.Table) -> tuple[jax.Array, Any]:
        leaves, treedef = jax.tree.flatten(params)
        stacked = [x for x, f in zip(leaves, flags, strict=True) if f]
        outer = [x for x, f in zip(leaves, flags, strict=True) if not f]

        def join(s: list, o: list) -> Any:
            it_s, it_o = iter(s), iter(o)
            return jax.tree.unflatten(treedef, [next(it_s) if f else next(it_o) for f in flags])

        def split(x: jax.Array) -> jax.Array:  # micro-batch i: every M-th local row
            return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)

        step = stage_step(
            sched,
            lambda s, o: nnx.merge(graphdef, join(s, o)),
            pipe.logits_loss,
            stacked_names,
            outer_names,
        )
        chunked = [x[None, None] for x in stacked]  # [v=1, 1 stage, local layers, ...]
        micro = {key: split(x) for key, x in hooks.split_sequences(batch).items()}
        loss, g_chunked, g_outer = step(chunked, outer, micro, 0, manual=True)
        g_stacked = [g.reshape(x.shape) for g, x in zip(g_chunked, stacked, strict=True)]
        return loss, join(g_stacked, g_outer)

    @jax.custom_vjp
    def loss(params: Any, batch: dict) -> jax.Array:
        return run(params, batch, eval_table)[0]

    def loss_fwd(params: Any, batch: dict) -> tuple[jax.Array, Any]:
        return run(params, batch, train_table)

    def loss_bwd(grads: Any, cotangent: jax.Array) -> tuple[Any, None]:
        return jax.tree.map(lambda g: (g * cotangent).astype(g.dtype), grads), None

    loss.defvjp(loss_fwd, loss_bwd)
    return loss


def report(pipe: Pipeline, stages: int) -> dict:
    """The schedule's figures for the dry run and the metrics: bubble (theory) and idle share
    of the tick table actually run, ticks and stash slots per stage."""
    return table(pipe, stages).summary()
