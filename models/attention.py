"""Grouped-query causal self-attention, speaking logical axis names only: the layer (q, k, v
and output projections, optional q/k/v biases (Qwen2), q/k RMS norms per head (Qwen3) or over
all heads' features at once (OLMo 2), the rotary embedding of models/rope.py) and the
attention kernels (causal, optionally within documents and within a sliding window
(Mistral)).

The layer is Megatron's column-parallel q, k, v / row-parallel output projection: under tensor
parallelism each device holds its heads' slices of every projection, their biases and of
OLMo 2's norm scales, (whole) the per-head norms, and `tp_reduce` sums the heads' partial
outputs. OLMo 2's norms sum their squares over the devices that hold the heads.

A sliding window of w tokens lets query position i see key positions j with i - w < j <= i
(itself and the w - 1 before it), the band transformers' `sliding_window` masks. The kernels
take it as an int (a constant of the program: also each of Gemma's local and global layers,
models.gemma2.static_window) or as a traced int32 scalar (a window picked by a traced layer
index, as Gemma's decoder does; 0: no window).
Their other general options: `scale`, the factor of q k^T (None: q's head_dim ** -0.5;
Gemma: query_pre_attn_scalar ** -0.5), `softcap`, logit soft-capping cap * tanh(logits / cap)
of the scaled logits before the mask (0: none; Gemma 2), and `sinks` [heads], attention
sinks (GPT-OSS): one learned logit per query head in every row's softmax denominator, with
no value (None: none). v's head dim may differ from q's and k's (MLA: DeepSeek-V3's 192 for
q and k, 128 for v). cuDNN's kernel as jax reaches it computes none of a traced window,
soft-capping, sinks or unequal head dims, nor Pallas' kernel: those run the blockwise or XLA
kernel, `causal_attention` says which in its note.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from models import pallas_attention
from models.blockwise_attention import BLOCK_K, blockwise_attention
from models.layers import (
    RESIDUAL,
    WHOLE,
    HeadsRMSNorm,
    RMSNorm,
    Weight,
    dense,
    param,
    slice_out,
    weight,
    zeros,
)
from models.rope import Rope
from spmd.model_shape import query_chunks
from spmd.parallel.hooks import (
    attention,
    constrain,
    gather,
    note,
    tp_enter,
    tp_rank,
    tp_reduce,
)

if TYPE_CHECKING:
    from models.llama import LlamaConfig

CACHE_NAMES = ("batch", "length", "kv_heads", None)  # of one layer's cached keys or values


class Attention(nnx.Module):
    """The attention layer of a config with LlamaConfig's attention fields. `whole_qk_norm`:
    RMS norms of q and of k over all heads' features at once (layers.HeadsRMSNorm, OLMo 2),
    before rotary, instead of the config's per-head ones (qk_norm, Qwen3)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, whole_qk_norm: bool = False):
        e, h, k, d = cfg.embed_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if whole_qk_norm and (cfg.qk_norm or cfg.qkv_bias):
            raise ValueError("whole_qk_norm goes with neither qk_norm nor qkv_bias")
        std, out_std = 0.02, 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = param(rngs, std, (e, h, d), ("embed", "heads", "head_dim"))
        self.wk = param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wv = param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wo = param(rngs, out_std, (h, d, e), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.bq = zeros((h, d), ("heads", "head_dim"))
            self.bk = zeros((k, d), ("kv_heads", "head_dim"))
            self.bv = zeros((k, d), ("kv_heads", "head_dim"))
        self.q_norm: RMSNorm | HeadsRMSNorm  # where the config asks for q and k norms
        self.k_norm: RMSNorm | HeadsRMSNorm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps, rngs, ("head_dim",))
            self.k_norm = RMSNorm(d, cfg.norm_eps, rngs, ("head_dim",))
        if whole_qk_norm:
            self.q_norm = HeadsRMSNorm(h, d, cfg.norm_eps, rngs, "heads")
            self.k_norm = HeadsRMSNorm(k, d, cfg.norm_eps, rngs, "kv_heads")
        self.whole_qk_norm = whole_qk_norm
        self.rope = Rope.of(cfg)
        self.window = cfg.sliding_window  # 0: none
        self.group = h // k  # query heads per kv head

    def _kv_for_local_heads(self, wq: Weight, kv: tuple[Weight, ...], axis: int) -> tuple:
        """The kv heads (dim `axis` of each of `kv`) this device's query heads read. When the
        heads are split more ways than there are kv heads, the kv heads are replicated: pick
        the one this block needs."""
        local_heads, needed = wq.shape[1], max(wq.shape[1] // self.group, 1)
        if kv[0].shape[axis] == needed:
            return kv
        first = tp_rank("heads") * local_heads // self.group
        return tuple(slice_out(w, first, needed, axis) for w in kv)

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """(q [b, t, heads, d], k and v [b, t, kv_heads, d]) of x [b, t, embed] (whole along
        length): projected, biased, normed (per head, or over all heads) and rotated to
        `positions` [b, t]."""
        dtype = x.dtype
        wq = weight(self, "wq")
        if self.whole_qk_norm:
            q, k, v = self._whole_normed(x, wq)
        else:
            wk, wv = self._kv_for_local_heads(wq, (weight(self, "wk"), weight(self, "wv")), axis=1)
            q, k, v = dense(x, wq), dense(x, wk), dense(x, wv)
        if hasattr(self, "bq"):
            bk, bv = self._kv_for_local_heads(wq, (gather(self.bk), gather(self.bv)), axis=0)
            q, k, v = (y + b.astype(dtype) for y, b in ((q, gather(self.bq)), (k, bk), (v, bv)))
        if hasattr(self, "q_norm") and not self.whole_qk_norm:  # Qwen3: each head's features
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(self.rope(q, positions), ("batch", "length", "heads", None))
        k = constrain(self.rope(k, positions), ("batch", "length", "kv_heads", None))
        return q, k, constrain(v, ("batch", "length", "kv_heads", None))

    def _whole_normed(self, x: jax.Array, wq: Weight) -> tuple[jax.Array, ...]:
        """(q, k, v) of x with q and k normed over all their heads' features (OLMo 2). The k
        norm spans every kv head, so k is projected for all the kv heads this device holds and
        those its query heads read are picked after the norm (v's weights before, as
        `project` does)."""
        q = self.q_norm(dense(x, wq))
        (k,) = self._kv_for_local_heads(wq, (self.k_norm(dense(x, weight(self, "wk"))),), axis=2)
        (wv,) = self._kv_for_local_heads(wq, (weight(self, "wv"),), axis=1)
        return q, k, dense(x, wv)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
    ) -> jax.Array:
        x = constrain(tp_enter(x, "heads"), WHOLE)  # column-parallel q, k, v: local heads
        q, k, v = self.project(x, positions)

        # ring or Ulysses attention when length is split over `context`, within documents
        # and the window
        # (Ulysses runs `local` on whole sequences: it passes their ids as `segments`)
        def local(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = segments):
            return causal_attention(q, k, v, segments, self.window)

        out = attention(q, k, v, local, segments, self.window)
        out = dense(out, weight(self, "wo"), inputs=2)
        # row-parallel: sum the heads' partial outputs
        return constrain(tp_reduce(out, "heads"), RESIDUAL)

    def cached(
        self,
        x: jax.Array,
        positions: jax.Array,
        keys: jax.Array,
        values: jax.Array,
        window: int | jax.Array | None = None,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Self-attention of x [b, t, embed] over one layer's key / value cache ([b, length,
        kv_heads, head_dim]) for generation: (output, keys, values) with this call's keys and
        values written at `positions` [b, t] (models/llama_decode.py). `window`: the layer's
        (None: the config's); `sinks` [heads]: as `causal_attention`'s."""
        dtype = x.dtype
        q, k, v = self.project(x, positions)
        rows = jnp.arange(x.shape[0])[:, None]
        keys = constrain(keys.at[rows, positions].set(k.astype(keys.dtype)), CACHE_NAMES)
        values = constrain(values.at[rows, positions].set(v.astype(values.dtype)), CACHE_NAMES)
        out = grouped_causal_attention(
            q,
            keys.astype(dtype),
            values.astype(dtype),
            window=self.window if window is None else window,
            positions=positions,
            sinks=sinks,
        )
        return dense(out, weight(self, "wo"), inputs=2), keys, values


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention: q [batch, length, heads, d_qk], k [batch, length,
    kv_heads, d_qk] and v [batch, length, kv_heads, d_v] -> [batch, length, heads, d_v];
    softmax in fp32. With `segments` [batch, length] (document ids), a position attends only
    within its document; with `window` > 0 only to itself and the window - 1 positions before
    it. `scale`, `softcap` and `sinks` [heads]: the module docstring's options.

    On a GPU, cuDNN's fused flash-attention kernel (jax.nn.dot_product_attention with
    implementation="cudnn") where it takes the shapes and dtype (16-bit inputs, head_dim a
    multiple of 8 up to 128, ...; JAX checks them while tracing and says no with an exception),
    with document masks (and no window or soft-cap) jax's Pallas Triton flash attention, which
    takes document ids (models.pallas_attention); else (soft-capping, a per-layer window,
    windows within documents, other platforms and dtypes) the blockwise kernel
    (models.blockwise_attention: online softmax over key blocks, wholly masked blocks skipped,
    a custom backward pass that recomputes), whose memory is linear in length, when the length
    spans more than one key block (BLOCK_K positions); within one block, XLA's
    `chunked_causal_attention` (5/8 of the scores by its query chunks, faster on a CPU,
    docs/speed.md), whose backward pass also recomputes. The choice is recorded with
    `note("attention", ...)` for the run's report: "cudnn", "blockwise (document mask)", "xla
    (soft-capping)", "blockwise (sinks)", "blockwise (MLA head dims)", ..."""
    # jax's local window (left, right): key j visible from query i when i - left <= j <= i + right
    static = isinstance(window, int)
    band = (window - 1, 0) if isinstance(window, int) and window else None
    if softcap:  # cuDNN's kernel has no soft-capping
        reason = "soft-capping"
    elif not static:  # nor a window known only inside the layer scan
        reason = "per-layer window"
    elif sinks is not None:  # nor sinks (jax.nn.dot_product_attention takes none), nor Pallas'
        reason = "sinks"
    elif v.shape[-1] != q.shape[-1]:  # jax's cuDNN path and Pallas' kernel: one head dim
        reason = "MLA head dims"
    elif segments is not None:  # nor document masks: on a GPU, Pallas' kernel takes them
        reason = "document mask"
        gpu = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
        if gpu and not window and pallas_attention.takes(q, k, v):
            note("attention", "pallas triton (document mask)")
            return pallas_attention.document_attention(q, k, v, segments, scale)
    elif jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            out = jax.nn.dot_product_attention(
                q,
                k,
                v,
                scale=scale,
                is_causal=True,
                local_window_size=band,
                implementation="cudnn",
            )
            note("attention", "cudnn")
            return out
        except (ValueError, NotImplementedError, RuntimeError) as why:
            reason = f"cudnn declined: {why}"
    else:
        reason = ""
    if q.shape[1] > BLOCK_K:  # more than one key block: the blockwise kernel, linear memory
        note("attention", f"blockwise ({reason})" if reason else "blockwise")
        return blockwise_attention(q, k, v, segments, window, scale, softcap, sinks=sinks)
    note("attention", f"xla ({reason})" if reason else "xla")
    return chunked_causal_attention(q, k, v, segments, window, scale, softcap, sinks)


def chunked_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`grouped_causal_attention` with the queries split along length into n equal chunks
    (spmd.model_shape.query_chunks: 4 or 2 of at least 32 positions), chunk i attending to
    the first (i + 1) / n of the keys, the only ones it can see: (n + 1) / 2n of the length²
    scores instead of all of them. Each chunk's backward pass recomputes its probabilities
    from q and k (`recomputed_attention`), as flash attention does. Same shapes in and out
    as `causal_attention`."""
    chunks = query_chunks(q.shape[1])
    static = isinstance(window, int)  # a traced window travels as data, an int as a constant
    traced, fixed = (None, window) if static else (window, 0)
    outs = [
        recomputed_attention(q, k, v, segments, traced, fixed, i, chunks, scale, softcap, sinks)
        for i in range(chunks)
    ]
    return jnp.concatenate(outs, axis=1)


@functools.partial(jax.checkpoint, static_argnums=(5, 6, 7, 8, 9))
def recomputed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None,
    traced_window: jax.Array | None,
    window: int,
    chunk: int,
    chunks: int,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`grouped_causal_attention` of query chunk `chunk` of `chunks` over the keys it can see,
    whose backward pass recomputes the probabilities from q and k instead of keeping batch x
    heads x length² of them per layer: one more q k^T matmul, and on a CPU a faster step, as
    the layer scan no longer writes the probabilities into its stacked residuals and reads
    them back (docs/speed.md). It takes the whole q, k and v and slices them itself, so that
    what the backward pass keeps is q, k and v once, not a copy of each chunk's slices. The
    window is `traced_window` where given, else the constant `window`."""
    size = q.shape[1] // chunks
    start, end = chunk * size, (chunk + 1) * size
    documents = None if segments is None else segments[:, :end]
    band = window if traced_window is None else traced_window
    return grouped_causal_attention(
        q[:, start:end],
        k[:, :end],
        v[:, :end],
        documents,
        band,
        jnp.arange(start, end),
        scale,
        softcap,
        sinks,
    )


def same_document(segments: jax.Array, keys: jax.Array | None = None) -> jax.Array:
    """bool [batch, t, s]: whether query position t (document ids `segments` [batch, t]) and
    key position s (ids `keys` [batch, s]; None: the same positions as the queries) hold the
    same document."""
    keys = segments if keys is None else keys
    return segments[:, :, None] == keys[:, None, :]


def segment_positions(segments: jax.Array) -> jax.Array:
    """Rotary positions [batch, length] that restart at 0 where each document starts."""
    index = jnp.arange(segments.shape[1])
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def visible(queries: jax.Array, keys: jax.Array, window: int | jax.Array = 0) -> jax.Array:
    """bool [..., t, s]: whether a query at position `queries` [..., t] sees a key at
    `keys` [s]: causal, and within `window` positions when it is > 0 (an int, or a traced
    int32 scalar)."""
    seen = keys <= queries[..., None]
    if not isinstance(window, int):
        seen &= (window <= 0) | (keys > queries[..., None] - window)
    elif window:
        seen &= keys > queries[..., None] - window
    return seen


def grouped_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segments: jax.Array | None = None,
    window: int | jax.Array = 0,
    positions: jax.Array | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`causal_attention` written out: logits and softmax in fp32, matmul inputs in q's dtype.
    `positions` [batch, t] or [t]: where the queries sit among k's positions (decoding over a
    key / value cache, a chunk of the queries); None: q and k are the same positions 0..t-1.
    `segments` [batch, s]: the keys' document ids (the queries' are read at `positions`).
    Query head h reads kv head h // (heads / kv_heads), as in jax.nn.dot_product_attention.

    The matmuls run head-major, each kv head's g query heads stacked as g x t rows: batch and
    kv head lead and one dim is contracted, forward and backward. XLA:CPU runs that layout's
    forward + backward 1.2-1.3x faster than jax.nn.dot_product_attention's [b, t, heads, d]
    (docs/speed.md); jax.nn.dot_product_attention also asks for the fp32-logit dot of fp16
    inputs by an explicit algorithm (F16_F16_F32) that XLA:CPU refuses to compile."""
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    groups = h // kv_heads
    rows = q.reshape(b, t, kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    rows = rows.reshape(b, kv_heads, groups * t, d)
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv_heads, s, d]
    # bf16: the dot's algorithm named, as jax.nn.dot_product_attention does, so that the
    # backward pass's dots take bf16 operands too instead of upcasting both to fp32
    bf16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    logits = jnp.einsum(
        "bkmd,bksd->bkms", rows, keys, precision=bf16, preferred_element_type=jnp.float32
    )
    queries = jnp.arange(t) if positions is None else positions
    seen = visible(jnp.tile(queries, groups), jnp.arange(k.shape[1]), window)  # row m: m % t
    if segments is not None:
        mine = segments if positions is None else segments[jnp.arange(b)[:, None], positions]
        seen = seen & jnp.tile(same_document(mine, segments), (1, groups, 1))
    if seen.ndim == 3:  # per sequence: [b, rows, s]
        seen = seen[:, None]
    logits = logits * (d**-0.5 if scale is None else scale)
    if softcap:  # squashed into (-softcap, softcap) before the mask, as Gemma 2 does
        logits = softcap * jnp.tanh(logits / softcap)
    logits = jnp.where(seen, logits, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    else:  # each row's head's sink as one more column of the softmax, then dropped: no value
        sink = jnp.repeat(sinks.astype(jnp.float32).reshape(kv_heads, groups), t, axis=1)
        column = jnp.broadcast_to(sink[None, :, :, None], (*logits.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., :-1]
        probs = probs.astype(v.dtype)
    out = jnp.einsum("bkms,bksd->bkmd", probs, values)
    dv = v.shape[-1]  # may differ from q's and k's (MLA)
    return out.reshape(b, kv_heads, groups, t, dv).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dv)
