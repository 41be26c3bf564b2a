"""Pipeline parallelism over the `pipeline` mesh axis, in SPMD, driven by a static tick table.

`pipelined_loss(...)` returns a drop-in `loss(params, batch)` for spmd.step: its value is the
mean loss of the batch, and `jax.value_and_grad` of it runs a whole pipeline schedule (GPipe,
1F1B or interleaved; spmd.schedules) in one pass, because the loss is a scalar: the forward of
its `custom_vjp` already computes every gradient, the backward only scales them.

How it runs. A `jax.shard_map` is manual over `pipeline` only; `data`, `fsdp` and `tensor`
stay with the executor (auto: XLA's partitioner, exactly as outside the pipeline). Each stage
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
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from spmd import rules, schedules
from spmd.errors import UsageError
from spmd.mesh import BATCH_AXES

AXIS = "pipeline"
LogitsLoss = Callable[[jax.Array, jax.Array], jax.Array]  # (logits, targets) -> mean loss


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How to pipeline a model over the `pipeline` axis. The model must provide
    `embed_tokens(tokens)`, `apply_blocks(x)` (runs whatever layers its stack holds) and
    `head_logits(x)`; its stacked params are those whose first logical axis is `layers`."""

    schedule: str  # one of schedules.SCHEDULES
    microbatches: int  # per pipeline pass (per accumulation micro-step); 0: 2 x stages
    virtual: int  # chunks per stage (interleaved)
    logits_loss: LogitsLoss  # mean loss of one micro-batch's logits and targets

    def resolved_microbatches(self, stages: int) -> int:
        """M: as given, or 2 x stages for 0 (bubble (p-1)/(3p-1), about a third)."""
        return self.microbatches or 2 * stages


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


def _is_stacked(names: tuple) -> bool:
    return bool(names) and names[0] == "layers"


def pipelined_loss(graphdef: Any, names: Any, layout: Any, pipe: Pipeline) -> Callable:
    """`loss(params, batch)` (pure-dict params, batch of [batch, length] `inputs`/`targets`)
    whose value and gradients are computed by the pipeline schedule over `layout.mesh`."""
    mesh = layout.mesh
    stages = mesh.shape[AXIS]
    virtual, chunks = pipe.virtual, mesh.shape[AXIS] * pipe.virtual
    microbatches = pipe.resolved_microbatches(stages)
    train_table, eval_table = table(pipe, stages), table(pipe, stages, backward=False)
    flags = jax.tree.leaves(
        jax.tree.map(_is_stacked, names, is_leaf=lambda x: isinstance(x, tuple))
    )
    name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    stacked_names = [n for n, f in zip(name_leaves, flags, strict=True) if f]
    outer_names = [n for n, f in zip(name_leaves, flags, strict=True) if not f]
    batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1) or None
    micro_sh = NamedSharding(mesh, PartitionSpec(None, batch_axes))

    def split_params(params: Any) -> tuple[list, list, Any]:
        leaves, treedef = jax.tree.flatten(params)
        stacked = [x for x, f in zip(leaves, flags, strict=True) if f]
        outer = [x for x, f in zip(leaves, flags, strict=True) if not f]
        return stacked, outer, treedef

    def join_params(stacked: list, outer: list, treedef: Any) -> Any:
        it_s, it_o = iter(stacked), iter(outer)
        return jax.tree.unflatten(treedef, [next(it_s) if f else next(it_o) for f in flags])

    def split_batch(x: jax.Array) -> jax.Array:
        # Micro-batch i takes every M-th row, so each device's rows stay on that device.
        x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sh)

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
        sharded = jax.shard_map(
            lambda s, o, i, t: step(s, o, i, t, layout.zero_stage),
            mesh=mesh,
            in_specs=(
                [stage_spec] * len(chunked),
                [PartitionSpec()] * len(outer),
                PartitionSpec(),
                PartitionSpec(),
            ),
            out_specs=(
                PartitionSpec(),
                [stage_spec] * len(chunked),
                [PartitionSpec()] * len(outer),
            ),
            axis_names={AXIS},
            check_vma=True,
        )
        loss, g_chunked, g_outer = sharded(
            chunked, outer, split_batch(batch["inputs"]), split_batch(batch["targets"])
        )
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


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    return frozenset(aval.manual_axis_type.varying)  # jax 0.10's spelling


def _vary(x: jax.Array) -> jax.Array:
    """`x` cast to varying over `pipeline` (each stage's copy is its own from here on)."""
    return x if AXIS in _varying_axes(x) else jax.lax.pcast(x, AXIS, to="varying")


def _write(buffer: jax.Array, slot: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """buffer[slot] = value if `when`, else unchanged (slot -1 means nothing to write)."""
    slot = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(when, value, old), slot, 0)


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


