"""A Llama-style decoder in Flax NNX that speaks logical axis names only.

Token embedding, RMSNorm, rotary position embedding (the "rotate half" convention that
Hugging Face checkpoints use), grouped-query causal attention, SwiGLU MLP, tied or untied
output head. The decoder blocks are created stacked (a leading `layers` dimension) and applied
with `lax.scan`, so compile time does not grow with depth; `remat` recomputes each block's
activations in the backward pass.

Params are stored in `param_dtype` (fp32) and cast to `dtype` for compute; the loss is always
computed in fp32.

Params are read through the hooks of spmd.parallel.collectives (`gather`, Megatron's `tp_enter` /
`tp_reduce`, and the vocab-parallel lookup and cross-entropy's `tp_rank`, `tp_sum`, `tp_max`),
which take logical names and do nothing unless the explicit executor runs the model inside a
shard_map, where each device holds only its blocks of the params.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import (
    attention,
    constrain,
    gather,
    note,
    scan_layers,
    token_positions,
    tp_enter,
    tp_max,
    tp_rank,
    tp_reduce,
    tp_sum,
)

# Residual-stream activations (embedding output, norms, residual adds). Their length is split
# over `tensor` under sequence parallelism; the matmuls' inputs are whole along `length`.
RESIDUAL = ("batch", "residual_length", "embed")
WHOLE = ("batch", "length", "embed")

# LlamaConfig.remat's choices (its --help and the resolver's check); REMAT_POLICIES maps each
# to its jax.checkpoint policy.
Remat = Literal["none", "full", "dots_saveable", "offload"]
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # dots_saveable's matmul outputs, kept in host memory until the backward pass reads them
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of the decoder. Sizes are counts (tokens, features, heads, layers)."""

    vocab_size: int  # tokens in the vocabulary (rows of the embedding; byte-level: 256)
    embed_dim: int  # width of the residual stream
    mlp_dim: int  # hidden width of each block's SwiGLU MLP
    n_layers: int  # transformer blocks
    n_heads: int  # query heads per attention layer
    n_kv_heads: int  # key / value heads (grouped-query attention; must divide n_heads)
    head_dim: int  # features per attention head
    rope_theta: float = 10000.0  # base of the rotary position embedding's frequencies
    norm_eps: float = 1e-5  # epsilon of the RMS norms
    tie_embeddings: bool = False  # the output projection is the embedding, transposed
    # what the backward pass keeps of each layer: none = every activation; full = nothing (the
    # layer's forward runs again); dots_saveable = the matmul outputs; offload = the matmul
    # outputs, kept in host memory
    remat: Remat = "none"
    family: str = "llama"  # the model family this config describes: llama or moe (models.family)

    def n_params(self) -> int:
        """Parameter count (number of scalars)."""
        attn = self.embed_dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * self.embed_dim * self.mlp_dim + 2 * self.embed_dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.embed_dim
        return self.vocab_size * self.embed_dim + self.n_layers * block + self.embed_dim + head

    def n_active_params(self) -> int:
        """Parameters one token uses: all of them (a dense model)."""
        return self.n_params()

    def shape(self) -> ModelShape:
        """The sizes the estimators read (spmd.model_shape): a dense model, no experts."""
        return ModelShape(
            vocab_size=self.vocab_size,
            embed_dim=self.embed_dim,
            mlp_dim=self.mlp_dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            tie_embeddings=self.tie_embeddings,
            remat=self.remat,
        )


# The sizes of a Llama, each a count of at least 1.
SIZES = ("vocab_size", "embed_dim", "mlp_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim")


