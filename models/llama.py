"""A Llama-style decoder in Flax NNX that speaks logical axis names only.

Token embedding, RMSNorm, rotary position embedding (the "rotate half" convention that
Hugging Face checkpoints use), grouped-query causal attention, SwiGLU MLP, tied or untied
output head; and the switches of its Hugging Face variants (models/hf_config.py): Llama 3's
rope scaling (models/rope.py), Qwen2's q/k/v biases, Qwen3's per-head q/k norms and Mistral's
sliding window (models/attention.py). The decoder blocks are created stacked (a leading
`layers` dimension) and applied with `lax.scan`, so compile time does not grow with depth;
`remat` recomputes each block's activations in the backward pass.

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
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import fused_loss, layer_groups, layers
from models.attention import Attention, segment_positions
from models.layers import (
    REMAT_POLICIES,
    RESIDUAL,
    WHOLE,
    Remat,
    RMSNorm,
    dense,
    stored,
    swiglu,
    weight,
)
from models.layers import param as _param
from models.rope import SCALINGS, Scaling
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import (
    constrain,
    document_positions,
    scan_layers,
    token_positions,
    tp_enter,
    tp_max,
    tp_rank,
    tp_reduce,
    tp_sum,
)


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
    # true: the stacked layers run as one loop (compile time flat in depth); false: unrolled,
    # one copy of the layer per layer in the program: no stacked residuals to write and read
    # back (13% faster on the CPU benchmark of docs/speed.md), compile time grows with depth
    scan_layers: bool = True
    family: str = "llama"  # the model family this config describes: llama or moe (models.family)
    # rotary frequency scaling of long-context checkpoints (models/rope.py): none, linear
    # (frequencies / rope_factor) or llama3 (Llama 3.1's banded rule)
    rope_scaling: Scaling = "none"
    rope_factor: float = 1.0  # linear, llama3: the context's growth over pretraining's
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths over L / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths under L / this are kept
    rope_original_max_positions: int = 8192  # llama3: L, the pretraining context (tokens)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMS norm of each q and k head over head_dim, before rotary (Qwen3)
    sliding_window: int = 0  # attend to this many positions, the own included (0: all; Mistral)
    # the output layer and loss run over chunks of this many vocabulary columns, each chunk's
    # logits recomputed in the backward pass, so the [tokens, vocab] logits never exist whole
    # (models/fused_loss.py); 0: unfused, the whole logits at once
    loss_chunk: int = fused_loss.DEFAULT_CHUNK

    def shape(self) -> ModelShape:
        """The sizes the estimators read (spmd.model_shape): a dense model, no experts."""
        return ModelShape(
            **{name: getattr(self, name) for name in SIZES},
            tie_embeddings=self.tie_embeddings,
            remat=self.remat,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            loss_chunk=self.loss_chunk,
        )

    def n_params(self) -> int:
        """Parameter count (scalars): its shape's."""
        return self.shape().n_params()

    def n_active_params(self) -> int:
        """Parameters one token uses (an MoE's k experts of E): its shape's."""
        return self.shape().n_active_params()


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
    if cfg.sliding_window < 0:
        raise UsageError(
            f"--sliding-window {cfg.sliding_window} must be a number of positions, or 0 (none)"
        )
    if cfg.loss_chunk < 0:
        raise UsageError(
            f"--loss-chunk {cfg.loss_chunk} must be a number of vocabulary columns, or 0 (unfused)"
        )
    check_rope(cfg)


def check_rope(cfg: LlamaConfig) -> None:
    """UsageError for rope scaling settings that give no frequencies (models/rope.py)."""
    if cfg.rope_scaling not in SCALINGS:
        raise UsageError(f"--rope-scaling {cfg.rope_scaling!r} is not one of {', '.join(SCALINGS)}")
    if cfg.rope_scaling == "none":
        return
    if not 1 <= cfg.rope_factor < math.inf:
        raise UsageError(f"--rope-factor {cfg.rope_factor} must be a finite factor >= 1")
    if cfg.rope_scaling != "llama3":
        return
    if cfg.rope_original_max_positions < 1:
        raise UsageError(
            f"--rope-original-max-positions {cfg.rope_original_max_positions} must be a "
            f"positive number of positions"
        )
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    if not 0 < low < high < math.inf:
        raise UsageError(
            f"--rope-low-freq-factor {low} and --rope-high-freq-factor {high} need "
            f"0 < low < high (finite), e.g. 1 and 4"
        )


def check_layout(cfg: LlamaConfig, mesh: Any, executor: str) -> None:
    """UsageError for what the model does not compose with: nothing any more. The families
    built on it (Phi-3, OLMo 2, the MoE) call it before their own refusals. A sliding window
    and document masks compose with context parallelism: the ring masks both
    (spmd.parallel.ring_attention)."""
    del cfg, mesh, executor


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        e, m = cfg.embed_dim, cfg.mlp_dim
        self.w_gate = _param(rngs, 0.02, (e, m), ("embed", "mlp"))
        self.w_up = _param(rngs, 0.02, (e, m), ("embed", "mlp"))
        self.w_down = _param(rngs, 0.02 / (2 * cfg.n_layers) ** 0.5, (m, e), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(tp_enter(x, "mlp"), WHOLE)  # column-parallel gate, up: local columns
        gate, up = dense(x, weight(self, "w_gate")), dense(x, weight(self, "w_up"))
        hidden = constrain(swiglu(gate, up), ("batch", "length", "mlp"))
        out = dense(hidden, weight(self, "w_down"))
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

    def decode(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block over one layer's key / value cache (models/llama_decode.py): (x, keys,
        values) with this call's keys and values written at `positions`."""
        attended, keys, values = self.attn.cached(self.attn_norm(x), positions, keys, values)
        x = x + attended
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, RESIDUAL), keys, values


