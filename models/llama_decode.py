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

from models import layer_groups
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
    keys, values = [], []
    for stack, run in model.layer_runs():  # runs of one kind of layer (models/layer_groups.py)
        block_def, stack_state = nnx.split(stack)
        total = jax.tree.leaves(stack_state)[0].shape[0]
        state = layer_groups.rows(stack_state, run, total)
        # the cache's rows are the model's layers (a whole cache uncut: no copy)
        whole = run.count == model.cfg.n_layers
        cached = slice(None) if whole else slice(run.first, run.first + run.count)
        layers = jnp.arange(run.first, run.first + run.count, dtype=jnp.int32)

        def layer(x: jax.Array, inputs: tuple, block_def: Any = block_def) -> tuple[Any, Any]:
            state, keys, values, index = inputs
            block = nnx.merge(block_def, state)
            x, keys, values = block.decode(x, positions, keys, values, index)
            return x, (keys, values)

        x, (k, v) = jax.lax.scan(layer, x, (state, cache["k"][cached], cache["v"][cached], layers))
        keys.append(k)
        values.append(v)
    if len(keys) > 1:
        keys, values = [jnp.concatenate(keys)], [jnp.concatenate(values)]
    cache = {"k": keys[0], "v": values[0]}
    return model.head_logits(x), cache


__all__ = ["CACHE_NAMES", "forward", "init_cache"]
