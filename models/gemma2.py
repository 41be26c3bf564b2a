"""Gemma 2 in Flax NNX, speaking logical axis names only (Hugging Face `Gemma2ForCausalLM`;
config.json in models/hf_gemma2.py). models/gemma3.py is the same model with Gemma 3's
switches (per-head q/k norms, two rotary bases, no soft-capping).

What differs from models/llama.py, each a field of Gemma2Config:

- embeddings scaled by sqrt(embed_dim), the factor rounded to the compute dtype first (as
  transformers multiplies by it in the weights' dtype: 16-bit models use sqrt(e) rounded);
  the output head is always the embedding, transposed (tied);
- RMSNorms of the (1 + scale) form (models.layers.RMSNorm plus_one, in fp32), four per block:
  before attention, after it (before the residual add), before the MLP and after it;
- GeGLU MLP: gelu_tanh(x W_gate) * (x W_up), then W_down (models.layers.geglu);
- attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, and
  soft-capped: attn_softcap * tanh(scores / attn_softcap) before the mask (0: none);
- final logits soft-capped the same way by final_softcap (0: none);
- local and global layers: layer i is global when (i + 1) % global_every == 0 (Gemma 2: every
  second layer, 1, 3, 5, ...; Gemma 3: every sixth), otherwise local: a sliding window of
  `sliding_window` positions and the rotary base rope_local_theta (Gemma 2: the same base);
  global layers see every earlier position with base rope_theta (optionally with linear
  scaling, Gemma 3's long-context checkpoints). global_every 0: every layer is local.

Local and global layers share one stacked block (same params), so the layer scan carries the
layer's index (int32) beside the activations, and each block picks its rotary frequencies
with jnp.where and its window by `lax.cond` between two branches of the attention kernel
alone, each with its window a constant (`static_window`): models/attention.py then picks a
fused kernel where the case allows (cuDNN on a GPU for Gemma 3, which has no soft-cap; Gemma
2's soft-cap keeps the blockwise kernel), never the traced-window path. The params' layout
(one [n_layers, ...] stack: checkpoints, the HF mapping, LoRA, pipelines) and the scan over
single layers (their remat, ZeRO-3's gathering and prefetch) are unchanged. A pipeline stage's
`apply_blocks` sees only its slice of the layers and counts from 0: that index is right modulo
the pattern's period when every pipeline chunk holds a whole number of periods, so
`check_layout` refuses a pipeline whose stages do not (n_layers / pp a multiple of
global_every) and `apply_blocks` refuses, while tracing, any other slice that is not a whole
number of periods (an interleaved schedule's chunks). Under context parallelism the layer's
attention goes through `hooks.attention` with its document ids, window (traced in the scan),
scale and soft-cap: the ring computes all four per block; Ulysses runs the one-device kernel
(the same `static_window` branches) on whole sequences of a share of the heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from models import fused_loss, hf_gemma2, layers, llama
from models.attention import (
    CACHE_NAMES,
    Attention,
    causal_attention,
    grouped_causal_attention,
    segment_positions,
)
from models.contract import Family, HFMapping
from models.layers import REMAT_POLICIES, RESIDUAL, WHOLE, Remat, RMSNorm, dense, geglu, weight
from models.layers import param as _param
from models.rope import Rope, rotate
from spmd.errors import UsageError
from spmd.model_shape import ModelShape
from spmd.parallel.hooks import (
    attention,
    constrain,
    document_positions,
    scan_layers,
    token_positions,
    tp_enter,
    tp_reduce,
)

GemmaScaling = Literal["none", "linear"]


@dataclasses.dataclass(frozen=True)
class Gemma2Config:
    """Architecture of a Gemma decoder. Sizes are counts (tokens, features, heads, layers)."""

    vocab_size: int  # tokens in the vocabulary (rows of the tied embedding)
    embed_dim: int  # width of the residual stream
    mlp_dim: int  # hidden width of each block's GeGLU MLP
    n_layers: int  # transformer blocks
    n_heads: int  # query heads per attention layer
    n_kv_heads: int  # key / value heads (grouped-query attention; must divide n_heads)
    head_dim: int  # features per attention head
    rope_theta: float = 10000.0  # rotary base of the global layers
    rope_local_theta: float = 10000.0  # rotary base of the local (sliding-window) layers
    # rotary scaling of the global layers: none, or linear (frequencies / rope_factor)
    rope_scaling: GemmaScaling = "none"
    rope_factor: float = 1.0  # linear: the context's growth over pretraining's
    norm_eps: float = 1e-6  # epsilon of the RMS norms
    query_pre_attn_scalar: float = 256.0  # attention scores are scaled by this ** -0.5
    attn_softcap: float = 50.0  # attention scores soft-capped to (-this, this) (0: none)
    final_softcap: float = 30.0  # output logits soft-capped to (-this, this) (0: none)
    sliding_window: int = 4096  # positions a local layer sees, its own included (0: all)
    global_every: int = 2  # layer i is global when (i + 1) % this == 0 (0: no global layer)
    qk_norm: bool = False  # (1 + w) RMS norm of each q and k head before rotary (Gemma 3)
    # what the backward pass keeps of each layer (models.layers.REMAT_POLICIES): none, full,
    # dots_saveable or offload, as for the llama family
    remat: Remat = "none"
    # true: the stacked layers run as one loop (compile time flat in depth); false: unrolled
    scan_layers: bool = True
    # the output layer and loss over chunks of this many vocabulary columns, each soft-capped
    # and recomputed in the backward pass (models/fused_loss.py); 0: the whole logits at once
    loss_chunk: int = fused_loss.DEFAULT_CHUNK
    family: str = "gemma2"  # the model family this config describes (models.family)

    tie_embeddings = True  # not a field: Gemma's output head is always the embedding

    def shape(self) -> ModelShape:
        """The sizes the estimators read (spmd.model_shape): tied, four norms per block."""
        return ModelShape(
            **{name: getattr(self, name) for name in llama.SIZES},
            tie_embeddings=True,
            remat=self.remat,
            qk_norm=self.qk_norm,
            norms_per_block=4,
            loss_chunk=self.loss_chunk,
        )

    def n_params(self) -> int:
        """Parameter count (scalars): its shape's."""
        return self.shape().n_params()

    @property
    def period(self) -> int:
        """Layers after which the local / global pattern repeats."""
        return self.global_every or 1


