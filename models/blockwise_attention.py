"""Blockwise (flash) causal attention written in JAX: the portable kernel, on every platform.

The queries are cut into blocks of BLOCK_Q positions and the keys into blocks of BLOCK_K
(each clipped to the length; a length that is not a multiple is padded at the end, where
causality hides the padding from every real query). Each query block keeps an online softmax
(running max, running sum and running output) over the key blocks it can see, so the largest
score tensor is one block's [batch, heads, BLOCK_Q, BLOCK_K]: memory linear in length.

Skipping, two ways:
- by range: a query block's loop runs only over the key blocks that causality and the window
  leave visible (a `fori_loop` with bounds computed from the block index and the window,
  which may be traced: Gemma's per-layer window inside the layer scan);
- at run time: a block whose mask (causal, window and documents) is false everywhere in the
  batch is skipped by `lax.cond`, so documents skip the blocks between them wherever the
  segment ids show no shared document.

The backward pass (a `jax.custom_vjp`) recomputes each block's probabilities from q, k and
the log-sum-exp per row kept by the forward pass; it keeps only the output and that
log-sum-exp (FlashAttention-2's backward: one loop over key blocks, each over the query
blocks that see it, accumulating dq in place).

Attention sinks (GPT-OSS): a learned logit per query head that joins every row's softmax
denominator and carries no value, so a row may put weight on "nothing". The online softmax
starts each row from it (running max the sink, running sum 1, output 0), and the backward
pass gives its gradient from the kept log-sum-exp alone: d sink_h = -sum over rows of
exp(sink_h - lse) * D, D = sum_d dO * O (the sink's probability times the row's correction).

Shapes: q [batch, length, heads, d_qk], k [batch, length, kv_heads, d_qk], v [batch, length,
kv_heads, d_v] -> [batch, length, heads, d_v] (d_v may differ from d_qk: MLA's 192 / 128);
query head h reads kv head h // (heads / kv_heads). Scores and softmax in fp32, matmul inputs
in q's dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from spmd.model_shape import ATTENTION_BLOCK
from spmd.parallel.hooks import vary_like

# Query and key block sizes (positions), each clipped to the length: the planner's
# ATTENTION_BLOCK (spmd.model_shape says why 512)
BLOCK_Q = BLOCK_K = ATTENTION_BLOCK


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention of q over k, v (the module docstring's shapes), within
    documents where `segments` [batch, length] (document ids) is given, within a sliding
    window of `window` positions when it is > 0 (an int, or a traced int32 scalar; query i
    sees keys j with i - window < j <= i), logits scaled by `scale` (None: d_qk ** -0.5) and
    soft-capped to softcap * tanh(logits / softcap) when `softcap` > 0, and with `sinks`
    [heads] (one logit per query head, any float dtype; None: none) in every row's softmax
    denominator (the module docstring)."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    bq, bk = min(block_q, t), min(block_k, t)
    padded = -(-t // math.lcm(bq, bk)) * math.lcm(bq, bk)
    if padded != t:  # padding at the end: no real query sees it (causal)
        pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        if segments is not None:
            segments = jnp.pad(segments, [(0, 0), (0, padded - t)], mode="edge")
    # head-major: each kv head's g query heads side by side, as grouped_causal_attention does
    rows = q.reshape(b, padded, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    band = jnp.asarray(window, jnp.int32)
    factor = d**-0.5 if scale is None else scale
    # sinks head-major as the rows are: [kv_heads, g], fp32 as the scores
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(kv_heads, h // kv_heads)
    out = _attend(rows, keys, values, segments, band, sink, factor, float(softcap), bq, bk)

    out = out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, v.shape[-1])
    return out[:, :t]


def _mask(segments: jax.Array | None, window: jax.Array, i, bq: int, j, bk: int) -> jax.Array:
    """bool [batch or 1, bq, bk]: which keys of key block j query block i sees."""
    queries = i * bq + jnp.arange(bq)[:, None]
    keys = j * bk + jnp.arange(bk)[None, :]
    seen = (keys <= queries) & ((window <= 0) | (keys > queries - window))
    if segments is None:
        return seen[None]
    mine = lax.dynamic_slice_in_dim(segments, i * bq, bq, axis=1)
    theirs = lax.dynamic_slice_in_dim(segments, j * bk, bk, axis=1)
    return seen[None] & (mine[:, :, None] == theirs[:, None, :])


def _key_range(i, window: jax.Array, bq: int, bk: int, nk: int) -> tuple:
    """[first, end) of the key blocks query block i can see: up to its last query (causal),
    from its first query's window."""
    end = jnp.minimum(nk, ((i + 1) * bq - 1) // bk + 1)
    first = jnp.where(window > 0, jnp.maximum(0, (i * bq - window + 1) // bk), 0)
    return first, end


def _query_range(j, window: jax.Array, bq: int, bk: int, nq: int) -> tuple:
    """[first, end) of the query blocks that can see key block j: from its first key
    (causal), up to the last query whose window reaches its last key."""
    first = (j * bk) // bq
    end = jnp.where(window > 0, jnp.minimum(nq, ((j + 1) * bk + window - 2) // bq + 1), nq)
    return first, end


def _logits(qi: jax.Array, kj: jax.Array, scale: float, softcap: float) -> jax.Array:
    """fp32 scores [b, kv_heads, g, bq, bk] of a query block [b, kv_heads, g, bq, d] against a
    key block [b, kv_heads, bk, d]: scaled, then soft-capped."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    return softcap * jnp.tanh(s / softcap) if softcap else s


def _block(x: jax.Array, index, size: int, axis: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attend(q, k, v, segments, window, sinks, scale, softcap, bq, bk):
    """Head-major attention: q [b, kv_heads, g, t, d], k [b, kv_heads, t, d], v [b, kv_heads,
    t, d_v], sinks [kv_heads, g] fp32 or None -> [b, kv_heads, g, t, d_v] (t a multiple of bq
    and bk)."""
    return _forward(q, k, v, segments, window, sinks, scale, softcap, bq, bk)[0]


def _forward(q, k, v, segments, window, sinks, scale, softcap, bq, bk):
    """(output [b, kv_heads, g, t, d_v] in q's dtype, log-sum-exp [nq, b, kv_heads, g, bq]
    fp32 per query row, the sink's term included)."""
    b, kv_heads, g, t, _ = q.shape
    dv, nk = v.shape[-1], t // bk
    # inside the explicit executor's shard_map, loop carries started from constants must vary
    # over the mesh axes the inputs do
    inputs = [x for x in (q, k, v, segments, sinks) if x is not None]

    def query_block(i):
        qi = _block(q, i, bq, axis=3)

        def step(j, carry):
            seen = _mask(segments, window, i, bq, j, bk)[:, None, None]

            def fold(carry):
                top, total, acc = carry
                s = jnp.where(seen, _logits(qi, _block(k, j, bk, 2), scale, softcap), -jnp.inf)
                new_top = jnp.maximum(top, s.max(-1))
                safe = jnp.where(jnp.isneginf(new_top), 0.0, new_top)
                p = jnp.exp(s - safe[..., None])  # s is -inf where unseen, safe finite: 0
                decay = jnp.exp(top - safe)
                part = jnp.einsum(
                    "bkgqs,bksd->bkgqd",
                    p.astype(v.dtype),
                    _block(v, j, bk, 2),
                    preferred_element_type=jnp.float32,
                )
                return new_top, decay * total + p.sum(-1), decay[..., None] * acc + part

            return lax.cond(seen.any(), fold, lambda carry: carry, carry)

        rows = (b, kv_heads, g, bq)
        if sinks is None:  # no key seen yet: max -inf, sum 0
            top, total = jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32)
        else:  # the sink seen first: max the sink, sum exp(0), no value
            top, total = jnp.broadcast_to(sinks[..., None], rows), jnp.ones(rows, jnp.float32)
        start = (top, total, jnp.zeros((*rows, dv), jnp.float32))
        start = tuple(vary_like(x, *inputs) for x in start)
        first, end = _key_range(i, window, bq, bk, nk)
        top, total, acc = lax.fori_loop(first, end, step, start)
        empty = total == 0  # a row that sees no key (never under a causal mask): output 0
        out = acc / jnp.where(empty, 1.0, total)[..., None]
        lse = jnp.where(empty, 0.0, top + jnp.log(jnp.where(empty, 1.0, total)))
        return out.astype(q.dtype), lse

    outs, lse = lax.map(query_block, jnp.arange(t // bq))  # [nq, b, kv_heads, g, bq, ...]
    out = jnp.moveaxis(outs, 0, 3).reshape(b, kv_heads, g, t, dv)
    return out, lse


def _forward_rule(q, k, v, segments, window, sinks, scale, softcap, bq, bk):
    out, lse = _forward(q, k, v, segments, window, sinks, scale, softcap, bq, bk)
    return out, (q, k, v, segments, window, sinks, out, lse)


def _backward_rule(scale, softcap, bq, bk, kept, d_out):
    """Gradients of q, k, v and the sinks, the probabilities of each visible block recomputed
    from q, k and the kept log-sum-exp. None for the segment ids and the window (integers)."""
    q, k, v, segments, window, sinks, out, lse = kept
    b, kv_heads, g, t, d = q.shape
    nq = t // bq
    d_out = d_out.astype(q.dtype)
    inputs = [x for x in (q, k, v, segments, d_out) if x is not None]
    # D_i = sum_d dO * O: the softmax's correction per row, [nq, b, kv_heads, g, bq]
    rowdot = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
    rowdot = jnp.moveaxis(rowdot.reshape(b, kv_heads, g, nq, bq), 3, 0)

    def key_block(dq, j):
        kj, vj = _block(k, j, bk, 2), _block(v, j, bk, 2)

        def step(i, carry):
            dq, dk, dv = carry
            seen = _mask(segments, window, i, bq, j, bk)[:, None, None]

            def grads(parts):
                dk, dv = parts
                qi, doi = _block(q, i, bq, 3), _block(d_out, i, bq, 3)
                s = _logits(qi, kj, scale, softcap)
                p = jnp.where(seen, jnp.exp(s - lse[i][..., None]), 0.0)
                dv = dv + jnp.einsum(
                    "bkgqs,bkgqd->bksd", p.astype(q.dtype), doi, preferred_element_type=jnp.float32
                )
                dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
                ds = p * (dp - rowdot[i][..., None])
                if softcap:  # d(cap * tanh(x / cap)) / dx = 1 - tanh²
                    ds = ds * (1.0 - (s / softcap) ** 2)
                ds = (ds * scale).astype(q.dtype)
                dqi = jnp.einsum("bkgqs,bksd->bkgqd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum(
                    "bkgqs,bkgqd->bksd", ds, qi, preferred_element_type=jnp.float32
                )
                return dqi, dk, dv

            def skipped(parts):
                return (vary_like(jnp.zeros((b, kv_heads, g, bq, d), jnp.float32), *inputs), *parts)

            dqi, dk, dv = lax.cond(seen.any(), grads, skipped, (dk, dv))
            # dq stays outside the cond, so that a skipped block copies no whole-length buffer
            dq = lax.dynamic_update_slice_in_dim(dq, _block(dq, i, bq, 3) + dqi, i * bq, axis=3)
            return dq, dk, dv

        zeros = (
            vary_like(jnp.zeros((b, kv_heads, bk, d), jnp.float32), *inputs),
            vary_like(jnp.zeros((b, kv_heads, bk, v.shape[-1]), jnp.float32), *inputs),
        )
        first, end = _query_range(j, window, bq, bk, nq)
        dq, dk, dv = lax.fori_loop(first, end, step, (dq, *zeros))
        return dq, (dk, dv)

    dq = vary_like(jnp.zeros(q.shape, jnp.float32), *inputs)
    dq, (dks, dvs) = lax.scan(key_block, dq, jnp.arange(t // bk))
    dk = jnp.moveaxis(dks, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dvs, 0, 2).reshape(v.shape)
    d_sinks = None
    if sinks is not None:  # -sum over rows of p_sink * D; padded rows have dO = 0, so D = 0
        p_sink = jnp.exp(sinks[None, None, :, :, None] - lse)  # [nq, b, kv_heads, g, bq]
        d_sinks = -jnp.sum(p_sink * rowdot, axis=(0, 1, 4))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks


_attend.defvjp(_forward_rule, _backward_rule)