def check(cfg: LlamaConfig) -> None:
    """UsageError for a config no model can be built from (the family's check; spmd's commands
    call it before any device work). Messages name the flags that set the fields."""
    for name in SIZES:  # the flag of each field: its name with "-" for "_"
        if getattr(cfg, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {getattr(cfg, name)} must be a positive integer")
    if cfg.n_heads % cfg.n_kv_heads:
        raise UsageError(f"--n-kv-heads {cfg.n_kv_heads} must divide --n-heads {cfg.n_heads}")
    if cfg.head_dim % 2:  # rotary turns pairs (i, i + head_dim / 2) of each head's features
        raise UsageError(f"--head-dim {cfg.head_dim} must be even (rotary rotates pairs)")
    # `not 0 < x < inf` refuses NaN too, which fails every comparison
    if not 0 < cfg.rope_theta < math.inf:
        raise UsageError(f"--rope-theta {cfg.rope_theta} must be a positive, finite base")
    if not 0 < cfg.norm_eps < math.inf:
        raise UsageError(f"--norm-eps {cfg.norm_eps} must be positive and finite, e.g. 1e-5")
    if cfg.remat not in REMAT_POLICIES:
        raise UsageError(f"--remat {cfg.remat!r} is not one of {', '.join(REMAT_POLICIES)}")


def _param(rngs: nnx.Rngs, std: float, shape: tuple[int, ...], names: tuple[str, ...]):
    init = jax.nn.initializers.normal(std) if std else jax.nn.initializers.ones
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.scale = _param(rngs, 0.0, (dim,), ("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * gather(self.scale)).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (i, i + head_dim/2) of `x` [batch, length, heads, head_dim] by angle
    position * theta^(-2i/head_dim)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, :, None, None].astype(jnp.float32) * freqs
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None
) -> jax.Array:
    """Causal grouped-query attention: q [batch, length, heads, head_dim], k and v [batch,
    length, kv_heads, head_dim] -> [batch, length, heads, head_dim]; softmax in fp32. With
    `segments` [batch, length] (document ids), a position attends only within its document.

    On a GPU, cuDNN's fused flash-attention kernel (jax.nn.dot_product_attention with
    implementation="cudnn") where it takes the shapes and dtype (16-bit inputs, head_dim a
    multiple of 8 up to 128, ...; JAX checks them while tracing and says no with an exception),
    else XLA's. fp16 on XLA takes `grouped_causal_attention`: jax.nn.dot_product_attention asks
    for the fp32-logit dot by an explicit algorithm (F16_F16_F32) that XLA:CPU refuses to
    compile. The choice is recorded with `note("attention", ...)` for the run's report."""
    if segments is not None:  # document masks go through XLA's attention (a general mask)
        note("attention", "xla (document mask)")
    elif jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            note("attention", "cudnn")
            return out
        except (ValueError, NotImplementedError, RuntimeError) as why:
            note("attention", f"xla (cudnn declined: {why})")
    else:
        note("attention", "xla")
    if q.dtype == jnp.float16:
        return grouped_causal_attention(q, k, v, segments)
    mask = None if segments is None else same_document(segments)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def same_document(segments: jax.Array) -> jax.Array:
    """bool [batch, length, length]: whether query position t and key position s hold the
    same document."""
    return segments[:, :, None] == segments[:, None, :]


def segment_positions(segments: jax.Array) -> jax.Array:
    """Rotary positions [batch, length] that restart at 0 where each document starts."""
    index = jnp.arange(segments.shape[1])
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def grouped_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None
) -> jax.Array:
    """`causal_attention` written out: logits and softmax in fp32, matmul inputs in q's dtype."""
    b, t, h, d = q.shape
    groups = q.reshape(b, t, k.shape[2], h // k.shape[2], d)
    logits = jnp.einsum("btkgd,bskd->bkgts", groups, k, preferred_element_type=jnp.float32)
    causal = jnp.tril(jnp.ones((t, k.shape[1]), dtype=bool))
    if segments is not None:
        causal = causal & same_document(segments)[:, None, None]
    logits = jnp.where(causal, logits * d**-0.5, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, h, k, d = cfg.embed_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, out_std = 0.02, 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = _param(rngs, std, (e, h, d), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, out_std, (h, d, e), ("heads", "head_dim", "embed"))
        self.rope_theta = cfg.rope_theta
        self.group = h // k  # query heads per kv head

    def _kv_for_local_heads(self, wq: jax.Array, wk: jax.Array, wv: jax.Array):
        """The kv heads this device's query heads read. When the heads are split more ways
        than there are kv heads, the kv heads are replicated: pick the one this block needs."""
        local_heads, needed = wq.shape[1], max(wq.shape[1] // self.group, 1)
        if wk.shape[1] == needed:
            return wk, wv
        first = tp_rank("heads") * local_heads // self.group
        return tuple(jax.lax.dynamic_slice_in_dim(w, first, needed, axis=1) for w in (wk, wv))

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
    ) -> jax.Array:
        dtype = x.dtype
        x = constrain(tp_enter(x, "heads"), WHOLE)  # column-parallel q, k, v: local heads
        wq = gather(self.wq)
        wk, wv = self._kv_for_local_heads(wq, gather(self.wk), gather(self.wv))
        q = jnp.einsum("bte,ehd->bthd", x, wq.astype(dtype))
        k = jnp.einsum("bte,ekd->btkd", x, wk.astype(dtype))
        v = jnp.einsum("bte,ekd->btkd", x, wv.astype(dtype))
        q = constrain(rotary(q, positions, self.rope_theta), ("batch", "length", "heads", None))
        k = constrain(rotary(k, positions, self.rope_theta), ("batch", "length", "kv_heads", None))
        v = constrain(v, ("batch", "length", "kv_heads", None))
        # ring attention when length is split over `context` (refused with document masks)
        out = attention(q, k, v, lambda q, k, v: causal_attention(q, k, v, segments))
        out = jnp.einsum("bthd,hde->bte", out, gather(self.wo).astype(dtype))
        # row-parallel: sum the heads' partial outputs
        return constrain(tp_reduce(out, "heads"), RESIDUAL)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, m = cfg.embed_dim, cfg.mlp_dim
        self.w_gate = _param(rngs, 0.02, (e, m), ("embed", "mlp"))
        self.w_up = _param(rngs, 0.02, (e, m), ("embed", "mlp"))
        self.w_down = _param(rngs, 0.02 / (2 * cfg.n_layers) ** 0.5, (m, e), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x = constrain(tp_enter(x, "mlp"), WHOLE)  # column-parallel gate, up: local columns
        gate = jnp.einsum("bte,em->btm", x, gather(self.w_gate).astype(dtype))
        up = jnp.einsum("bte,em->btm", x, gather(self.w_up).astype(dtype))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        out = jnp.einsum("btm,me->bte", hidden, gather(self.w_down).astype(dtype))
        # row-parallel: sum the columns' partial outputs
        return constrain(tp_reduce(out, "mlp"), RESIDUAL)


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None = None
    ) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, segments)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, RESIDUAL)


