"""The forward pass with a key/value cache, for generation: the Decoder of every family whose
blocks have a `decode` method (llama.Block, moe.Block, ...; models/contract.py's default).

`forward(model, tokens, positions, cache)` runs tokens [batch, T] that sit at per-row
`positions` [batch, T] through the same params and maths as the model's `__call__`: its
`embed_tokens`, each block's `decode` (which writes the call's keys and values into that
layer's cache at those positions and attends over the cache: every key at a position <= the
query's, and within the sliding window of a model that has one; the cache keeps every
position, so the window is a mask, as in training) and its `head_logits`. One function serves
both phases of generation: the prefill (T = the prompt length, positions 0..T-1) and each
decoding step (T = 1, each row at its own position).

Cache slots beyond a row's current position may hold anything (padding of a shorter prompt,
slots not yet written): the mask never lets a query see them, and decoding overwrites them in
order. So prompts of different lengths are right-padded and each row keeps its own positions:
a row's tokens sit at exactly the positions they would have alone, with no offset from padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import CACHE_NAMES

if TYPE_CHECKING:
    from models.llama import LlamaConfig


def init_cache(cfg: LlamaConfig, batch: int, length: int, dtype: Any) -> dict[str, jax.Array]:
    """Zeroed keys and values: {"k", "v"} of [layers, batch, length, kv_heads, head_dim]."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward(
    model: Any, tokens: jax.Array, positions: jax.Array, cache: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Logits [batch, T, vocab] (fp32) of `tokens` [batch, T] at `positions` [batch, T], and
    the cache with their keys and values added. Each block's `decode(x, positions, keys,
    values, layer)` gets its layer's index too (int32 scalar), for families whose layers
    differ by index (local and global attention)."""
    x = model.embed_tokens(tokens)
    block_def, block_state = nnx.split(model.blocks)
    layers = jnp.arange(model.cfg.n_layers, dtype=jnp.int32)

    def layer(x: jax.Array, inputs: tuple) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        state, keys, values, index = inputs
        block = nnx.merge(block_def, state)
        x, keys, values = block.decode(x, positions, keys, values, index)
        return x, (keys, values)

    x, (keys, values) = jax.lax.scan(layer, x, (block_state, cache["k"], cache["v"], layers))
    return model.head_logits(x), {"k": keys, "v": values}


__all__ = ["CACHE_NAMES", "forward", "init_cache"]
