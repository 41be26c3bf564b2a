"""One pipeline stage's program: the scan over a schedule's tick table that spmd.parallel.pipeline
runs inside a shard_map manual over `pipeline` (or over every axis, for the explicit
executor). Per tick a stage runs its forward slot, then its backward slot (`jax.vjp` of its
chunk on the stashed input), each under a `lax.cond` on its own table entry, then sends one
`ppermute` forward and one backward. See spmd.parallel.pipeline for the design and its costs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from spmd.parallel import hooks, rules, schedules, traced_layout
from spmd.parallel.traced_layout import varying_axes

AXIS = "pipeline"


class LogitsLoss(Protocol):
    """(logits, targets[, loss weights]) -> mean loss (fp32): a family's `logits_loss`."""

    def __call__(
        self, logits: jax.Array, targets: jax.Array, weights: jax.Array = ..., /
    ) -> jax.Array: ...


def _vary(x: jax.Array, like: object = None) -> jax.Array:
    """`x` cast to varying over `pipeline` (each stage's copy is its own from here on) and over
    every axis `like` varies over: buffers and accumulators must have the type of what is
    written into them (under the explicit executor activations also vary over the batch axes,
    a param's gradient over its param's axes)."""
    axes = {AXIS} | (set(varying_axes(like)) if like is not None else set())
    missing = tuple(sorted(axes - set(varying_axes(x))))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _write(
    buffer: jax.Array, slot: jax.Array, value: jax.Array, when: jax.Array | bool
) -> jax.Array:
    """buffer[slot] = value if `when`, else unchanged (slot -1 means nothing to write)."""
    slot = jnp.maximum(slot, 0)
    old = jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(when, value, old), slot, 0)


def _read(buffer: jax.Array, slot: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buffer, jnp.maximum(slot, 0), keepdims=False)


@dataclasses.dataclass
class Stage:
    """What one stage's tick program reads: the schedule, this stage's params (each stage's
    own varying copy), the micro-batches and the pins that keep shardings stable. `batch`
    holds [M, b, T] arrays: "inputs", "targets" and, where the data has them, "segments"
    (document ids: every chunk's attention mask and rotary positions) and "weights" (the
    head's loss weights); they stay on every stage, indexed by the micro-batch a slot runs."""

    sched: schedules.Table
    merge: Callable  # (stacked leaves, outer leaves) -> the model
    logits_loss: LogitsLoss
    chunks: list  # [v, L/C, ...] stacked param leaves of this stage's chunks
    outer: list  # embedding / norm / head leaves
    batch: dict  # [M, b, T] per field
    pin_chunk_grads: Callable
    pin_outer_grads: Callable

    # What stages pass and stash is the residual stream (split over `tensor` too under
    # sequence parallelism).
    def pin_act(self, x: jax.Array) -> jax.Array:
        return hooks.constrain(x, ("batch", "residual_length", "embed"))

    def pin_buffer(self, x: jax.Array) -> jax.Array:
        return hooks.constrain(x, (None, "batch", "residual_length", "embed"))

    def blocks_of(self, k: jax.Array | int) -> list:  # k -1 (an idle slot run in lockstep): any
        k = jnp.maximum(k, 0)
        return [jax.lax.dynamic_index_in_dim(x, k, keepdims=False) for x in self.chunks]

    def field(self, key: str, m: jax.Array) -> jax.Array | None:
        """Micro-batch m of a batch field, None where the batch does not carry it."""
        return self.batch[key][m] if key in self.batch else None

    def run_chunk(self, k: jax.Array, x: jax.Array, m: jax.Array, blocks: list) -> jax.Array:
        """This stage's chunk k (its params `blocks`) on micro-batch m's activations x. The
        chunk is global chunk k p + s of the stack (pipeline.py's [v, p, L/C] reshape); models
        read its first layer's index and the micro-batch's tokens through hooks.first_layer
        and hooks.chunk_inputs (LoRA's dropout masks)."""
        segments = self.field("segments", m)
        model = self.merge(blocks, self.outer)
        size = self.chunks[0].shape[1]  # L/C layers
        stage = jax.lax.axis_index(AXIS)
        first = (jnp.maximum(k, 0) * self.sched.stages + stage) * size
        inputs = self.batch["inputs"][m]
        with traced_layout.pipeline_chunk(first.astype(jnp.int32), inputs):
            if segments is None:
                return model.apply_blocks(x)
            return model.apply_blocks(x, segments)

    def embed(self, outer_params: list, tokens: jax.Array) -> jax.Array:
        return self.merge(self.blocks_of(0), outer_params).embed_tokens(tokens)

    def head_loss(self, outer_params: list, y: jax.Array, m: jax.Array) -> jax.Array:
        # The weights are normalized over the whole batch (mean 1 over it), so the mean of
        # the micro-batches' weighted means is the batch's weighted mean.
        logits = self.merge(self.blocks_of(0), outer_params).head_logits(y)
        targets, weights = self.batch["targets"][m], self.field("weights", m)
        if weights is None:
            loss = self.logits_loss(logits, targets)
        else:
            loss = self.logits_loss(logits, targets, weights)
        return loss * (1.0 / self.sched.microbatches)


