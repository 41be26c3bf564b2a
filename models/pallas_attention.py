"""Causal attention within documents on a GPU: jax's Pallas (Triton) flash attention
(jax.experimental.pallas.ops.gpu.attention.mha), which takes document ids as segment ids.

cuDNN's kernel, the one `models.attention.causal_attention` prefers, is reached through
jax.nn.dot_product_attention, which takes sequence lengths but no document ids; this kernel
runs the packed case instead: a fused forward pass (online softmax over key blocks, the causal
and document masks applied per block) and its own fused backward pass, with memory linear in
length. It has no grouped-query form, so the kv heads are repeated to the query heads (the
keys and values grow by heads / kv_heads, still linear in length), and no soft-cap, window,
sinks or v head dim unlike q's: those stay with the blockwise kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as triton_attention

from spmd.parallel.hooks import per_shard

# query / key block rows of the forward kernel and of both backward kernels: jax's defaults
BLOCKS = triton_attention.BlockSizes.get_default()


def takes(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether the kernel computes attention of these shapes: one head dim for q, k and v, and
    a length that its blocks divide."""
    length, head_dim = q.shape[1], q.shape[3]
    blocks = (BLOCKS.block_q, BLOCKS.block_k, BLOCKS.block_q_dkv, BLOCKS.block_kv_dq)
    whole_blocks = all(length % min(b, length) == 0 for b in blocks if b)
    return whole_blocks and k.shape[3] == v.shape[3] == head_dim and k.shape[1] == length


def document_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array,
    scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention within documents: q [batch, length, heads, head_dim], k and v [batch,
    length, kv_heads, head_dim], `segments` [batch, length] int document ids -> [batch,
    length, heads, head_dim] in q's dtype. `interpret`: run the kernel in Pallas' interpreter
    (any platform; the tests' CPU). Under the auto executor it runs per shard of the batch
    and heads (hooks.per_shard): XLA cannot partition the kernel itself."""
    heads, kv_heads = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
    return per_shard(
        lambda q, k, v, segments: _attention(q, k, v, segments, scale, interpret),
        q,
        k,
        v,
        segments,
        names=(heads, kv_heads, kv_heads, ("batch", None)),
    )


def _attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array,
    scale: float | None,
    interpret: bool,
) -> jax.Array:
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # query head i reads kv head i // groups, as grouped-query attention does
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    sm_scale = q.shape[-1] ** -0.5 if scale is None else scale
    return triton_attention.mha(
        q,
        k,
        v,
        segments.astype(jnp.int32),
        sm_scale=sm_scale,
        causal=True,
        block_sizes=BLOCKS,
        interpret=interpret,
    )
