"""Ulysses attention over the `context` mesh axis (DeepSpeed-Ulysses, Jacobs et al. 2023).

Context parallelism keeps every activation split along length over the cp devices, each
holding its two chunks of the load-balanced order (spmd.parallel.ring_attention's
`balanced_order`). Where the ring passes keys and values round the devices, Ulysses turns the
split around for attention: one all-to-all each makes q, k and v [b, L/cp, heads, d]
(length-split) into [b, L, heads/cp, d] (head-split), the one-device kernel runs on whole
sequences for this device's heads, and one more all-to-all brings its output back to
length-split. Whatever the kernel computes (document masks, static or per-layer windows,
soft-capping, a query scale) Ulysses computes too.

The gathered length arrives in the balanced order (device 0's block first); a static
permutation puts it in natural order for the causal kernel and its inverse puts the output
back. The document ids are gathered whole (all_gather: 4 bytes per token, once per layer).

Grouped-query attention: the kv heads are split over cp as the query heads are. With fewer kv
heads than cp, each is repeated cp / kv_heads times first (cp a multiple of kv_heads), so that
query head h still reads kv head h // (heads / kv_heads); `check` says which counts cannot.

Traffic per layer forward, each all-to-all moving (cp−1)/cp of its local tensor: q, k, v and
the output, against the ring's cp−1 passes of k and v. Everything here runs inside a
`shard_map` manual over the axis.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd.parallel.ring_attention import balanced_order


def check(heads: int, kv_heads: int, ways: int) -> str | None:
    """Why Ulysses over `ways` devices cannot split `heads` query heads and `kv_heads` kv
    heads (as each device holds them: under tensor parallelism its share), None when it can."""
    if heads % ways:
        return f"the {heads} query heads do not divide by cp={ways}"
    if kv_heads % ways and ways % kv_heads:
        return (
            f"the {kv_heads} kv heads neither divide by cp={ways} nor divide it "
            f"(to be repeated cp / kv_heads times)"
        )
    return None


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    local: Callable[..., jax.Array],
    axis: str,
    ways: int,
    segments: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of this device's chunks q [b, n, heads, d], k and v [b, n, kv_heads,
    d] (n = L / ways, in the balanced order) by the one-device kernel `local(q, k, v)` (with
    `segments=` the whole sequences' document ids [b, L] in natural order when `segments`,
    this device's ids [b, n], is given, and with `sinks=` its heads' share of `sinks` [heads],
    attention sinks, where given) run on whole sequences of heads / ways heads. Returns
    [b, n, heads, d_v]. Call inside a shard_map manual over `axis`."""
    why = check(q.shape[2], k.shape[2], ways)
    if why is not None:
        raise ValueError(f"Ulysses attention over {axis}: {why}")
    if k.shape[2] % ways:  # fewer kv heads than ways: repeat each to ways of them
        k, v = (jnp.repeat(x, ways // x.shape[2], axis=2) for x in (k, v))
    order = balanced_order(q.shape[1] * ways, ways)
    natural, balanced = jnp.asarray(np.argsort(order)), jnp.asarray(order)

    def whole(x: jax.Array) -> jax.Array:  # [b, n, h, d] -> [b, L, h / ways, d], natural order
        x = lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
        return jnp.take(x, natural, axis=1)

    ids = {}
    if segments is not None:
        gathered = lax.all_gather(segments, axis, axis=1, tiled=True)
        ids["segments"] = jnp.take(gathered, natural, axis=1)
    if sinks is not None:  # device r receives the r-th block of the heads (split_axis=2)
        share = q.shape[2] // ways
        ids["sinks"] = lax.dynamic_slice_in_dim(sinks, lax.axis_index(axis) * share, share)
    out = local(whole(q), whole(k), whole(v), **ids)
    out = jnp.take(out, balanced, axis=1)
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
