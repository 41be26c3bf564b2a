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


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _block(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of queries q [b, t, h, d] over keys/values [b, s, kv_heads, d]
    (grouped-query): (output [b, t, h, d] fp32, log-sum-exp [b, t, h] fp32). `causal` masks
    key j > query j (q and k then cover the same positions, t == s). The backward pass
    recomputes the block's probabilities from q and k, as the one-device kernel does
    (models.attention.recomputed_attention), instead of keeping them."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    groups = q.reshape(b, t, kv_heads, h // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", groups, k, preferred_element_type=jnp.float32)
    logits = logits * d**-0.5
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, k.shape[1]), bool)), logits, EMPTY)
    lse = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _combine(acc: tuple, new: tuple) -> tuple[jax.Array, jax.Array]:
    """Merge two partial softmax results (out, lse) over disjoint key sets."""
    (out, lse), (out_new, lse_new) = acc, new
    total = jnp.logaddexp(lse, lse_new)
    scale, scale_new = jnp.exp(lse - total)[..., None], jnp.exp(lse_new - total)[..., None]
    return out * scale + out_new * scale_new, total


def _visiting_block(q: jax.Array, k: jax.Array, v: jax.Array, earlier: jax.Array) -> tuple:
    """(out, lse) of both local query chunks against a visiting device's key/value chunks:
    from an earlier device (`earlier`) every query sees the first visiting chunk; from a later
    one only the second query chunk sees both. Either way two c x c blocks, (q_a, k_0) and
    (q_1, k_a) with a = 0 from an earlier device and 1 from a later one, computed with the
    same shapes on every device and merged into the rows they belong to (a lax.cond between
    the two cases would make autodiff keep both cases' probabilities: measured, 1/cp of the
    one-device attention memory instead of (cp + 1)/(2 cp²)). Rows that see nothing get
    (0, EMPTY)."""
    c = q.shape[1] // 2
    start = jnp.where(earlier, 0, c)
    q_a = lax.dynamic_slice_in_dim(q, start, c, axis=1)
    k_a, v_a = (lax.dynamic_slice_in_dim(x, start, c, axis=1) for x in (k, v))
    first = _block(q_a, k[:, :c], v[:, :c], False)
    second = _block(q[:, c:], k_a, v_a, False)
    empty = (jnp.zeros_like(first[0]), jnp.full_like(first[1], EMPTY))
    to_first = jax.tree.map(lambda a, b: jnp.where(earlier, a, b), first, empty)
    to_second = _combine(jax.tree.map(lambda a, b: jnp.where(earlier, a, b), empty, first), second)
    return tuple(jnp.concatenate(pair, axis=1) for pair in zip(to_first, to_second, strict=True))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, ways: int) -> jax.Array:
    """Causal attention of this device's queries q [b, 2c, h, d] over the whole sequence whose
    keys and values [b, 2c, kv_heads, d] are spread over the `ways` devices of mesh axis
    `axis`, every device holding its two chunks in the order of `balanced_order`. Returns the
    output [b, 2c, h, d] in q's dtype. Call inside a shard_map manual over `axis`."""
    rank = lax.axis_index(axis)
    # Own chunks: chunk i precedes chunk 2cp-1-i, so the lower triangle over their
    # concatenation is exactly the global causal mask between them.
    acc = _block(q, k, v, True)
    shift = [(j, (j + 1) % ways) for j in range(ways)]
    for step in range(1, ways):
        k, v = lax.ppermute((k, v), axis, shift)
        # after `step` shifts the keys come from device rank - step, earlier iff rank >= step
        acc = _combine(acc, _visiting_block(q, k, v, rank >= step))
    return acc[0].astype(q.dtype)