def stage_step(
    sched: schedules.Table,
    merge: Callable,
    logits_loss: LogitsLoss,
    stacked_names: list[tuple],
    outer_names: list[tuple],
) -> Callable:
    """The per-stage program of a schedule, to run where `pipeline` is a manual axis:
    (chunked [v, 1, L/C, ...] stacked params, outer params, inputs [M, b, T], targets [M, b, T],
    zero stage) -> (mean loss, chunked grads, outer grads), the loss and outer grads summed over
    the stages. `merge(stacked, outer)` builds the model from lists of param leaves; the names
    are the logical axes of those leaves (for the shardings of their gradients)."""
    stages, virtual = sched.stages, sched.virtual
    col = schedules.COLUMN
    ring = virtual > 1  # only interleaved chunks pass from the last stage back to the first
    fwd_perm = [(s, (s + 1) % stages) for s in range(stages if ring else stages - 1)]
    bwd_perm = [((s + 1) % stages, s) for s in range(stages if ring else stages - 1)]
    inv_microbatches = 1.0 / sched.microbatches

    def step(chunked: list, outer: list, inputs: jax.Array, targets: jax.Array, zero: int):
        # Inside the shard_map `pipeline` is manual: shardings must name the context's mesh
        # (whose `pipeline` axis is Manual), not the concrete one.
        mesh = jax.sharding.get_abstract_mesh()
        grad_rules = rules.rules_for(zero, "grads")

        def pin_grads(grads: list, names: list[tuple]) -> list:
            # Accumulators keep the layout's gradient sharding (e.g. ZeRO-2/3 over fsdp), and
            # both branches of a cond must agree on it.
            return [
                jax.lax.with_sharding_constraint(
                    g, NamedSharding(mesh, rules.partition_spec(n, g.shape, grad_rules, mesh))
                )
                for g, n in zip(grads, names, strict=True)
            ]

        chunk_names = [(None, None, *n[1:]) for n in stacked_names]  # [v, L/C, ...] locally
        with rules.activation_layout(mesh, zero):
            return run_stage(
                chunked,
                outer,
                inputs,
                targets,
                lambda g: pin_grads(g, chunk_names),
                lambda g: pin_grads(g, outer_names),
            )

    def run_stage(
        chunked: list,
        outer: list,
        inputs: jax.Array,
        targets: jax.Array,
        pin_chunk_grads: Callable,
        pin_outer_grads: Callable,
    ) -> tuple:
        # Params enter varying over `pipeline`: each stage differentiates its own copy, so no
        # per-tick psum appears; the one sum over stages is at the end.
        chunks = [_vary(x[:, 0]) for x in chunked]
        outer = [_vary(x) for x in outer]
        stage = jax.lax.axis_index(AXIS)
        cells = jnp.asarray(sched.cells)[:, stage]  # this stage's column: [ticks, fields]

        def pin_act(x: jax.Array) -> jax.Array:
            return rules.constrain(x, ("batch", "length", "embed"))

        def pin_buffer(x: jax.Array) -> jax.Array:
            return rules.constrain(x, (None, "batch", "length", "embed"))

        def blocks_of(k: jax.Array) -> list:
            return [jax.lax.dynamic_index_in_dim(x, k, keepdims=False) for x in chunks]

        def run_chunk(block_params: list, x: jax.Array) -> jax.Array:
            return merge(block_params, outer).apply_blocks(x)

        def embed(outer_params: list, tokens: jax.Array) -> jax.Array:
            return merge(blocks_of(0), outer_params).embed_tokens(tokens)

        def head_loss(outer_params: list, y: jax.Array, tgt: jax.Array) -> jax.Array:
            logits = merge(blocks_of(0), outer_params).head_logits(y)
            return logits_loss(logits, tgt) * inv_microbatches

        act = jax.eval_shape(embed, outer, inputs[0])
        stash = pin_buffer(_vary(jnp.zeros((sched.stash_slots, *act.shape), act.dtype)))
        inbox = pin_buffer(_vary(jnp.zeros((sched.inbox_slots, *act.shape), act.dtype)))
        g_chunks = pin_chunk_grads([_vary(jnp.zeros(x.shape, jnp.float32)) for x in chunks])
        g_outer = pin_outer_grads([_vary(jnp.zeros(x.shape, jnp.float32)) for x in outer])
        carry = (stash, inbox, g_chunks, g_outer, _vary(jnp.zeros((), jnp.float32)))

        def forward_slot(carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
            """Run local chunk f_chunk on micro-batch f_mb (and the head after the last)."""
            stash, inbox, g_chunks, g_outer, loss = carry
            m, first = row[col["f_mb"]], row[col["f_first"]] == 1
            x = jax.lax.cond(
                first,
                lambda: pin_act(embed(outer, inputs[m])),
                lambda: pin_act(_read(stash, row[col["f_slot"]])),
            )
            if sched.backward:  # the first chunk's input (the embedding) is kept for its vjp
                stash = pin_buffer(_write(stash, row[col["f_slot"]], x, first))
            y = pin_act(run_chunk(blocks_of(row[col["f_chunk"]]), x))

            def head(operands: tuple) -> tuple:
                inbox, g_outer, loss = operands
                if not sched.backward:
                    return inbox, g_outer, loss + head_loss(outer, y, targets[m])
                value, (g_head, dy) = jax.value_and_grad(head_loss, argnums=(0, 1))(
                    outer, y, targets[m]
                )
                inbox = pin_buffer(_write(inbox, row[col["head_slot"]], dy, True))
                g_outer = [a + g.astype(jnp.float32) for a, g in zip(g_outer, g_head, strict=True)]
                return inbox, pin_outer_grads(g_outer), loss + value

            inbox, g_outer, loss = jax.lax.cond(
                row[col["f_last"]] == 1, head, lambda operands: operands, (inbox, g_outer, loss)
            )
            return (stash, inbox, g_chunks, g_outer, loss), y

        def backward_slot(carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
            """vjp of local chunk b_chunk on micro-batch b_mb: its input is recomputed from the
            stash, its output gradient read from the inbox; returns the input gradient."""
            stash, inbox, g_chunks, g_outer, loss = carry
            k = row[col["b_chunk"]]
            x = pin_act(_read(stash, row[col["b_slot"]]))
            dy = pin_act(_read(inbox, row[col["b_inbox"]]))
            _, chunk_vjp = jax.vjp(run_chunk, blocks_of(k), x)
            g_blocks, dx = chunk_vjp(dy)
            g_chunks = pin_chunk_grads(
                [
                    _write(acc, k, _read(acc, k) + g.astype(jnp.float32), True)
                    for acc, g in zip(g_chunks, g_blocks, strict=True)
                ]
            )

            def embed_grad(g_outer: list) -> list:
                tokens = inputs[row[col["b_mb"]]]
                _, embed_vjp = jax.vjp(lambda o: embed(o, tokens), outer)
                (g_embed,) = embed_vjp(dx)
                return pin_outer_grads(
                    [a + g.astype(jnp.float32) for a, g in zip(g_outer, g_embed, strict=True)]
                )

            g_outer = jax.lax.cond(row[col["b_first"]] == 1, embed_grad, pin_outer_grads, g_outer)
            return (stash, inbox, g_chunks, g_outer, loss), pin_act(dx)

        idle = pin_act(_vary(jnp.zeros(act.shape, act.dtype)))

        def skip(carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
            return carry, idle

        def tick(carry: tuple, row: jax.Array) -> tuple[tuple, None]:
            # Each slot runs only where this stage's table entry has work: idle slots (the
            # bubble) cost no compute. The conds hold no collective over `pipeline` (their
            # predicate differs by stage); the messages go both ways every tick, after them.
            carry, y = jax.lax.cond(row[col["f_chunk"]] >= 0, forward_slot, skip, carry, row)
            if sched.backward:
                carry, dx = jax.lax.cond(row[col["b_chunk"]] >= 0, backward_slot, skip, carry, row)
            stash, inbox, g_chunks, g_outer, loss = carry
            arrived = jax.lax.ppermute(y, AXIS, fwd_perm)
            stash = _write(stash, row[col["recv_f"]], arrived, row[col["recv_f"]] >= 0)
            if sched.backward:
                arrived = jax.lax.ppermute(dx, AXIS, bwd_perm)
                inbox = _write(inbox, row[col["recv_b"]], arrived, row[col["recv_b"]] >= 0)
            return (pin_buffer(stash), pin_buffer(inbox), g_chunks, g_outer, loss), None

        carry, _ = jax.lax.scan(tick, carry, cells)
        _, _, g_chunks, g_outer, loss = carry
        loss = jax.lax.psum(loss, AXIS)
        g_outer = [
            jax.lax.psum(g, AXIS).astype(x.dtype) for g, x in zip(g_outer, outer, strict=True)
        ]
        g_chunks = [g[:, None].astype(x.dtype) for g, x in zip(g_chunks, chunked, strict=True)]
        return loss, g_chunks, g_outer

    return step


def report(pipe: Pipeline, stages: int) -> dict:
    """The schedule's figures for the dry run and the metrics: bubble (theory) and idle share
    of the tick table actually run, ticks and stash slots per stage."""
    return table(pipe, stages).summary()
