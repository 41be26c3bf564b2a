"""The Llama forward pass with a key/value cache, for generation (the MoE model's too).

`forward(model, tokens, positions, cache)` runs tokens [batch, T] that sit at per-row
`positions` [batch, T] through the same params and maths as `Llama.__call__`, writes their keys
and values into the cache at those positions and attends over the cache: every key at a
position <= the query's, and within the sliding window of a model that has one (the cache
keeps every position, so the window is a mask, as in training). One function serves both
phases of generation: the prefill (T = the prompt length, positions 0..T-1) and each decoding
step (T = 1, each row at its own position).

Cache slots beyond a row's current position may hold anything (padding of a shorter prompt,
slots not yet written): the mask never lets a query see them, and decoding overwrites them in
order. So prompts of different lengths are right-padded and each row keeps its own positions:
a row's tokens sit at exactly the positions they would have alone, with no offset from padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models import moe
from models.attention import Attention, grouped_causal_attention
from models.layers import dense
from models.llama import Block, Llama, LlamaConfig
from spmd.parallel.hooks import constrain

CACHE_NAMES = ("batch", "length", "kv_heads", None)  # of one layer's keys or values


def init_cache(cfg: LlamaConfig, batch: int, length: int, dtype: Any) -> dict[str, jax.Array]:
    """Zeroed keys and values: {"k", "v"} of [layers, batch, length, kv_heads, head_dim]."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _attend(
    attn: Attention,
    x: jax.Array,
    positions: jax.Array,
    keys: jax.Array,
    values: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Self-attention of x [b, t, embed] over one layer's cache; returns (output, keys, values)
    with this step's keys and values written at `positions`."""
    dtype = x.dtype
    q, k, v = attn.project(x, positions)
    rows = jnp.arange(x.shape[0])[:, None]
    keys = constrain(keys.at[rows, positions].set(k.astype(keys.dtype)), CACHE_NAMES)
    values = constrain(values.at[rows, positions].set(v.astype(values.dtype)), CACHE_NAMES)
    out = grouped_causal_attention(
        q, keys.astype(dtype), values.astype(dtype), window=attn.window, positions=positions
    )
    return dense(out, attn.wo[...], inputs=2), keys, values


def _mlp(block: Block | moe.Block, x: jax.Array) -> jax.Array:
    """The block's MLP: the dense one, or the MoE block's experts. Routing groups tokens per
    row of the call, so a dropless MoE model (capacity_factor 0) routes each token exactly as
    in the full forward pass: its expert outputs do not depend on the other tokens of the row.
    With a capacity factor, tokens may drop differently than in training's longer rows."""
    if isinstance(block, moe.Block):
        return block.experts(x)[0]
    return block.mlp(x)


def forward(
    model: Llama, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Logits [batch, T, vocab] (fp32) of `tokens` [batch, T] at `positions` [batch, T], and
    the cache with their keys and values added."""
    table = constrain(model.embed[...], ("vocab", "embed"))
    x = jnp.take(table, tokens, axis=0).astype(model.dtype)
    x = constrain(x, ("batch", "length", "embed"))
    block_def, block_state = nnx.split(model.blocks)

    def layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        state, keys, values = inputs
        block: Block = nnx.merge(block_def, state)
        attended, keys, values = _attend(block.attn, block.attn_norm(x), positions, keys, values)
        x = x + attended
        x = x + _mlp(block, block.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed")), (keys, values)

    x, (keys, values) = jax.lax.scan(layer, x, (block_state, cache["k"], cache["v"]))
    x = model.final_norm(x)
    head = model.embed[...].T if model.cfg.tie_embeddings else model.lm_head[...]
    logits = dense(x, head)
    logits = constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))
    return logits, {"k": keys, "v": values}