def forward_slot(st: Stage, carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
    """Run local chunk f_chunk on micro-batch f_mb (and the head after the last chunk)."""
    col, sched = schedules.COLUMN, st.sched
    stash, inbox, g_chunks, g_outer, loss = carry
    m, first = row[col["f_mb"]], row[col["f_first"]] == 1
    x = jax.lax.cond(
        first,
        lambda: st.pin_act(st.embed(st.outer, st.batch["inputs"][m])),
        lambda: st.pin_act(_read(stash, row[col["f_slot"]])),
    )
    if sched.backward:  # the first chunk's input (the embedding) is kept for its vjp
        stash = st.pin_buffer(_write(stash, row[col["f_slot"]], x, first))
    k = row[col["f_chunk"]]
    y = st.pin_act(st.run_chunk(k, x, m, st.blocks_of(k)))

    def head(operands: tuple) -> tuple:
        inbox, g_outer, loss = operands
        if not sched.backward:
            return inbox, g_outer, loss + st.head_loss(st.outer, y, m)
        value, (g_head, dy) = jax.value_and_grad(st.head_loss, argnums=(0, 1))(st.outer, y, m)
        inbox = st.pin_buffer(_write(inbox, row[col["head_slot"]], dy, True))
        g_outer = [a + g.astype(jnp.float32) for a, g in zip(g_outer, g_head, strict=True)]
        return inbox, st.pin_outer_grads(g_outer), loss + value

    inbox, g_outer, loss = jax.lax.cond(
        row[col["f_last"]] == 1, head, lambda operands: operands, (inbox, g_outer, loss)
    )
    return (stash, inbox, g_chunks, g_outer, loss), y


def backward_slot(st: Stage, carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
    """vjp of local chunk b_chunk on micro-batch b_mb: its input is recomputed from the
    stash, its output gradient read from the inbox; returns the input gradient."""
    col = schedules.COLUMN
    stash, inbox, g_chunks, g_outer, loss = carry
    k, m = row[col["b_chunk"]], row[col["b_mb"]]
    x = st.pin_act(_read(stash, row[col["b_slot"]]))
    dy = st.pin_act(_read(inbox, row[col["b_inbox"]]))
    _, chunk_vjp = jax.vjp(lambda p, x: st.run_chunk(k, x, m, p), st.blocks_of(k), x)
    g_blocks, dx = chunk_vjp(dy)
    g_chunks = st.pin_chunk_grads(
        [
            _write(acc, k, _read(acc, k) + g.astype(jnp.float32), k >= 0)
            for acc, g in zip(g_chunks, g_blocks, strict=True)
        ]
    )

    def embed_grad(g_outer: list) -> list:
        tokens = st.batch["inputs"][m]
        _, embed_vjp = jax.vjp(lambda o: st.embed(o, tokens), st.outer)
        (g_embed,) = embed_vjp(dx)
        return st.pin_outer_grads(
            [a + g.astype(jnp.float32) for a, g in zip(g_outer, g_embed, strict=True)]
        )

    g_outer = jax.lax.cond(row[col["b_first"]] == 1, embed_grad, st.pin_outer_grads, g_outer)
    return (stash, inbox, g_chunks, g_outer, loss), st.pin_act(dx)


def tick_fn(st: Stage, idle: jax.Array, lockstep: bool) -> Callable:
    """One tick of the scan: this stage's forward slot, its backward slot, then one ppermute
    each way. Each slot runs only where this stage's table entry has work: idle slots (the
    bubble) cost no compute. The conds hold no collective over `pipeline` (their predicate
    differs by stage); the messages go both ways every tick, after them.

    `lockstep`: the chunks hold ppermutes of their own (context parallelism's ring). JAX gives
    every collective channel id 1 and a collective-permute names no replica groups, so XLA:CPU
    pairs the k-th collective-permute of each device with the k-th of every other: one stage's
    ring sends met another stage's pipeline sends (measured at cp=2,pp=2: eval loss 9e-4 off,
    36% after 20 steps). Then a slot runs on every stage in each tick where some stage has one
    (`busy`, the same on every device; an idle stage computes on slot 0 and keeps nothing:
    the tick lasts as long anyway), so every device runs the same collectives in one order."""
    col, sched = schedules.COLUMN, st.sched
    ring = sched.virtual > 1  # only interleaved chunks pass from the last stage to the first
    senders = range(sched.stages if ring else sched.stages - 1)
    fwd_perm = [(s, (s + 1) % sched.stages) for s in senders]
    bwd_perm = [((s + 1) % sched.stages, s) for s in senders]

    def skip(carry: tuple, row: jax.Array) -> tuple[tuple, jax.Array]:
        return carry, idle

    def tick(carry: tuple, rows: tuple) -> tuple[tuple, None]:
        busy, row = rows  # busy: whether some stage has a forward / backward slot this tick
        own = (row[col["f_chunk"]] >= 0, row[col["b_chunk"]] >= 0)
        run_f, run_b = (busy[0], busy[1]) if lockstep else own
        forward = functools.partial(forward_slot, st)
        carry, y = jax.lax.cond(run_f, forward, skip, carry, row)
        if sched.backward:
            backward = functools.partial(backward_slot, st)
            carry, dx = jax.lax.cond(run_b, backward, skip, carry, row)
        stash, inbox, g_chunks, g_outer, loss = carry
        arrived = jax.lax.ppermute(y, AXIS, fwd_perm)
        stash = _write(stash, row[col["recv_f"]], arrived, row[col["recv_f"]] >= 0)
        if sched.backward:
            arrived = jax.lax.ppermute(dx, AXIS, bwd_perm)
            inbox = _write(inbox, row[col["recv_b"]], arrived, row[col["recv_b"]] >= 0)
        return (st.pin_buffer(stash), st.pin_buffer(inbox), g_chunks, g_outer, loss), None

    return tick


def run_stage(
    sched: schedules.Table,
    merge: Callable,
    logits_loss: LogitsLoss,
    chunked: list,
    outer: list,
    batch: dict,
    pin_chunk_grads: Callable,
    pin_outer_grads: Callable,
) -> tuple:
    """Scan this stage's column of the tick table: (loss and outer grads summed over stages,
    this stage's chunked grads)."""
    # Params enter varying over `pipeline` and over the manual batch axes the inputs vary
    # over: each stage and batch shard differentiates its own copy, so no per-tick psum
    # appears; the sums over stages (here) and over batch shards (the caller) are at the end.
    st = Stage(
        sched,
        merge,
        logits_loss,
        [_vary(x[:, 0], batch["inputs"]) for x in chunked],
        [_vary(x, batch["inputs"]) for x in outer],
        batch,
        pin_chunk_grads,
        pin_outer_grads,
    )
    cells = jnp.asarray(sched.cells)[:, jax.lax.axis_index(AXIS)]  # [ticks, fields]
    act = jax.eval_shape(st.embed, st.outer, batch["inputs"][0])
    stash = st.pin_buffer(_vary(jnp.zeros((sched.stash_slots, *act.shape), act.dtype), act))
    inbox = st.pin_buffer(_vary(jnp.zeros((sched.inbox_slots, *act.shape), act.dtype), act))
    g_chunks = pin_chunk_grads([_vary(jnp.zeros(x.shape, jnp.float32), x) for x in st.chunks])
    g_outer = pin_outer_grads([_vary(jnp.zeros(x.shape, jnp.float32), x) for x in st.outer])
    # the loss varies as the tokens do (not over `tensor`, as SP's activations do)
    loss = _vary(jnp.zeros((), jnp.float32), batch["inputs"])
    carry = (stash, inbox, g_chunks, g_outer, loss)
    idle = st.pin_act(_vary(jnp.zeros(act.shape, act.dtype), act))
    slots = [schedules.COLUMN["f_chunk"], schedules.COLUMN["b_chunk"]]
    busy = jnp.asarray(sched.cells[:, :, slots].max(axis=1) >= 0)  # [ticks, 2]
    tick = tick_fn(st, idle, lockstep=hooks.context_ways() > 1)
    carry, _ = jax.lax.scan(tick, carry, (busy, cells))
    _, _, g_chunks, g_outer, loss = carry
    loss = jax.lax.psum(loss, AXIS)
    g_outer = [jax.lax.psum(g, AXIS).astype(x.dtype) for g, x in zip(g_outer, outer, strict=True)]
    g_chunks = [g[:, None].astype(x.dtype) for g, x in zip(g_chunks, chunked, strict=True)]
    return loss, g_chunks, g_outer


def stage_step(
    sched: schedules.Table,
    merge: Callable,
    logits_loss: LogitsLoss,
    stacked_names: list[tuple],
    outer_names: list[tuple],
) -> Callable:
    """The per-stage program of a schedule, to run where `pipeline` is a manual axis: (chunked [v,
    1, L/C, ...] stacked params, outer params, micro-batches {field: [M, b, T]} (inputs, targets and
    optionally segments, weights), zero stage, manual) -> (mean loss, chunked grads, outer grads),
    the loss and outer grads summed over the stages. `manual`: every mesh axis is manual (the
    explicit executor's shard_map), so no sharding constraints are set. `merge(stacked, outer)`
    builds the model from lists of param leaves; the names are the logical axes of those leaves (for
    the shardings of their gradients)."""
    run = functools.partial(run_stage, sched, merge, logits_loss)

    def step(
        chunked: list,
        outer: list,
        batch: dict,
        zero: int,
        manual: bool = False,
        batch_axes: tuple[str, ...] = (),
    ):
        if manual:  # every mesh axis is manual (explicit executor): local arrays, no pins
            with traced_layout.no_activation_layout():
                return run(chunked, outer, batch, list, list)
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
        # `batch_axes` are manual too (their rows are local): one mean over them per step.
        with (
            traced_layout.activation_layout(mesh, zero, exclude=batch_axes),
            traced_layout.manual_context(mesh),
        ):
            loss, g_chunks, g_outer = run(
                chunked,
                outer,
                batch,
                lambda g: pin_grads(g, chunk_names),
                lambda g: pin_grads(g, outer_names),
            )
        if not batch_axes:
            return loss, g_chunks, g_outer
        # One all-reduce per leaf, in fp32: XLA:CPU (jaxlib 0.10.2) aborts compiling a 16-bit
        # all-reduce here ("Invalid binary instruction opcode copy" in CloneAllReduce), so under
        # --grad-reduce bf16 this mean moves 4 bytes per param, as the per-tick sums did before.
        share = 1.0 / jax.lax.psum(1, batch_axes)

        def mean(x: jax.Array) -> jax.Array:
            return (jax.lax.psum(x.astype(jnp.float32), batch_axes) * share).astype(x.dtype)

        return mean(loss), [mean(g) for g in g_chunks], [mean(g) for g in g_outer]

    return step
