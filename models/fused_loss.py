"""The output layer and the cross-entropy fused over vocabulary chunks.

The unfused loss multiplies the final activations [batch, length, embed] by the whole head
[embed, vocab] and keeps the fp32 logits [batch, length, vocab] for the backward pass: at a
128k vocabulary and 16k tokens that is 8.4 GB, written once and read several times. Here the
head's columns are taken in chunks by a scan; each chunk's logits are reduced at once into a
running log-sum-exp (the running max and the sum of exponentials below it, rescaled when the
max grows) and into the target's logit, and are never kept: the scan's body is under
`jax.checkpoint`, so the backward pass computes each chunk's logits again from the
activations and the chunk of the head. The peak holds a few [tokens, chunk] fp32 buffers
instead of several [tokens, vocab] ones, for one more head matmul per step (4 instead of 3).

The vocabulary is cut into n = ceil(vocab / chunk) chunks. Chunk k holds the columns k, k + n,
k + 2n, ... of the vocabulary (of each device's block of it when split): a
reshape [embed, vocab] -> [embed, columns, n] keeps a vocabulary split in contiguous blocks
over `tensor` on the columns, so under the auto executor each chunk stays split the way the
head is, and under the explicit one each device chunks its own block. The losses are exact
across vocabulary shards as `llama.cross_entropy` is: the max and the sum of exponentials are
reduced over the shards (`tp_max`, `tp_sum`) and the target's logit comes from the shard that
holds it. A final soft-cap (Gemma's cap * tanh(logits / cap)) is applied to each chunk before
its log-sum-exp, as the unfused head applies it to the whole logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.layers import dense
from spmd.parallel.hooks import tp_max, tp_rank, tp_sum, tp_ways, vary_like

# The default width of a chunk (vocabulary columns): the model config's loss_chunk.
DEFAULT_CHUNK = 8192


def chunks(vocab: int, chunk: int) -> tuple[int, int]:
    """(n, columns): how many chunks of how many columns a vocabulary of `vocab` columns is
    cut into for chunks of at most `chunk` columns (the last padded)."""
    n = -(-vocab // chunk)
    return n, -(-vocab // n)


def fuses(vocab: int, chunk: int) -> bool:
    """Whether a vocabulary of `vocab` columns (the whole model's) runs chunked at `chunk`
    (0: never)."""
    return chunk > 0 and vocab > chunk


def token_losses(
    x: jax.Array, head: jax.Array, targets: jax.Array, chunk: int, softcap: float = 0.0
) -> jax.Array:
    """-log softmax(cap(x @ head))[target] per token (fp32 [batch, length]), the logits taken
    `chunk` vocabulary columns at a time and recomputed in the backward pass.

    x: final activations [batch, length, embed] (normed, and through `tp_enter` where the
    vocabulary is split); head: [embed, vocab] (this device's vocabulary block under the
    explicit executor); targets: int token ids [batch, length] (global ids); chunk: columns of
    the whole vocabulary per chunk; softcap: the logits' cap (0: none)."""
    embed, vocab = head.shape
    # As many chunks under both executors: n of the whole vocabulary's, each device holding
    # 1/ways of every chunk's columns (under auto the partitioner splits them so).
    n = chunks(vocab * tp_ways("vocab"), chunk)[0]
    columns = -(-vocab // n)
    pad = n * columns - vocab
    if pad:  # padded columns are masked to -inf below
        head = jnp.pad(head, ((0, 0), (0, pad)))
    stacked = jnp.moveaxis(head.reshape(embed, columns, n), 2, 0)  # [n, embed, columns]
    local = targets - tp_rank("vocab") * vocab  # the target's column in this device's block
    mine = (local >= 0) & (local < vocab)
    target_chunk, target_column = local % n, local // n
    column = jnp.arange(columns)
    # The activations' gradient is summed over the chunks in the scan's carry: in fp32, so that
    # a 16-bit model does not round it n times (the cast back is free in the forward pass).
    x32 = x.astype(jnp.float32)

    @jax.checkpoint
    def step(carry: tuple, chunk_in: tuple) -> tuple[tuple, None]:
        high, total, picked = carry
        weights, k = chunk_in
        logits = dense(x32.astype(x.dtype), weights).astype(jnp.float32)
        if softcap:
            logits = softcap * jnp.tanh(logits / softcap)
        if pad:
            logits = jnp.where(column * n + k < vocab, logits, -jnp.inf)
        top = jnp.maximum(high, jax.lax.stop_gradient(logits.max(axis=-1)))
        below = jnp.exp(logits - top[..., None]).sum(axis=-1)
        total = total * jnp.exp(high - top) + below
        hit = (mine & (target_chunk == k))[..., None] & (column == target_column[..., None])
        picked = picked + jnp.where(hit, logits, 0.0).sum(axis=-1)
        return (top, total, picked), None

    zeros = vary_like(jnp.zeros(targets.shape, jnp.float32), x32, stacked, local)
    start = (zeros - jnp.inf, zeros, zeros)
    (high, total, picked), _ = jax.lax.scan(step, start, (stacked, jnp.arange(n)))
    top = tp_max(high, "vocab")
    log_total = jnp.log(tp_sum(total * jnp.exp(high - top), "vocab")) + top
    return log_total - tp_sum(picked, "vocab")
