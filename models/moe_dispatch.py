"""Sort-based MoE dispatch: each (token, choice) pair's row goes to its expert through one
grouped buffer, the experts run as a grouped matmul over per-expert group sizes, and the
weighted outputs are added back to their tokens. Only routed rows are computed (plus the
bounded padding of the CPU kernel below), where the one-hot einsum dispatch of
`models.moe.Experts.reference` computes E x capacity slots per sequence.

Groups are sequences, as in the reference: within a sequence an expert takes at most
`capacity` pairs in token order (token 0's choices, then token 1's, ...), and the pairs past it
are dropped (they add nothing). A stable sort of each sequence's pairs by expert keeps them in
that order, so a pair's place in its expert's queue is its rank in the sorted order less the
start of its expert's run: the same pairs drop as in the reference.

The grouped matmul, chosen while tracing and recorded with `note("moe_dispatch", ...)`:

    hopper     the pairs of the whole batch sorted by expert through jax's Pallas Mosaic GPU
               grouped kernels (models.grouped_matmul, under a custom VJP), where the dims
               fit their tiles and the dtype is 16-bit; seen in the H100 program, not yet run
    tpu        the same through jax.lax.ragged_dot, TPU's grouped lowering (not run yet); the
               CPU tests run `ragged_swiglu` (ragged_dot, densely) against the kernel below
    cpu, gpu   XLA:CPU, and XLA:GPU where the Hopper kernels do not apply, lower ragged_dot
               densely (every row through every expert: E x the
               FLOPs), so here each sequence's expert groups are padded to a multiple of
               BLOCK_ROWS and a scan over the blocks multiplies each block by its own expert's
               weights (BLOCK_ROWS: spmd.model_shape.MOE_BLOCK_ROWS). Padding: at most
               min(E, pairs) x (BLOCK_ROWS - 1) rows per sequence; the scan's trip count is
               fixed at trace time by that bound (spmd.model_shape.moe_grouped_rows), so the
               experts cost at most (pairs + E x (BLOCK_ROWS - 1)) / pairs x the routed rows'
               FLOPs. The backward pass gathers each block's weights again (a checkpointed
               scan body) instead of keeping n_blocks copies of them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from models import grouped_matmul
from models.layers import swiglu
from spmd.model_shape import MOE_BLOCK_ROWS as BLOCK_ROWS
from spmd.model_shape import moe_grouped_rows
from spmd.parallel.hooks import note, per_shard, tp_enter, tp_reduce

# the experts' activation: (gate, up) [..., mlp] -> hidden [..., mlp]; models.layers.swiglu,
# or GPT-OSS's clamped one (models/gpt_oss_experts.py)
Activation = Callable[[jax.Array, jax.Array], jax.Array]


def kept_pairs(experts: jax.Array, n_experts: int, capacity: int, length: int) -> jax.Array:
    """experts [b, pairs] int (token-major: token 0's choices, then token 1's; `length` tokens)
    -> [b, pairs] bool: whether the pair is within its expert's capacity in its sequence, in
    token order. (One sequence at a time under vmap: a scatter indexed by the sequence made
    XLA's partitioner all-gather the batch's choices where the batch is split.)"""
    b, pairs = experts.shape
    if capacity >= length:  # a token picks an expert at most once: nothing can drop
        return jnp.ones((b, pairs), bool)

    def sequence(chosen: jax.Array) -> jax.Array:
        order = jnp.argsort(chosen, stable=True)
        ranked = chosen[order]
        counts = jnp.bincount(chosen, length=n_experts)
        starts = jnp.cumsum(counts) - counts
        position = jnp.arange(pairs) - starts[ranked]
        return jnp.zeros(pairs, bool).at[order].set(position < capacity)

    return jax.vmap(sequence)(experts)


def kernel(d: int, m: int, dtype: jnp.dtype) -> str:
    """The grouped matmul this platform runs for experts d -> m -> d in `dtype`, as the
    recorded choice names it: the Hopper kernels or TPU's ragged_dot, else the blocked one
    (XLA:CPU and XLA:GPU lower ragged_dot densely)."""
    backend = jax.default_backend()
    name = grouped_matmul.kernel_name(d, m, dtype)
    if name == grouped_matmul.kernel_name(m, d, dtype) and (
        backend == "tpu" or name == "pallas mosaic gpu"
    ):
        return f"{name} ({backend})"
    return f"blocked grouped matmul ({backend}, {BLOCK_ROWS}-row blocks)"


def grouped_swiglu(
    x: jax.Array,
    experts: jax.Array,
    kept: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *biases: jax.Array,
    record: bool = True,
    act: Activation = swiglu,
) -> jax.Array:
    """x [b, t, d]; experts, kept [b, t x k] (token-major pairs) -> each pair's expert output
    [b, t x k, d] (zero for a dropped pair). Weights [E, d, m], [E, d, m], [E, m, d]; `biases`
    none, or each expert's of gate, up and down ([E, m], [E, m], [E, d]: GPT-OSS's); `act` the
    activation of (gate, up). `record`: note the kernel as the run's dispatch (the all-to-all
    dispatch notes its own)."""
    # (a param may hold a numpy array outside jit, which a traced index cannot index)
    w_gate, w_up, w_down = jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(w_down)
    biases = tuple(jnp.asarray(b) for b in biases)
    chosen = kernel(w_gate.shape[1], w_gate.shape[2], x.dtype)
    if record:
        note("moe_dispatch", f"sorted, {chosen}")
    if chosen.startswith("blocked"):
        return blocked_swiglu(x, experts, kept, w_gate, w_up, w_down, *biases, act=act)
    # per device under the auto executor: XLA can partition neither the batch-wide sort nor a
    # Pallas call, and would run the global batch on every device (under auto with tp the
    # experts' weights arrive whole, each device running all of their hidden dim)
    tokens, pairs, whole = ("batch", None, None), ("batch", None), (None, None, None)
    return per_shard(
        functools.partial(ragged_swiglu, act=act),
        *(x, experts, kept, w_gate, w_up, w_down, *biases),
        names=(tokens, pairs, pairs, whole, whole, whole, *[(None, None)] * len(biases)),
    )


def ragged_swiglu(
    x: jax.Array,
    experts: jax.Array,
    kept: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *biases: jax.Array,
    act: Activation = swiglu,
) -> jax.Array:
    """The grouped kernel of GPU / TPU (models.grouped_matmul): the batch's pairs sorted by
    expert (dropped pairs last, outside every group), one grouped matmul per weight (each
    row's expert's biases added after it, where there are biases)."""
    b, t, d = x.shape
    n = w_gate.shape[0]
    pairs = experts.shape[1]
    key = jnp.where(kept, experts, n).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
    tokens = (order // pairs) * t + (order % pairs) // (pairs // t)
    rows = tp_enter(x.reshape(b * t, d)[tokens], "mlp")
    dt = x.dtype
    b_gate, b_up, b_down = (
        [b[jnp.minimum(key[order], n - 1)].astype(dt) for b in biases] if biases else (0, 0, 0)
    )
    gate = grouped_matmul.matmul(rows, w_gate.astype(dt), sizes) + b_gate
    up = grouped_matmul.matmul(rows, w_up.astype(dt), sizes) + b_up
    out = tp_reduce(grouped_matmul.matmul(act(gate, up), w_down.astype(dt), sizes), "mlp")
    out = out + b_down  # after the row-parallel sum: once
    out = jnp.where((key[order] < n)[:, None], out, 0)  # rows past the groups: dropped pairs
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return out[back].reshape(b, pairs, d)


def blocked_swiglu(
    x: jax.Array,
    experts: jax.Array,
    kept: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *biases: jax.Array,
    act: Activation = swiglu,
) -> jax.Array:
    """The CPU kernel: per sequence, each pair gets a slot in a buffer where every expert's
    group starts on a block boundary; a scan over blocks runs each with its expert's weights
    (and biases, where there are: grouped_swiglu's)."""
    b, t, d = x.shape
    n = w_gate.shape[0]
    pairs = experts.shape[1]
    slots = moe_grouped_rows(pairs, n)  # always holds every group, each padded
    n_blocks = slots // BLOCK_ROWS
    key = jnp.where(kept, experts, n)  # dropped pairs sort last, into no group
    order = jnp.argsort(key, axis=-1, stable=True)
    ranked = jnp.take_along_axis(key, order, axis=-1)
    sizes = jax.vmap(lambda e: jnp.bincount(e, length=n + 1))(key)[:, :n]
    padded = -(-sizes // BLOCK_ROWS) * BLOCK_ROWS
    ends = jnp.cumsum(padded, axis=-1)
    starts = jnp.concatenate([jnp.zeros((b, 1), ends.dtype), ends], axis=-1)  # [b, E + 1]
    group_starts = jnp.concatenate([jnp.zeros((b, 1), sizes.dtype), jnp.cumsum(sizes, -1)], -1)
    # a pair's slot: its group's padded start + its rank within the group; dropped: `slots`
    rank = jnp.arange(pairs) - jnp.take_along_axis(group_starts, ranked, axis=-1)
    slot_sorted = jnp.where(ranked < n, jnp.take_along_axis(starts, ranked, -1) + rank, slots)
    seqs = jnp.arange(b)[:, None]
    slot = jnp.zeros((b, pairs), jnp.int32).at[seqs, order].set(slot_sorted.astype(jnp.int32))
    # which token fills each slot (t: a zero row, for padding)
    token = (
        jnp.full((b, slots), t, jnp.int32)
        .at[seqs, slot]
        .set(
            jnp.broadcast_to(jnp.arange(pairs, dtype=jnp.int32) // (pairs // t), (b, pairs)),
            mode="drop",
        )
    )
    padded_x = jnp.concatenate([x, jnp.zeros((b, 1, d), x.dtype)], axis=1)
    grouped = jnp.take_along_axis(padded_x, token[..., None], axis=1)  # [b, slots, d]
    grouped = tp_enter(grouped, "mlp")  # column-parallel gate and up inside each expert
    # each block's expert: the group whose padded run holds the block's first slot
    first = jnp.arange(n_blocks) * BLOCK_ROWS
    # (searchsorted's side="right" as a count: jnp.searchsorted fails under shard_map when
    # `ends` varies over a mesh axis and `first` does not, jax 0.10.2)
    block_expert = (ends[:, None, :] <= first[None, :, None]).sum(-1)
    block_expert = jnp.minimum(block_expert, n - 1)  # blocks past the groups: all padding
    blocks = grouped.reshape(b, n_blocks, BLOCK_ROWS, d).swapaxes(0, 1)
    dt = x.dtype

    def block(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        rows, expert = xs  # [b, BLOCK_ROWS, d], [b]
        gate = jnp.einsum("bsd,bdm->bsm", rows, w_gate[expert].astype(dt))
        up = jnp.einsum("bsd,bdm->bsm", rows, w_up[expert].astype(dt))
        if biases:
            gate = gate + biases[0][expert, None].astype(dt)
            up = up + biases[1][expert, None].astype(dt)
        return None, jnp.einsum("bsm,bmd->bsd", act(gate, up), w_down[expert].astype(dt))

    # the backward pass gathers each block's weights again rather than keeping them: kept, they
    # would be n_blocks x an expert's three matrices (E x 128 rows' worth of weight copies)
    block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)
    _, out = jax.lax.scan(block, None, (blocks, block_expert.T))
    out = tp_reduce(out.swapaxes(0, 1).reshape(b, slots, d), "mlp")  # row-parallel sum
    if biases:  # each slot's block's expert's down bias, once after the sum
        slot_expert = jnp.repeat(block_expert, BLOCK_ROWS, axis=-1)  # [b, slots]
        out = out + biases[2][slot_expert].astype(out.dtype)
    out = jnp.concatenate([out, jnp.zeros((b, 1, d), out.dtype)], axis=1)  # slot `slots`: 0
    return jnp.take_along_axis(out, slot[..., None], axis=1)  # [b, pairs, d]
