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
    exchange / exchange_ways / on_expert_devices / exchange_blocked
                              the sorted MoE rows' all-to-all (spmd.parallel.expert_exchange)
    sequence_parallel(name)   whether tp_enter / tp_reduce over `name` gather / scatter length
    batch_mean(x)             mean over the data-parallel shards of a per-shard mean
    token_mean(x)             mean over the shards of a per-shard mean over tokens: the
                              data-parallel ones and, under cp, the sequences' chunks
    token_positions(x)        global positions of the tokens attention sees (SP, CP chunks)
    attention(q, k, v, local) causal attention: `local` unless the length is split over
                              `context`, then ring attention (spmd.parallel.ring_attention)
                              or, under --cp-mode ulysses, `local` on whole sequences of a
                              share of the heads between all-to-alls (spmd.parallel.ulysses)
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

The context-parallel hooks (attention, split_sequences, document_positions, token_positions,
sequence_sum, context_ways, length_split_by_partitioner) live in spmd.parallel.context_hooks,
and constrain / note in spmd.parallel.traced_layout; this module re-exports them.

traced_layout.activation_layout (auto: jit + XLA's partitioner) and explicit_layout
(explicit: inside `jax.shard_map`, where the hooks become the hand-written collectives of the
textbook layouts) are opened by the engine while it traces a step. Outside both, the same
model runs unchanged on one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.parallel import expert_exchange, fp8_context, layer_scan, param_gather
from spmd.parallel import traced_layout as traced
from spmd.parallel.context_hooks import (
    attention,
    context_ways,
    document_positions,
    length_split_by_partitioner,
    sequence_axes,
    sequence_sum,
    split_sequences,
    token_positions,
)
from spmd.parallel.expert_exchange import (
    exchange,
    exchange_blocked,
    exchange_ways,
    experts_split,
    from_experts,
    to_experts,
)
from spmd.parallel.fp8_context import Site as Fp8Site
from spmd.parallel.kernel_shards import per_shard
from spmd.parallel.traced_layout import constrain, note, notes

# re-exported: models/fp8.py's type of a site, spmd.parallel.expert_exchange's hooks, the
# models' road to per_shard, the context hooks (spmd.parallel.context_hooks), and constrain
# and note, which live below every hook module (spmd.parallel.traced_layout)
__all__ = [
    "Fp8Site",
    "attention",
    "constrain",
    "context_ways",
    "document_positions",
    "exchange",
    "exchange_blocked",
    "exchange_ways",
    "experts_split",
    "from_experts",
    "length_split_by_partitioner",
    "note",
    "notes",
    "per_shard",
    "sequence_sum",
    "split_sequences",
    "to_experts",
    "token_positions",
]

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


def sequence_parallel(name: str) -> bool:
    """Whether `tp_enter` / `tp_reduce` over `name` all_gather / psum_scatter the length
    (sequence parallelism) rather than being an identity / psum."""
    return bool(sequence_axes(name))


def tp_enter(x: jax.Array, name: str) -> jax.Array:
    """Megatron's f before column-parallel matmuls over `name` on residual activations x
    [batch, length, embed]: identity forward; in backward the partial input gradients of the
    `name` shards are summed (one psum). Under sequence parallelism it is an all_gather of
    the length (dim 1) instead, whose backward is a reduce-scatter."""
    sequence = sequence_axes(name)
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
    sequence = sequence_axes(name)
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


def on_expert_devices(fn: Callable[..., jax.Array], kernel: str, *args: jax.Array) -> jax.Array:
    """fn(*args) on each device's own sequences and block of the experts
    (spmd.parallel.expert_exchange.on_expert_devices), recorded as `note("moe_dispatch",
    "sorted, padded all-to-all over <axes> (<kernel>)")`."""
    axes = ", ".join(expert_exchange.exchange_axes())
    note("moe_dispatch", f"sorted, padded all-to-all over {axes} ({kernel})")
    return expert_exchange.on_expert_devices(fn, *args)


def batch_mean(x: jax.Array) -> jax.Array:
    """The mean over every data-parallel shard of `x`, a mean over this shard's tokens (each
    shard holds as many). Explicit: a pmean (its result is invariant; where the per-shard loss
    adds it, the implicit cast to varying transposes to a psum, so its gradient comes out as on
    one device). Auto: `x` is already global."""
    axes = traced.split_axes("batch")
    return lax.pmean(x, axes) if axes else x


def token_mean(x: jax.Array) -> jax.Array:
    """The mean over every shard of the tokens of `x`, a mean over this shard's tokens (each
    holds as many): batch_mean's, and under context parallelism over the devices holding the
    sequences' other chunks too. Auto: `x` is already global."""
    axes = (*traced.split_axes("batch"), *traced.split_axes("length"))
    return lax.pmean(x, axes) if axes else x


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