def stacked_blocks(block_type: type, cfg: LlamaConfig, n_layers: int, rngs: nnx.Rngs) -> Any:
    """`n_layers` blocks `block_type(cfg, rngs)` created as one module whose params carry a
    leading `layers` dim (each block its own draws)."""

    @nnx.split_rngs(splits=n_layers)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
        return block_type(cfg, rngs)

    return make_blocks(rngs)


class Llama(nnx.Module):
    """Decoder-only LM: tokens [batch, length] int32 -> logits [batch, length, vocab] fp32."""

    block_type: type = Block  # what each layer is (models/moe.py swaps in its MoE block)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        self.embed = _param(rngs, 0.02, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"))
        self.make_stacks(cfg, rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, 0.02, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"))

    def make_stacks(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        """The decoder blocks, stacked: `self.blocks` holds n_layers of `block_type`."""
        self.blocks = stacked_blocks(type(self).block_type, cfg, cfg.n_layers, rngs)

    def layer_runs(self) -> list[tuple[nnx.Module, layer_groups.Run]]:
        """The model's layers in order as runs of one kind, each with the stack it reads
        (models/layer_groups.py): here one run, all of `self.blocks`."""
        return [(self.blocks, layer_groups.Run(False, 0, self.cfg.n_layers, 0))]

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
        table = constrain(stored(self, "embed"), ("vocab", "embed"))
        x = lookup_embeddings(table, tokens, self.cfg.vocab_size).astype(self.dtype)
        return constrain(x, RESIDUAL)

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Run every block in `self.blocks` in order (a scan over the stacked `layers` dim)."""
        if segments is None:
            positions = token_positions(x)  # global positions, also under SP and CP
        else:  # rotary positions restart at each document
            positions = document_positions(segments, segment_positions)
        block_def, block_state = nnx.split(self.blocks)

        def layer(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
            return nnx.merge(block_def, state)(x, positions, segments), None

        policy = REMAT_POLICIES[self.cfg.remat]
        x, _ = scan_layers(layer, x, block_state, policy, unrolled=not self.cfg.scan_layers)
        return x

    def head_logits(self, x: jax.Array) -> jax.Array:
        """Final norm and output head: activations [batch, length, embed] -> fp32 logits
        (soft-capped where `logit_softcap` is not 0)."""
        return self.logits_of(*self.head_parts(x))

    def head_parts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the head multiplies: (the normed activations [batch, length, embed], through
        Megatron's f; the head [embed, vocab], this device's vocabulary block when split)."""
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            head = constrain(stored(self, "embed"), ("vocab", "embed")).T
        else:
            head = stored(self, "lm_head")
        return constrain(tp_enter(x, "vocab"), WHOLE), head  # column-parallel: local vocab

    def logits_of(self, x: jax.Array, head: jax.Array) -> jax.Array:
        """fp32 logits of `head_parts`' (x, head), soft-capped."""
        logits = dense(x, head).astype(jnp.float32)
        cap = self.logit_softcap()
        logits = cap * jnp.tanh(logits / cap) if cap else logits
        return constrain(logits, ("batch", "length", "vocab"))

    def logit_softcap(self) -> float:
        """The cap of the output logits, cap * tanh(logits / cap) (0: none; Gemma sets one)."""
        return 0.0

    def token_losses(self, x: jax.Array, targets: jax.Array) -> jax.Array:
        """Per-token cross-entropy (fp32 [batch, length]) of the blocks' output x against
        `targets`: fused over vocabulary chunks (models/fused_loss.py) where the config's
        loss_chunk is narrower than the vocabulary, else through the whole logits."""
        x, head = self.head_parts(x)
        if fused_loss.fuses(self.cfg.vocab_size, self.cfg.loss_chunk):
            softcap = self.logit_softcap()
            return fused_loss.token_losses(x, head, targets, self.cfg.loss_chunk, softcap)
        return cross_entropy(self.logits_of(x, head), targets)


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


# (cfg, seed, dtype=fp32) -> a freshly initialised Llama (eager, unsharded; spmd.engine.step
# creates it sharded)
create = layers.creator(Llama)


def lm_loss(model: Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy (nats per token, fp32) of batch["inputs"] -> ["targets"].
    Optional keys: "segments" (document ids: attention within documents) and "weights"
    (per-target loss weights, e.g. a prompt/response loss mask scaled by the data pipeline so
    that this mean is the mean over the counted tokens)."""
    losses = lm_token_losses(model, batch)
    if "weights" in batch:
        losses = losses * batch["weights"]
    return jnp.mean(losses)


def lm_token_losses(model: Llama, batch: dict[str, jax.Array]) -> jax.Array:
    """Per-target cross-entropy -log p(target) (nats, fp32 [batch, length]) of
    batch["inputs"] -> ["targets"], attention within batch["segments"] where given: what a
    preference objective (spmd.engine.preference) sums over a sequence's response tokens."""
    x = model.apply_blocks(model.embed_tokens(batch["inputs"]), batch.get("segments"))
    return model.token_losses(x, batch["targets"])


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