class Llama(nnx.Module):
    """Decoder-only LM: tokens [batch, length] int32 -> logits [batch, length, vocab] fp32."""

    block_type: type = Block  # what each layer is (models/moe.py swaps in its MoE block)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        self.embed = _param(rngs, 0.02, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
            return type(self).block_type(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, 0.02, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Logits; with `segments` [batch, length] (document ids of packed windows) attention
        stays within each document and positions restart at each."""
        return self.head_logits(self.apply_blocks(self.embed_tokens(tokens), segments))

    # The three pieces below are what a pipeline runs on separate stages: the embedding on the
    # first, the stacked blocks split in chunks, the head on the last. `apply_blocks` runs
    # however many layers `self.blocks` holds, so a model merged with a slice of the stack runs
    # just that slice.

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token ids [batch, length] -> activations [batch, length, embed] in `dtype`."""
        # Gather the table's fsdp shards first: a lookup into a table split two ways (vocab
        # and embed) makes the partitioner replicate the whole table.
        table = constrain(gather(self.embed), ("vocab", "embed"))
        x = lookup_embeddings(table, tokens, self.cfg.vocab_size).astype(self.dtype)
        return constrain(x, RESIDUAL)

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Run every block in `self.blocks` in order (a scan over the stacked `layers` dim)."""
        if segments is None:
            positions = token_positions(x)  # global positions, also under SP and CP
        else:  # rotary positions restart at each document
            positions = segment_positions(segments)
        block_def, block_state = nnx.split(self.blocks)

        def layer(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
            return nnx.merge(block_def, state)(x, positions, segments), None

        x, _ = scan_layers(layer, x, block_state, REMAT_POLICIES[self.cfg.remat])
        return x

    def head_logits(self, x: jax.Array) -> jax.Array:
        """Final norm and output head: activations [batch, length, embed] -> fp32 logits."""
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            head = constrain(gather(self.embed), ("vocab", "embed")).T
        else:
            head = gather(self.lm_head)
        x = constrain(tp_enter(x, "vocab"), WHOLE)  # column-parallel head: local vocab slice
        logits = jnp.einsum("bte,ev->btv", x, head.astype(self.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


def lookup_embeddings(table: jax.Array, tokens: jax.Array, vocab_size: int) -> jax.Array:
    """Rows of the embedding table for `tokens`. A table split over the vocabulary holds rows
    [rank * rows, (rank + 1) * rows): each device looks up the tokens it holds, zeros the
    others, and the partial results are summed over the vocabulary shards."""
    rows = table.shape[0]
    if rows == vocab_size:
        return jnp.take(table, tokens, axis=0)
    local = tokens - tp_rank("vocab") * rows
    mine = (local >= 0) & (local < rows)
    found = jnp.take(table, jnp.where(mine, local, 0), axis=0)
    # Megatron's g of the vocab-parallel lookup (a reduce-scatter under sequence parallelism)
    return tp_reduce(jnp.where(mine[..., None], found, 0), "vocab")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token (fp32), exact when the vocabulary dimension of
    `logits` is split over devices: the max and the sum of exponentials are reduced over the
    vocabulary shards, and the target's logit comes from the shard that holds it."""
    rows = logits.shape[-1]
    shift = tp_max(jax.lax.stop_gradient(logits.max(axis=-1)), "vocab")
    shifted = logits - shift[..., None]
    log_total = jnp.log(tp_sum(jnp.exp(shifted).sum(axis=-1), "vocab"))
    local = targets - tp_rank("vocab") * rows
    mine = (local >= 0) & (local < rows)
    picked = jnp.take_along_axis(shifted, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)
    return log_total - tp_sum(jnp.where(mine, picked[..., 0], 0.0), "vocab")


def create(cfg: LlamaConfig, seed: int, dtype: Any = jnp.float32) -> Llama:
    """A freshly initialised model (eager, unsharded; use spmd.engine.step to create it sharded)."""
    with nnx.use_eager_sharding(False):
        return Llama(cfg, nnx.Rngs(seed), dtype)


def lm_loss(model: Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (nats per token, fp32) of batch["inputs"] -> ["targets"].
    Optional keys: "segments" (document ids: attention within documents) and "weights"
    (per-target loss weights, e.g. a prompt/response loss mask scaled by the data pipeline so
    that this mean is the mean over the counted tokens)."""
    losses = cross_entropy(model(batch["inputs"], batch.get("segments")), batch["targets"])
    if "weights" in batch:
        losses = losses * batch["weights"]
    return jnp.mean(losses)


def logits_loss(
    logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Mean cross-entropy (nats per token, fp32) of logits [..., vocab] against int targets,
    each token's loss times its `weights` entry where given (as `lm_loss`): `cross_entropy`'s
    value, written without a gather. The target's logit is picked by a
    one-hot product summed over vocab (exact: one term is non-zero; a target another device's
    vocabulary shard holds one-hots to zeros here), which stays a plain reduction when vocab
    is split; a gather on split logits crashes XLA's SPMD partitioner inside a partially
    manual shard_map (the pipeline's head). Exact across vocab shards like `cross_entropy`."""
    rows = logits.shape[-1]
    shift = tp_max(jax.lax.stop_gradient(logits.max(axis=-1)), "vocab")
    shifted = logits - shift[..., None]
    log_total = jnp.log(tp_sum(jnp.exp(shifted).sum(axis=-1), "vocab"))
    local = targets - tp_rank("vocab") * rows
    picked = jnp.sum(shifted * jax.nn.one_hot(local, rows, dtype=shifted.dtype), axis=-1)
    losses = log_total - tp_sum(picked, "vocab")
    return jnp.mean(losses if weights is None else losses * weights)