def check(cfg: Gemma2Config) -> None:
    """UsageError naming the flag of a field no model can be built from."""
    llama.check(  # the sizes, heads, rotary base, eps and remat, checked as the llama family's
        llama.LlamaConfig(
            **{f: getattr(cfg, f) for f in llama.SIZES},
            rope_theta=cfg.rope_theta,
            norm_eps=cfg.norm_eps,
            remat=cfg.remat,
            loss_chunk=cfg.loss_chunk,
        )
    )
    positive = ("rope_local_theta", "query_pre_attn_scalar")
    at_least_zero = ("attn_softcap", "final_softcap")
    for name in positive + at_least_zero:
        value = getattr(cfg, name)
        low_ok = value > 0 if name in positive else value >= 0
        if not (low_ok and value < math.inf):
            floor = "positive" if name in positive else ">= 0 (0: none)"
            raise UsageError(f"--{name.replace('_', '-')} {value} must be finite and {floor}")
    for name in ("sliding_window", "global_every"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be >= 0")
    if cfg.rope_scaling not in ("none", "linear"):
        raise UsageError(f"--rope-scaling {cfg.rope_scaling!r} is not one of none, linear")
    if cfg.rope_scaling == "linear" and not 1 <= cfg.rope_factor < math.inf:
        raise UsageError(f"--rope-factor {cfg.rope_factor} must be a finite factor >= 1")


def check_layout(cfg: Gemma2Config, mesh: Any, executor: str) -> None:
    """UsageError for a layout the model cannot run: a pipeline whose stages do not each hold
    a whole number of local / global periods (each stage counts its layers from 0)."""
    stages = mesh.shape["pipeline"]
    if stages > 1 and (cfg.n_layers % stages or (cfg.n_layers // stages) % cfg.period):
        raise UsageError(
            f"pp={stages} with --n-layers {cfg.n_layers}: each pipeline stage must hold a "
            f"multiple of --global-every {cfg.period} layers (the local / global pattern "
            f"restarts at every stage); use a pp that splits the layers so, or pp=1"
        )


def layer_attention(cfg: Gemma2Config, layer: jax.Array | int) -> tuple[Any, jax.Array]:
    """(window, rotary frequencies [head_dim / 2]) of layer `layer` (an int32 index, traced in
    the scan, or a Python int): a global layer's are (0, rope_theta's, scaled), a local one's
    (sliding_window, rope_local_theta's). The window is an int where every layer has the same
    or `layer` is an int, else a traced int32 (`static_window` makes it a constant again)."""
    global_freq = Rope(cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor).inv_freq(cfg.head_dim)
    local_freq = Rope(cfg.rope_local_theta).inv_freq(cfg.head_dim)
    if not cfg.global_every:
        return cfg.sliding_window, local_freq
    if cfg.global_every == 1:
        return 0, global_freq
    if isinstance(layer, int):  # a constant of the program: the fused kernels may take it
        if (layer + 1) % cfg.global_every == 0:
            return 0, global_freq
        return cfg.sliding_window, local_freq
    is_global = (jnp.asarray(layer, jnp.int32) + 1) % cfg.global_every == 0
    window = jnp.where(is_global, 0, cfg.sliding_window) if cfg.sliding_window else 0
    return window, jnp.where(is_global, global_freq, local_freq)


def static_window(
    cfg: Gemma2Config, window: jax.Array | int, attend: Callable[[int], jax.Array]
) -> jax.Array:
    """`attend(w)`, w the layer's window as a Python int (a constant of the program, which the
    fused kernels take): `window` itself where it is one, else (a window traced in the layer
    scan) a `lax.cond` between a branch of the global layers' 0 and one of the local layers'
    sliding_window. Only the attention kernel is in the branches: the layer's other
    activations and its params stay outside (ZeRO-3's prefetching scan finds gathered params
    among the layer's residuals by identity, which a branch's outputs would not keep)."""
    if isinstance(window, int):
        return attend(window)
    return lax.cond(window == 0, lambda: attend(0), lambda: attend(cfg.sliding_window))


def check_whole_periods(blocks: nnx.Module, cfg: Any) -> None:
    """UsageError, while tracing, for a stack `blocks` that is a slice of the model's layers
    (a pipeline chunk) holding no whole number of periods of the pattern of layers that differ
    by index (`cfg.period` layers: Gemma's local / global, GPT-OSS's sliding / full): its
    layers count from 0, so they would take the wrong kind."""
    held = jax.tree.leaves(nnx.state(blocks))[0].shape[0]
    if held != cfg.n_layers and held % cfg.period:
        raise UsageError(
            f"a pipeline chunk of {held} layers of a {cfg.family} model is not a multiple of "
            f"--global-every {cfg.period}: its kinds of layer would be counted wrongly; pick "
            f"pp / --pp-virtual so that each chunk holds a multiple"
        )


class GemmaAttention(Attention):
    """models.attention.Attention's projections (no biases) with Gemma's window and rotary
    base by layer, query scale, soft-cap and (Gemma 3) (1 + w) per-head q / k norms."""

    def __init__(self, cfg: Gemma2Config, rngs: nnx.Rngs):
        e, h, k, d = cfg.embed_dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        std, out_std = 0.02, 0.02 / (2 * cfg.n_layers) ** 0.5
        self.wq = _param(rngs, std, (e, h, d), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, std, (e, k, d), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, out_std, (h, d, e), ("heads", "head_dim", "embed"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.norm_eps, rngs, ("head_dim",), plus_one=True)
            self.k_norm = RMSNorm(d, cfg.norm_eps, rngs, ("head_dim",), plus_one=True)
        self.cfg = cfg
        self.group = h // k  # query heads per kv head
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_softcap

    def rotated(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> tuple:
        """(q, k, v) of x [b, t, embed] (whole along length), normed per head and rotated."""
        wq = weight(self, "wq")
        wk, wv = self._kv_for_local_heads(wq, (weight(self, "wk"), weight(self, "wv")), axis=1)
        q, k, v = dense(x, wq), dense(x, wk), dense(x, wv)
        if hasattr(self, "q_norm"):  # Gemma 3: before rotary, as Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(rotate(q, positions, inv_freq), ("batch", "length", "heads", None))
        k = constrain(rotate(k, positions, inv_freq), ("batch", "length", "kv_heads", None))
        return q, k, constrain(v, ("batch", "length", "kv_heads", None))

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None, layer: jax.Array | int
    ) -> jax.Array:
        window, inv_freq = layer_attention(self.cfg, layer)
        x = constrain(tp_enter(x, "heads"), WHOLE)  # column-parallel q, k, v: local heads
        q, k, v = self.rotated(x, positions, inv_freq)

        # (Ulysses runs `local` on whole sequences: it passes their ids as `segments`)
        def local(q: jax.Array, k: jax.Array, v: jax.Array, segments: Any = segments) -> jax.Array:
            def attend(window: int) -> jax.Array:
                return causal_attention(q, k, v, segments, window, self.scale, self.softcap)

            return static_window(self.cfg, window, attend)

        # the ring (length split over `context`) takes the window as it comes, traced or not
        out = attention(q, k, v, local, segments, window, self.scale, self.softcap)
        out = dense(out, weight(self, "wo"), inputs=2)
        return constrain(tp_reduce(out, "heads"), RESIDUAL)  # row-parallel: sum the heads

    def cached_at(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over one layer's key / value cache, as Attention.cached, with layer
        `layer`'s window and rotary base."""
        window, inv_freq = layer_attention(self.cfg, layer)
        dtype = x.dtype
        q, k, v = self.rotated(x, positions, inv_freq)
        rows = jnp.arange(x.shape[0])[:, None]
        keys = constrain(keys.at[rows, positions].set(k.astype(keys.dtype)), CACHE_NAMES)
        values = constrain(values.at[rows, positions].set(v.astype(values.dtype)), CACHE_NAMES)
        out = grouped_causal_attention(
            q,
            keys.astype(dtype),
            values.astype(dtype),
            window=window,
            positions=positions,
            scale=self.scale,
            softcap=self.softcap,
        )
        return dense(out, weight(self, "wo"), inputs=2), keys, values


class MLP(llama.MLP):
    """llama.MLP's params with GeGLU (tanh GELU) in place of SwiGLU."""

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(tp_enter(x, "mlp"), WHOLE)  # column-parallel gate, up: local columns
        gate, up = dense(x, weight(self, "w_gate")), dense(x, weight(self, "w_up"))
        hidden = constrain(geglu(gate, up), ("batch", "length", "mlp"))
        out = dense(hidden, weight(self, "w_down"))
        return constrain(tp_reduce(out, "mlp"), RESIDUAL)  # row-parallel: sum the partials


class Block(nnx.Module):
    """The sandwich: x + post_attn_norm(attn(attn_norm(x))), then the same around the MLP."""

    def __init__(self, cfg: Gemma2Config, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs, plus_one=True)

        self.attn_norm, self.attn, self.post_attn_norm = norm(), GemmaAttention(cfg, rngs), norm()
        self.mlp_norm, self.mlp, self.post_mlp_norm = norm(), MLP(cfg, rngs), norm()

    def __call__(
        self, x: jax.Array, positions: jax.Array, segments: jax.Array | None, layer: jax.Array | int
    ) -> jax.Array:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, segments, layer))
        x = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        return constrain(x, RESIDUAL)

    def decode(
        self, x: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, layer: Any
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The block over one layer's key / value cache (models/llama_decode.py)."""
        attended, keys, values = self.attn.cached_at(
            self.attn_norm(x), positions, keys, values, layer
        )
        x = x + self.post_attn_norm(attended)
        x = x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        return constrain(x, RESIDUAL), keys, values


class Gemma(llama.Llama):
    """Gemma decoder: tokens [batch, length] int32 -> logits [batch, length, vocab] fp32."""

    def __init__(self, cfg: Gemma2Config, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.cfg, self.dtype = cfg, dtype
        self.embed = _param(rngs, 0.02, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"))

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs, plus_one=True)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """llama.Llama's lookup times sqrt(embed_dim), rounded to the compute dtype."""
        x = super().embed_tokens(tokens)
        return constrain(x * jnp.asarray(self.cfg.embed_dim**0.5, self.dtype), RESIDUAL)

    def apply_blocks(self, x: jax.Array, segments: jax.Array | None = None) -> jax.Array:
        """Every block in `self.blocks`, in order, each told its index from 0 (a pipeline chunk
        must hold whole periods of the local / global pattern: see the module docstring)."""
        check_whole_periods(self.blocks, self.cfg)
        if segments is None:
            positions = token_positions(x)  # global positions, also under CP
        else:  # restarting per document, from the ids in natural order under CP too
            positions = document_positions(segments, segment_positions)
        block_def, block_state = nnx.split(self.blocks)

        def layer(carry: tuple, state: nnx.State) -> tuple[tuple, None]:
            x, index = carry
            return (nnx.merge(block_def, state)(x, positions, segments, index), index + 1), None

        policy = REMAT_POLICIES[self.cfg.remat]
        start = (x, jnp.zeros((), jnp.int32))
        (x, _), _ = scan_layers(layer, start, block_state, policy, not self.cfg.scan_layers)
        return x

    def logit_softcap(self) -> float:
        """final_softcap: llama.Llama's head (fused or not) caps the logits by it."""
        return self.cfg.final_softcap


create = layers.creator(Gemma)  # (cfg, seed, dtype) -> a freshly initialised Gemma


def config_from_hf(raw: dict[str, Any], where: str, remat: str = "none") -> Gemma2Config:
    """The Gemma2Config of a Gemma2ForCausalLM config.json (models/hf_gemma2.py)."""
    cfg = Gemma2Config(**hf_gemma2.fields(raw, where, remat, hf_gemma2.GEMMA2))
    check(cfg)
    return cfg


# the llama's loss and decoder: the model's head gives the (soft-capped) logits
FAMILY = Family(
    name="gemma2",
    config=Gemma2Config,
    create=create,
    check=check,
    check_layout=check_layout,
    hf=HFMapping(
        model_types={"gemma2": hf_gemma2.GEMMA2},
        config_from_hf=config_from_hf,
        config_to_hf=hf_gemma2.config_to_hf,
        tensors=hf_gemma2.TENSORS,
    ),
)
