"""The context-parallel hooks (spmd.parallel.hooks re-exports them; models import only hooks).

Under context parallelism (`cp=` mesh axis) every activation's `length` is split over the
`context` axis, each sequence in the ring's load-balanced order
(spmd.parallel.ring_attention.balanced_order):

    split_sequences(batch)    a batch of whole sequences put in that order (each device's own
                              chunks where the hooks run per device)
    attention(q, k, v, local) causal attention: `local` unless the length is split over
                              `context`, then ring attention (spmd.parallel.ring_attention)
                              or, under --cp-mode ulysses, `local` on whole sequences of a
                              share of the heads between all-to-alls (spmd.parallel.ulysses)
    document_positions(s, f)  rotary positions restarting per document, also under CP
    token_positions(x)        global positions of the tokens attention sees (SP, CP chunks)
    sequence_sum(x)           sum over the devices holding a sequence's other chunks
    context_ways()            ways each sequence is split
    length_split_by_partitioner()
                              whether XLA splits the length (auto cp): matmuls keep it apart
    sequence_axes(name)       the axes of `name` that also split the residual's length (SP)

They read the traced layout (spmd.parallel.traced_layout), which also holds `constrain` and
`note`, so nothing here imports the hooks module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from spmd.parallel import kernel_shards, ring_attention, ulysses
from spmd.parallel import traced_layout as traced


def sequence_axes(name: str) -> tuple[str, ...]:
    """The axes of `name` that also split the residual stream's length (sequence parallelism):
    there the residual [batch, length, embed] holds 1/n of the tokens, not all of them."""
    length = traced.split_axes("length")
    residual = tuple(a for a in traced.split_axes("residual_length") if a not in length)
    return tuple(a for a in traced.split_axes(name) if a in residual)


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
    sequence = () if whole else sequence_axes("heads")  # () outside the explicit executor
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
        return traced.constrain(jnp.take(x, jnp.asarray(order), axis=1), names)

    return {key: split(value) for key, value in batch.items()}


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    local: Callable[..., jax.Array],
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of q [batch, length, heads, head_dim] over k, v [batch, length,
    kv_heads, head_dim]: `local(q, k, v)` when the length is whole on each device. When it is
    split (context parallelism), by the layout's cp mode (traced_layout.context_attention):
    ring attention over the context axis, within the documents of `segments` [batch, length]
    and a sliding `window` (an int, or an int32 scalar traced in the layer scan: Gemma's), its
    scores times `scale` (None: head_dim ** -0.5) and soft-capped by `softcap` (> 0), as
    `local` computes them, with attention `sinks` [heads] (one logit per query head in every
    row's softmax denominator, GPT-OSS's; None: none) folded in once; or Ulysses
    (spmd.parallel.ulysses), which runs `local` itself on whole sequences of a share of the
    heads, passing it the whole sequences' ids as `segments=` where `segments` is given and
    its heads' share of the sinks as `sinks=` where `sinks` is (so such a `local` takes them;
    on whole sequences `local` applies its own, as it closes over them)."""
    mesh, axis, ways, manual = _context()
    if axis is None:
        return local(q, k, v)
    documents = " (document mask)" if segments is not None else ""
    if traced.context_attention_mode() == "ulysses":
        run = functools.partial(ulysses.ulysses_attention, local=local, axis=axis, ways=ways)
        out = _per_context_device(run, mesh, axis, manual, (q, k, v, segments, sinks), True)
        # the kernel `local` picked on the whole sequences, as it noted while traced
        traced.note("attention", f"ulysses over {axis} ({traced.notes().get('attention')})")
        return out
    traced.note("attention", f"ring over {axis}{documents}")
    ring = functools.partial(
        ring_attention.ring_attention,
        axis=axis,
        ways=ways,
        window=window,
        scale=scale,
        softcap=softcap,
    )
    return _per_context_device(ring, mesh, axis, manual, (q, k, v, segments, sinks))


def _per_context_device(
    run: Callable[..., jax.Array],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None,
    axis: str,
    manual: bool,
    operands: tuple[jax.Array, jax.Array, jax.Array, jax.Array | None, jax.Array | None],
    per_device: bool = False,
) -> jax.Array:
    """`run(q, k, v, segments=..., sinks=...)` of `operands` (q, k, v, segments or None, sinks
    [heads] or None) on each device's chunks: directly where the hooks already
    run per device (`manual`), else (the auto executor) in a shard_map manual over the context
    axis only, XLA partitioning the rest; `per_device`: manual also over the axes that split
    the batch and heads (kernel_shards.kernel_specs), `run` seeing no activation layout, so
    that a kernel it runs (Ulysses' one-device kernel, a Pallas call among them, which
    kernel_shards.per_shard cannot map again inside this shard_map) runs on its shard."""
    q, k, v, segments, sinks = operands
    if manual:
        return run(q, k, v, segments=segments, sinks=sinks)
    args: tuple[jax.Array, ...] = (q, k, v) + (() if segments is None else (segments,))
    if per_device:
        assert mesh is not None  # the auto executor's
        _, table, _ = traced.activations() or (None, {}, None)
        heads, kv_heads = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
        names = (heads, kv_heads, kv_heads, ("batch", None))[: len(args)]
        found = kernel_shards.kernel_specs(mesh, table, [a.shape for a in args], names)
        specs = tuple(PartitionSpec(s[0], axis, *s[2:]) for s in found)
    else:
        specs = (PartitionSpec(None, axis),) * len(args)
    if sinks is not None:  # split as q's heads are (per device), else whole on every device
        args += (sinks,)
        specs += (PartitionSpec(specs[0][2]) if per_device else PartitionSpec(),)
    used = {axis} | {
        a
        for spec in specs
        for part in spec
        if part
        for a in ((part,) if isinstance(part, str) else part)
    }

    def body(q: jax.Array, k: jax.Array, v: jax.Array, *rest: jax.Array) -> jax.Array:
        ids = rest[0] if segments is not None else None
        sink = rest[-1] if sinks is not None else None
        if not per_device:
            return run(q, k, v, segments=ids, sinks=sink)
        with traced.no_activation_layout():
            return run(q, k, v, segments=ids, sinks=sink)

    # per device: unchecked, as kernel_shards.per_shard's (a Pallas call's output carries no
    # varying-axes type); nothing in it sums over devices, whose transpose check_vma guards
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=specs,
        out_specs=specs[0],
        axis_names=used,
        check_vma=not per_device,
    )
    return mapped(*args)


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
        return traced.constrain(positions, ("batch", "length"))
    local = segments.shape[1]
    return lax.dynamic_slice_in_dim(positions, lax.axis_index(axis) * local, local, axis=1)


def length_split_by_partitioner() -> bool:
    """Whether the auto executor splits the activations' `length` over devices (context
    parallelism under jit): XLA's partitioner gathers the whole sequence to merge a split
    length with the batch into one rows dim, so a matmul keeps them apart there."""
    _, axis, _, manual = _context()
    return axis is not None and not manual
