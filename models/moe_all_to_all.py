"""Expert parallelism for the sorted MoE dispatch: each device routes its own sequences, sorts
its (token, choice) pairs by expert, sends each pair's row to the device that holds its expert
(one all-to-all), the experts run the grouped matmul of models/moe_dispatch.py over the rows
they received, and the outputs come back by the same all-to-all, in the slots they left from.

The all-to-all is padded (XLA:CPU has no ragged all-to-all: docs/jax-facts.md): device i
sends every device j a block of `peer_block_rows` rows (spmd.model_shape.moe_peer_block_rows),
its pairs for j's experts first (sorted by expert), zero rows after them; a second all-to-all
of E int32 counts tells j how many of each block's rows are for each of its experts. The block
holds the worst case, so no pair ever drops for want of room: to one peer holding E/ways
experts a device sends at most, per sequence, min(k, E/ways) pairs of each token (a token
picks distinct experts) and, with a capacity, capacity pairs of each of the peer's experts:

    rows per peer block = sequences x min(length x min(k, E/ways), E/ways x capacity)

Dropless that is up to ways x the device's pairs over all blocks (ways x min(k, E/ways) / k
x its routed rows), where the one-hot dispatch holds E x length slots per sequence. Which
pairs drop is decided per sequence before the exchange (models.moe_dispatch.kept_pairs), as
on one device; a dropped pair is sent nowhere and adds nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models import moe_dispatch
from models.layers import swiglu
from spmd.model_shape import moe_peer_block_rows as peer_block_rows
from spmd.parallel.hooks import exchange, exchange_ways, on_expert_devices


def exchanged_swiglu(
    x: jax.Array,
    experts: jax.Array,
    kept: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *biases: jax.Array,
    capacity: int,
    act: moe_dispatch.Activation = swiglu,
) -> jax.Array:
    """x [b, t, d]; experts, kept [b, t x k] (token-major pairs) -> each pair's expert output
    [b, t x k, d] (zero for a dropped pair), the experts being split over devices. Weights,
    biases and `act` as models.moe_dispatch.grouped_swiglu's, whole (the executors hand each
    device its block)."""
    local = functools.partial(_local_exchange, capacity=capacity, act=act)
    kernel = moe_dispatch.kernel(w_gate.shape[1], w_gate.shape[2], x.dtype)
    return on_expert_devices(local, kernel, x, experts, kept, w_gate, w_up, w_down, *biases)


def _local_exchange(
    x: jax.Array,
    experts: jax.Array,
    kept: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *biases: jax.Array,
    capacity: int,
    act: moe_dispatch.Activation,
) -> jax.Array:
    """`exchanged_swiglu` on one device: its sequences, its block of the experts."""
    b, t, d = x.shape
    pairs = experts.shape[1]
    k = pairs // t
    ways, local = exchange_ways(), w_gate.shape[0]
    n, total = ways * local, b * pairs
    block = peer_block_rows(b, t, k, local, capacity)
    key = jnp.where(kept, experts, n).reshape(-1)  # dropped pairs sort last, to no device
    order = jnp.argsort(key, stable=True)
    ranked = key[order]
    counts = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)  # pairs per expert
    per_peer = counts.reshape(ways, local).sum(axis=1)
    peer_start = jnp.cumsum(per_peer) - per_peer
    # the block for peer j: its pairs in sorted order, then zero rows (pair `total`: none)
    r = jnp.arange(block)
    filled = r[None] < per_peer[:, None]  # [ways, block]
    source = jnp.minimum(peer_start[:, None] + r[None], total - 1)
    pair = jnp.where(filled, order[source], total)
    rows = jnp.concatenate([x.reshape(b * t, d), jnp.zeros((1, d), x.dtype)])[pair // k]
    received = exchange(rows)  # [ways, block, d]: block i from device i
    got = exchange(counts.reshape(ways, local))  # [ways, local]: its rows per expert
    ends = jnp.cumsum(got, axis=1)
    # each received row's expert: how many of its block's expert runs ended at or before it
    peers = jnp.arange(ways)[:, None]
    marks = jnp.zeros((ways, block), jnp.int32).at[peers, ends[:, :-1]].add(1, mode="drop")
    expert = jnp.cumsum(marks, axis=1)  # [ways, block]
    valid = r[None] < ends[:, -1:]
    out = moe_dispatch.grouped_swiglu(
        received.reshape(1, ways * block, d),
        jnp.minimum(expert, local - 1).reshape(1, -1).astype(jnp.int32),
        valid.reshape(1, -1),
        w_gate,
        w_up,
        w_down,
        *biases,
        record=False,
        act=act,
    )
    back = exchange(out.reshape(ways, block, d)).reshape(ways * block, d)
    # each sorted pair's slot: its peer's block, its rank there; dropped: the zero row
    peer = jnp.minimum(ranked // local, ways - 1)
    slot_sorted = peer * block + jnp.arange(total) - peer_start[peer]
    slot_sorted = jnp.where(ranked < n, slot_sorted, ways * block)
    slot = jnp.zeros(total, jnp.int32).at[order].set(slot_sorted.astype(jnp.int32))
    back = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])
    return back[slot].reshape(b, pairs, d)
