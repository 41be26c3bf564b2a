"""Ring attention over the `context` mesh axis: causal attention of a sequence split over devices.

Context parallelism splits every activation's `length`. Each of the cp devices holds 2 of the
sequence's 2·cp equal chunks, i and 2·cp−1−i (the load-balanced order of `balanced_order`):
with plain contiguous blocks the last device would attend to every earlier key and the first
to almost none. Attention then runs as a ring (Liu et al. 2023; Megatron-LM's and torchtitan's
context parallel): each device keeps its queries and passes its keys and values to the next
device with `ppermute`, cp−1 times, folding each visiting key/value block into its result with
an online (log-sum-exp) softmax. The gradient is jax's autodiff of that loop (the backward
pass sends the key/value gradients around the ring the other way).

Work per ring step is balanced: at step s > 0 a device whose visiting keys come from an
earlier device (j < i) attends with both its chunks to the first visiting chunk; otherwise
(j > i) with its second chunk to both; either way two c x c blocks of c = length / (2·cp)
tokens, unmasked. Only step 0 (its own chunks) needs a causal mask.

Packed documents and sliding windows only remove pairs from those blocks, so the same blocks
are computed and masked: the keys' document ids (segments, int32) travel round the ring with
the keys and values (4 bytes per token per step, against 2 x kv_heads x head_dim x the dtype's
bytes of the keys and values), and a window masks by the global positions of both sides
(`balanced_order`'s block of each device). A row that sees no key of a block, as a query
whose document starts after that block does, gets log-sum-exp EMPTY from it, so the block
weighs nothing in the row's result. A query scale and Gemma 2's soft-cap apply to each
block's scores before its masks, as the one-device kernels apply them.

Everything here runs inside a `shard_map` that is manual over the ring's axis; the arrays are
each device's local blocks [batch, 2c, heads, head_dim].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# The log-sum-exp of a row that has seen no key yet: finite, so that combining two empty rows
# gives no NaN (exp(EMPTY - EMPTY) = 1 times a zero output).
EMPTY = -1e30


def balanced_order(seq_len: int, ways: int) -> np.ndarray:
    """Positions of the tokens in the load-balanced layout: the sequence cut in 2·ways chunks,
    device i's contiguous block of seq_len / ways positions holding chunks i and
    2·ways−1−i. Shape [seq_len], a permutation of 0..seq_len−1."""
    chunks = np.arange(seq_len).reshape(2 * ways, seq_len // (2 * ways))
    return np.concatenate(
        [np.concatenate([chunks[i], chunks[2 * ways - 1 - i]]) for i in range(ways)]
    )


@functools.partial(jax.checkpoint, static_argnums=(4, 5))
def _block(
    q: jax.Array, k: jax.Array, v: jax.Array, where: tuple, causal: bool, logit: tuple
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of queries q [b, t, h, d] over keys/values [b, s, kv_heads, d_v]
    (grouped-query): (output [b, t, h, d_v] fp32, log-sum-exp [b, t, h] fp32). `logit` =
    (scale, softcap): the scores are q k^T times scale (None: d ** -0.5), then soft-capped
    to softcap * tanh(scores / softcap) before the mask when softcap > 0. `causal` masks
    key j > query j; `where` = (query segments [b, t], key segments [b, s], query positions
    [t], key positions [s], window: an int32 scalar), each None where it does not mask (see
    `_seen`). A row that sees no key gets log-sum-exp EMPTY (and a finite output, the mean
    of v, that `_combine` weighs by exp(EMPTY - lse) = 0: zeroing it too cost one more
    probabilities-sized buffer, 33.1 against 28.1 MiB of temp on tiny at cp=4, length 1,024,
    with documents). The mask is made here from those small arrays, so the checkpoint keeps
    no [t, s] mask; the backward pass recomputes the block's
    probabilities from q and k, as the one-device kernel does
    (models.attention.recomputed_attention), instead of keeping them."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    groups = q.reshape(b, t, kv_heads, h // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", groups, k, preferred_element_type=jnp.float32)
    scale, softcap = logit
    logits = logits * (d**-0.5 if scale is None else scale)
    if softcap:  # Gemma 2's, before the mask as the one-device kernels apply it
        logits = softcap * jnp.tanh(logits / softcap)
    q_segments, k_segments, q_positions, k_positions, window = where
    seen = _seen(q_segments, k_segments, q_positions, k_positions, window, causal, t, k.shape[1])
    if seen is not None:
        logits = jnp.where(seen, logits, EMPTY)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None])
    out = jnp.einsum(
        "bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, h, v.shape[-1]), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _seen(
    q_segments: jax.Array | None,
    k_segments: jax.Array | None,
    q_positions: jax.Array | None,
    k_positions: jax.Array | None,
    window: jax.Array | None,
    causal: bool,
    t: int,
    s: int,
) -> jax.Array | None:
    """bool [b or 1, 1, 1, t, s] (broadcasting over the logits' kv heads and groups): which
    keys each query sees, or None where all of them. Causal: key position <= query position
    (the lower triangle when no positions are given: the own chunks); window > 0: key
    position > query position - window; segments: the same document."""
    seen = None
    if causal and q_positions is None:
        seen = jnp.tril(jnp.ones((t, s), bool))[None]
    elif q_positions is not None and k_positions is not None:
        queries, keys = q_positions[:, None], k_positions[None, :]
        seen = (keys <= queries) if causal else jnp.ones((t, s), bool)
        if window is not None:
            seen = (seen & ((window <= 0) | (keys > queries - window)))[None]
        else:
            seen = seen[None]
    if q_segments is not None and k_segments is not None:
        same = q_segments[:, :, None] == k_segments[:, None, :]
        seen = same if seen is None else seen & same
    return None if seen is None else seen[:, None, None]


def _combine(acc: tuple, new: tuple) -> tuple[jax.Array, jax.Array]:
    """Merge two partial softmax results (out, lse) over disjoint key sets."""
    (out, lse), (out_new, lse_new) = acc, new
    total = jnp.logaddexp(lse, lse_new)
    scale, scale_new = jnp.exp(lse - total)[..., None], jnp.exp(lse_new - total)[..., None]
    return out * scale + out_new * scale_new, total


def _half(x: jax.Array | None, start: jax.Array | int, c: int, axis: int) -> jax.Array | None:
    """c entries of x from `start` along `axis` (None stays None)."""
    return None if x is None else lax.dynamic_slice_in_dim(x, start, c, axis=axis)


def _visiting_block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    earlier: jax.Array,
    mine: tuple,
    theirs: tuple,
    logit: tuple,
) -> tuple:
    """(out, lse) of both local query chunks against a visiting device's key/value chunks:
    from an earlier device (`earlier`) every query sees the first visiting chunk; from a later
    one only the second query chunk sees both. Either way two c x c blocks, (q_a, k_0) and
    (q_1, k_a) with a = 0 from an earlier device and 1 from a later one, computed with the
    same shapes on every device and merged into the rows they belong to (a lax.cond between
    the two cases would make autodiff keep both cases' probabilities: measured, 1/cp of the
    one-device attention memory instead of (cp + 1)/(2 cp²)). Rows that see nothing get
    log-sum-exp EMPTY (output 0 where a case leaves them out, finite where masked).
    `mine` / `theirs`: (segments [b, 2c], positions [2c]) of the queries / the
    visiting keys, None where they do not mask; with a `window` (None: none) the blocks are
    masked by position, with segments by document, otherwise not at all. `logit`: `_block`'s
    (scale, softcap)."""
    c = q.shape[1] // 2
    (q_seg, q_pos), (k_seg, k_pos), window = mine, theirs[:2], theirs[2]
    start = jnp.where(earlier, 0, c)
    q_a = lax.dynamic_slice_in_dim(q, start, c, axis=1)
    k_a, v_a = (lax.dynamic_slice_in_dim(x, start, c, axis=1) for x in (k, v))
    first_where = (
        *(_half(q_seg, start, c, 1), _half(k_seg, 0, c, 1)),
        *(_half(q_pos, start, c, 0), _half(k_pos, 0, c, 0), window),
    )
    second_where = (
        *(_half(q_seg, c, c, 1), _half(k_seg, start, c, 1)),
        *(_half(q_pos, c, c, 0), _half(k_pos, start, c, 0), window),
    )
    first = _block(q_a, k[:, :c], v[:, :c], first_where, False, logit)
    second = _block(q[:, c:], k_a, v_a, second_where, False, logit)
    empty = (jnp.zeros_like(first[0]), jnp.full_like(first[1], EMPTY))
    to_first = jax.tree.map(lambda a, b: jnp.where(earlier, a, b), first, empty)
    to_second = _combine(jax.tree.map(lambda a, b: jnp.where(earlier, a, b), empty, first), second)
    return tuple(jnp.concatenate(pair, axis=1) for pair in zip(to_first, to_second, strict=True))


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    axis: str,
    ways: int,
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of this device's queries q [b, 2c, h, d] over the whole sequence whose
    keys and values [b, 2c, kv_heads, d_v] are spread over the `ways` devices of mesh axis
    `axis`, every device holding its two chunks in the order of `balanced_order`. With
    `segments` [b, 2c] (this device's tokens' document ids, in the same order) a query sees
    only keys of its document: the key blocks' ids travel round the ring with them; with
    `window` > 0 (an int or an int32 scalar) only keys less than `window` positions before
    it (by global position); scores times `scale` (None: d ** -0.5) and soft-capped by
    `softcap` (> 0; Gemma 2) before the masks; `sinks` [h] (attention sinks: a logit per
    query head in every row's denominator, no value; None: none) folded in once, after the
    ring, as one more partial result of output 0 and log-sum-exp the sink. Returns the output
    [b, 2c, h, d_v] in q's dtype. Call inside a shard_map manual over `axis`."""
    logit = (scale, float(softcap))
    rank = lax.axis_index(axis)
    band = None if isinstance(window, int) and window == 0 else jnp.asarray(window, jnp.int32)
    order = jnp.asarray(balanced_order(q.shape[1] * ways, ways).reshape(ways, -1), jnp.int32)
    positions = None if band is None else order[rank]
    # Own chunks: chunk i precedes chunk 2cp-1-i, so the lower triangle over their
    # concatenation is exactly the global causal mask between them.
    acc = _block(q, k, v, (segments, segments, positions, positions, band), True, logit)
    shift = [(j, (j + 1) % ways) for j in range(ways)]
    k_seg = segments
    for step in range(1, ways):
        if segments is None:
            k, v = lax.ppermute((k, v), axis, shift)
        else:  # the key blocks' document ids go with them: 4 bytes per token and step
            k, v, k_seg = lax.ppermute((k, v, k_seg), axis, shift)
        # after `step` shifts the keys come from device rank - step, earlier iff rank >= step
        k_pos = None if band is None else order[(rank - step) % ways]
        mine, theirs = (segments, positions), (k_seg, k_pos, band)
        acc = _combine(acc, _visiting_block(q, k, v, rank >= step, mine, theirs, logit))
    if sinks is not None:  # the sink's share of each row's denominator, with no value
        sink = jnp.broadcast_to(sinks.astype(jnp.float32), acc[1].shape)
        acc = _combine(acc, (jnp.zeros_like(acc[0]), sink))
    return acc[0].astype(q.dtype)
