"""The hooks a model calls.

Models speak logical axis names only (`embed`, `heads`, `vocab`, ...) and import nothing of
spmd but this module. Each hook is a no-op unless the step being traced opened a layout
(spmd.parallel.traced_layout):

    constrain(x, names)       auto executor: pin an activation to the layout's sharding
    gather(param)             explicit ZeRO-3: all_gather a param's shards just before use
                              (spmd.parallel.param_gather)
    tp_enter(x, name)         Megatron's f: identity forward, psum over `tensor` in backward
    tp_reduce(x, name)        Megatron's g: psum of a row-parallel matmul's partial sums
    tp_sum / tp_max / tp_rank the vocab-parallel cross-entropy's reductions and block index
    tp_ways(name)             how many blocks `name` is split into (explicit; 1 under auto)
    vary_like(x, *others)     x typed as varying where others vary (a scan's starting carry)
    scan_layers(layer, ...)   run the stacked layers (a scan) under the layer remat policy;
                              explicit ZeRO-3 prefetches the next layer's params
                              (spmd.parallel.layer_scan)
    to_experts / from_experts an MoE layer's token dispatch and combine: all_to_all over the
                              mesh axes that split `expert` (explicit); a resharding (auto)
    experts_split()           whether the layout splits the MoE experts over devices
    sequence_parallel(name)   whether tp_enter / tp_reduce over `name` gather / scatter length
    batch_mean(x)             mean over the data-parallel shards of a per-shard mean
    token_positions(x)        global positions of the tokens attention sees (SP, CP chunks)
    attention(q, k, v, local) causal attention: `local` unless the length is split over
                              `context`, then ring attention (spmd.parallel.ring_attention)
    document_positions(s, f)  rotary positions restarting per document, also under CP
    note(what, choice)        record a choice made while tracing (which attention kernel ran)
    fp8_site(k, n)            whether a block's matmul runs in fp8 (spmd.parallel.fp8_context)
    training()                whether a train step is being traced (dropout applies; not eval)
    training_step()           that step's number (traced), for masks that change every step
    first_layer()             the global index of the first stacked layer being run (a
                              pipeline stage's chunk counts its layers from 0)
    chunk_inputs()            a pipeline chunk's micro-batch token ids (None elsewhere)
    sequence_sum(x)           sum over the devices holding a sequence's other chunks (cp)
    length_split_by_partitioner()
                              whether XLA splits the length (auto cp): matmuls keep it apart

Under sequence parallelism tp_enter / tp_reduce become an all_gather / psum_scatter of the
residual stream's length; under context parallelism the engine puts each batch in the ring's
load-balanced order with `split_sequences` (inside a pipeline stage manual over `context`,
traced_layout.manual_context, each device keeps its own chunks as under the explicit
executor).

traced_layout.activation_layout (auto: jit + XLA's partitioner) and explicit_layout
(explicit: inside `jax.shard_map`, where the hooks become the hand-written collectives of the
textbook layouts) are opened by the engine while it traces a step. Outside both, the same
model runs unchanged on one device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from spmd.parallel import fp8_context, layer_scan, param_gather, ring_attention, rules
from spmd.parallel import traced_layout as traced
from spmd.parallel.fp8_context import Site as Fp8Site
from spmd.parallel.kernel_shards import per_shard

# re-exported: models/fp8.py's type of a site; the models' road to per_shard
__all__ = ["Fp8Site", "per_shard"]

# --- hooks the model calls (no-ops without explicit_layout) ---------------------------------


def gather(variable: Any) -> jax.Array:
    """The value of a param, whole along the dims its storage shards but compute does not
    (ZeRO-3's `embed` over `fsdp`): a tiled all_gather, varying, so that its transpose is a
    reduce-scatter of the gradient. Names are read from the end: a stacked `layers` dim is
    scanned away by the time a layer uses its params."""
    value = variable[...]
    if traced.explicit() is None or traced.params_arrive_whole():
        return value
    return param_gather.gather_value(value, param_gather.logical_names(variable))


def _sequence_axes(name: str) -> tuple[str, ...]:
    """The axes of `name` that also split the residual stream's length (sequence parallelism):
    there the residual [batch, length, embed] holds 1/n of the tokens, not all of them."""
    length = traced.split_axes("length")
    residual = tuple(a for a in traced.split_axes("residual_length") if a not in length)
    return tuple(a for a in traced.split_axes(name) if a in residual)


def sequence_parallel(name: str) -> bool:
    """Whether `tp_enter` / `tp_reduce` over `name` all_gather / psum_scatter the length
    (sequence parallelism) rather than being an identity / psum."""
    return bool(_sequence_axes(name))


def tp_enter(x: jax.Array, name: str) -> jax.Array:
    """Megatron's f before column-parallel matmuls over `name` on residual activations x
    [batch, length, embed]: identity forward; in backward the partial input gradients of the
    `name` shards are summed (one psum). Under sequence parallelism it is an all_gather of
    the length (dim 1) instead, whose backward is a reduce-scatter."""
    sequence = _sequence_axes(name)
    if sequence:
        x = lax.all_gather(x, sequence, axis=1, tiled=True)
    axes = tuple(a for a in traced.split_axes(name) if a not in traced.varying_axes(x))
    return lax.pcast(x, axes, to="varying") if axes else x


def tp_sum(x: jax.Array, name: str) -> jax.Array:
    """Sum of partial results over the shards of the split dimension `name` (psum)."""
    axes = traced.split_axes(name)
    return lax.psum(x, axes) if axes else x


def tp_reduce(x: jax.Array, name: str) -> jax.Array:
    """Megatron's g after a row-parallel matmul contracting `name`, whose partial sums x are
    residual activations [batch, length, embed]: a psum; under sequence parallelism a
    psum_scatter along the length (dim 1), each device keeping its 1/n of the tokens."""
    sequence = _sequence_axes(name)
    if sequence:
        x = lax.psum_scatter(x, sequence, scatter_dimension=1, tiled=True)
    rest = tuple(a for a in traced.split_axes(name) if a not in sequence)
    return lax.psum(x, rest) if rest else x


def tp_max(x: jax.Array, name: str) -> jax.Array:
    """Max over the shards of the split dimension `name` (pmax; not differentiable)."""
    axes = traced.split_axes(name)
    return lax.pmax(x, axes) if axes else x


def vary_like(x: jax.Array, *others: jax.Array) -> jax.Array:
    """`x` marked as varying over every manual mesh axis one of `others` varies over (a scan
    carry started from constants must have the type of what its body returns); x outside
    shard_map."""
    axes = frozenset().union(*(traced.varying_axes(o) for o in others))
    axes = axes - traced.varying_axes(x)
    return lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def tp_ways(name: str) -> int:
    """Into how many blocks the explicit executor splits dimension `name` over devices (1
    elsewhere: under auto the model sees whole arrays)."""
    mesh = traced.explicit_mesh()
    return math.prod(mesh.shape[a] for a in traced.split_axes(name)) if mesh else 1


def tp_rank(name: str) -> jax.Array | int:
    """Which block of the split dimension `name` this device holds (0 when unsplit)."""
    axes = traced.split_axes(name)
    return lax.axis_index(axes) if axes else 0


def to_experts(x: jax.Array) -> jax.Array:
    """Dispatch an MoE buffer [expert, batch, capacity, embed] from the devices that hold its
    tokens to those that hold its experts. Explicit: one tiled all_to_all over the mesh axes
    that split `expert`: each device sends its rows for expert block j to device j and gets
    [expert / n, n * batch, capacity, embed]. Auto: the same move as a resharding, which the
    partitioner turns into an all-to-all."""
    if traced.explicit() is None:
        return constrain(x, ("expert", "batch", None, None))
    axes = traced.split_axes("expert")
    return lax.all_to_all(x, axes, 0, 1, tiled=True) if axes else x


def from_experts(y: jax.Array) -> jax.Array:
    """The inverse of `to_experts`: the experts' outputs back to the devices of their tokens."""
    if traced.explicit() is None:
        return constrain(y, (None, "batch", None, None))
    axes = traced.split_axes("expert")
    return lax.all_to_all(y, axes, 1, 0, tiled=True) if axes else y


def experts_split() -> bool:
    """Whether the layout being traced splits the MoE experts (logical `expert`) over devices
    (ep or fsdp > 1), so that tokens travel to them by `to_experts` / `from_experts`; False
    outside a layout (one device)."""
    if traced.explicit() is not None:
        return bool(traced.split_axes("expert"))
    if (auto := traced.activations()) is None:
        return False
    mesh, table, _ = auto
    return any(mesh.shape[a] > 1 for a in table.get("expert", ()))


def batch_mean(x: jax.Array) -> jax.Array:
    """The mean over every data-parallel shard of `x`, a mean over this shard's tokens (each
    shard holds as many). Explicit: a pmean (its result is invariant; where the per-shard loss
    adds it, the implicit cast to varying transposes to a psum, so its gradient comes out as on
    one device). Auto: `x` is already global."""
    axes = traced.split_axes("batch")
    return lax.pmean(x, axes) if axes else x


def _context() -> tuple[
    jax.sharding.Mesh | jax.sharding.AbstractMesh | None, str | None, int, bool
]:
    """(mesh, axis, ways, manual) of context parallelism in the layout being traced (axis
    None, ways 1 when none); `manual`: each device holds its own chunks where hooks run."""
    if (manual_context := traced.manual_context_axis()) is not None:
        return None, *manual_context, True
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    if (layout := traced.explicit()) is not None:
        mesh, axes = layout.mesh, traced.split_axes("length")
    elif (auto := traced.activations()) is not None:
        mesh, table, _ = auto
        axes = tuple(a for a in table.get("length", ()) if mesh.shape[a] > 1)
    else:
        return None, None, 1, False
    manual = traced.explicit() is not None
    return (mesh, axes[0], mesh.shape[axes[0]], manual) if axes else (mesh, None, 1, manual)


def sequence_sum(x: jax.Array) -> jax.Array:
    """Sum of `x` over the devices that hold the other chunks of this device's sequences
    (context parallelism where each device holds its own chunks: the explicit executor, or a
    pipeline stage manual over `context`); `x` itself where the sequences are whole or XLA
    partitions them."""
    _, axis, _, manual = _context()
    return lax.psum(x, axis) if manual and axis is not None else x


def context_ways() -> int:
    """Ways the traced layout splits each sequence (context parallelism; 1: none)."""
    return _context()[2]


def token_positions(x: jax.Array, whole: bool = False) -> jax.Array:
    """Positions in the whole sequence [batch, length] (int32) of the tokens that attention
    sees for residual activations x [batch, length, embed]: under sequence parallelism the
    residual holds 1/n of them and attention the gathered whole; under context parallelism
    a device holds two chunks of the sequence (spmd.parallel.ring_attention.balanced_order).
    `whole`: x is whole along sequence parallelism's split (a batch field, a matmul's input)."""
    mesh, axis, ways, manual = _context()
    sequence = () if whole else _sequence_axes("heads")  # () outside the explicit executor
    # no mesh: outside both executors, where `sequence` is ()
    length = x.shape[1] * (math.prod(mesh.shape[a] for a in sequence) if mesh is not None else 1)
    if axis is None:
        positions = jnp.arange(length, dtype=jnp.int32)
    elif manual:  # this device's block of the load-balanced order
        order = ring_attention.balanced_order(length * ways, ways).reshape(ways, length)
        positions = jnp.asarray(order, jnp.int32)[lax.axis_index(axis)]
    else:
        positions = jnp.asarray(ring_attention.balanced_order(length, ways), jnp.int32)
    return jnp.broadcast_to(positions, (x.shape[0], length))


def split_sequences(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch of whole sequences (leaves [batch, length, ...]) in the layout's sequence
    order: under context parallelism the tokens are put in the load-balanced order, and
    inside the explicit executor each device keeps its own two chunks. Unchanged otherwise.
    The loss, a mean over all tokens, does not depend on their order."""
    mesh, axis, ways, manual = _context()
    if axis is None:
        return batch

    def split(x: jax.Array) -> jax.Array:
        order = ring_attention.balanced_order(x.shape[1], ways)
        if manual:
            mine = jnp.asarray(order.reshape(ways, -1))[lax.axis_index(axis)]
            return jnp.take(x, mine, axis=1)
        names = ("batch", "length") + (None,) * (x.ndim - 2)
        return constrain(jnp.take(x, jnp.asarray(order), axis=1), names)

    return {key: split(value) for key, value in batch.items()}


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    local: Callable,
    segments: jax.Array | None = None,
    window: int = 0,
) -> jax.Array:
    """Causal attention of q [batch, length, heads, head_dim] over k, v [batch, length,
    kv_heads, head_dim]: `local(q, k, v)` when the length is whole on each device, ring
    attention over the context axis when it is split (context parallelism), within the
    documents of `segments` [batch, length] and a sliding `window` (static) as `local` does."""
    mesh, axis, ways, manual = _context()
    if axis is None:
        return local(q, k, v)
    note("attention", f"ring over {axis}" + (" (document mask)" if segments is not None else ""))
    ring = functools.partial(ring_attention.ring_attention, axis=axis, ways=ways, window=window)
    if manual:
        return ring(q, k, v, segments=segments)
    # auto executor: a shard_map manual over the context axis only; XLA partitions the rest
    spec = PartitionSpec(None, axis)
    specs = (spec, spec, spec) + ((spec,) if segments is not None else ())
    mapped = jax.shard_map(
        lambda q, k, v, *ids: ring(q, k, v, segments=ids[0] if ids else None),
        mesh=mesh,
        in_specs=specs,
        out_specs=spec,
        axis_names={axis},
        check_vma=True,
    )
    return mapped(q, k, v, *(() if segments is None else (segments,)))


def document_positions(segments: jax.Array, restart: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Rotary positions [batch, length] that restart at each document of `segments` (this
    device's document ids, in the layout's sequence order), `restart` computing them from
    whole sequences of ids in their natural order (models.attention.segment_positions).
    Under context parallelism the ids are in the ring's load-balanced order (and, each device
    holding its own chunks, gathered over `context` first: 4 bytes per token, once per step),
    put back in order for `restart` and the positions put in the ring's order again."""
    _, axis, ways, manual = _context()
    if axis is None:
        return restart(segments)
    whole = lax.all_gather(segments, axis, axis=1, tiled=True) if manual else segments
    order = ring_attention.balanced_order(whole.shape[1], ways)
    natural = jnp.take(whole, jnp.asarray(np.argsort(order)), axis=1)
    positions = jnp.take(restart(natural), jnp.asarray(order), axis=1)
    if not manual:
        return constrain(positions, ("batch", "length"))
    local = segments.shape[1]
    return lax.dynamic_slice_in_dim(positions, lax.axis_index(axis) * local, local, axis=1)


def scan_layers(
    layer: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    stacked: Any,
    remat: Callable | None,
    unrolled: bool = False,
) -> tuple[Any, Any]:
    """`lax.scan(layer, carry, stacked)` over a model's stacked layers: `layer(carry, state_i)
    -> (carry, y)` on the i-th slice of `stacked` (an nnx.State with a leading `layers` dim),
    rematerialised by `remat` (a jax.checkpoint policy, None: none) minus gathered params;
    `unrolled`: the loops fully unrolled (the model's scan_layers false).
    Under explicit ZeRO-3 with prefetch, each layer's params are gathered while the layer
    before it computes (spmd.parallel.layer_scan.prefetched_scan) when the layers are
    rematerialised (`remat` given: with none, the prefetching scan would keep more residuals
    per layer than XLA's scan), there are at least 2 and `layer` closes over no traced float
    (pass such values in `carry` or `stacked`). Where prefetch was asked for, `note("layer_scan",
    ...)` says whether it ran."""
    gathering = param_gather.gathering_axes()
    policy = layer_scan.remat_policy(remat, gathering)
    n_layers = jax.tree.leaves(stacked)[0].shape[0]
    layer, carry = _in_fp8_blocks(layer, n_layers, carry)
    asked = gathering and traced.tracing_explicit().prefetch
    if not (asked and remat is not None and n_layers >= 2):
        if asked and n_layers > 1:  # said only where prefetch was asked for and could run
            note("layer_scan", "prefetch off: --remat none")
        return _scan_result(layer_scan.plain_scan(layer, carry, stacked, policy, unrolled))
    if layer_scan.closes_over_a_float(layer, carry, stacked):
        note("layer_scan", "prefetch off: the layer closes over a traced float")
        return _scan_result(layer_scan.plain_scan(layer, carry, stacked, policy, unrolled))
    note("layer_scan", "prefetch")
    assert policy is not None  # made by remat_policy for the gathered axes
    is_variable = lambda x: hasattr(x, "get_metadata")  # noqa: E731
    names = [param_gather.logical_names(v) for v in jax.tree.leaves(stacked, is_leaf=is_variable)]

    def gather_layer(shards: list[jax.Array]) -> list[jax.Array]:
        # untagged: these arrive as inputs of the layer, which its remat never saves anyway
        return [
            param_gather.gather_value(s, n, tag=False) for s, n in zip(shards, names, strict=True)
        ]

    return _scan_result(
        layer_scan.prefetched_scan(
            layer, carry, stacked, policy, gather_layer, traced.params_whole, unrolled
        )
    )


def _in_fp8_blocks(layer: Callable, n_layers: int, carry: Any) -> tuple[Callable, Any]:
    """`layer` run inside fp8_context.in_block (its matmuls may be fp8), and the carry that
    goes with it: under delayed scaling the carry also holds the [layers, SITES, 3] scales and
    probe, each layer taking its row (the carry, not the stacked xs, so that ZeRO-3's
    prefetching scan, which gathers every leaf of the stacked params, leaves them alone)."""
    if fp8_context.settings() is None:
        return layer, carry
    rows = fp8_context.delayed_rows(n_layers)
    if rows is None:

        def in_block(carry: Any, state: Any) -> tuple[Any, Any]:
            with fp8_context.in_block():
                return layer(carry, state)

        return in_block, carry

    def delayed(carry: Any, state: Any) -> tuple[Any, Any]:
        inner, (i, scales, probe) = carry
        with fp8_context.in_block(scales[i], probe[i]):
            inner, y = layer(inner, state)
        return (inner, (i + 1, scales, probe)), y

    return delayed, (carry, (jnp.zeros((), jnp.int32), *rows))


def _scan_result(result: tuple[Any, Any]) -> tuple[Any, Any]:
    """The model's (carry, ys) of a scan whose carry `_in_fp8_blocks` may have extended."""
    carry, ys = result
    if fp8_context.delayed_active():
        carry = carry[0]
    return carry, ys


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Hint the partitioner that activation `x` (logical `names`) is laid out by the layout."""
    if (auto := traced.activations()) is None:
        return x
    mesh, table, _ = auto
    spec = rules.partition_spec(names, x.shape, table, mesh, f"activation {names}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def training() -> bool:
    """Whether the engine is tracing a train step (dropout applies) rather than an eval."""
    return traced.in_training()


def training_step() -> jax.Array | None:
    """The optimizer steps taken before the train step being traced (a traced int32 scalar,
    the same on every device and after a resume); None outside a train step."""
    return traced.training_step()


def first_layer() -> jax.Array | int:
    """The global index of the first of the stacked layers a model's `apply_blocks` runs:
    0, or under a pipeline the first layer of the stage's chunk (a traced int32 scalar)."""
    return traced.chunk_first_layer()


def length_split_by_partitioner() -> bool:
    """Whether the auto executor splits the activations' `length` over devices (context
    parallelism under jit): XLA's partitioner gathers the whole sequence to merge a split
    length with the batch into one rows dim, so a matmul keeps them apart there."""
    _, axis, _, manual = _context()
    return axis is not None and not manual


def chunk_inputs() -> jax.Array | None:
    """Under a pipeline, the token ids [batch, length] of the micro-batch whose activations a
    model's `apply_blocks` runs on (for per-token masks); None elsewhere (the model's loss
    sees the batch)."""
    return traced.chunk_inputs()


def fp8_site(k: int, n: int) -> Fp8Site | None:
    """The fp8 site of a block's matmul contracting `k` into `n` outputs, None where it runs
    in the compute dtype (no --precision fp8, outside the stacked blocks, below the size
    rule); see spmd.parallel.fp8_context."""
    found = fp8_context.site(k, n)
    if found is not None:
        note("fp8", found.recipe)
    return found


def fp8_vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """`x` cast to varying over the mesh axes `like` varies over and it does not (inside the
    explicit executor's shard_map; unchanged elsewhere): a cotangent must vary as its primal."""
    missing = tuple(sorted(traced.varying_axes(like) - traced.varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


_NOTES: dict[str, str] = {}


def note(what: str, choice: str) -> None:
    """Record a choice the model made while being traced (e.g. which attention kernel ran), so
    the run can report it; the latest trace wins."""
    _NOTES[what] = choice


def notes() -> dict[str, str]:
    """The choices `note` recorded so far, e.g. {"attention": "cudnn"}."""
    return dict(_NOTES)
