"""How many collectives of which size one training step makes: one formula for each, shared by
the planner (spmd.estimate.comms) and --dry-run's figures of the compiled step
(spmd.estimate.theory), so the plan and the check against compiled HLO cannot drift apart.

Units are spmd.estimate.hlo's: bytes of each op's result on one device; counts are executions
per optimizer step. Pure arithmetic, no JAX; `shape` is a spmd.model_shape.ModelShape and
`sizes` maps mesh axis -> size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from spmd.estimate.experts import capacity, exchange_rows
from spmd.estimate.long_sequence import residual_split
from spmd.model_shape import ModelShape
from spmd.parallel import rules
from spmd.parallel.mesh import BATCH_AXES

# --- ZeRO-3 param gathers -----------------------------------------------------------------


def param_gathers(micro_steps: int, layers: int, pipelined: bool, prefetch: bool) -> int:
    """All-gathers per step of a ZeRO-3 stacked param counted as `layers` pieces: each piece
    before its forward and again for its backward in every micro-batch, a third time when a
    pipeline's backward slot recomputes its chunk. The explicit executor's prefetching layer
    scan gathers each pass's next layer one iteration ahead (L + 1 per pass, the last kept for
    the backward), and XLA hoists the first gather out of the micro-batch loop: 2L accum + 1."""
    if prefetch:
        return micro_steps * 2 * layers + 1
    return micro_steps * (2 + int(pipelined)) * layers


# --- tensor and sequence parallelism ------------------------------------------------------


def tensor_parallel_calls(executions: int, layers: int, remat: bool, pipelined: bool) -> int:
    """Megatron's activation all-reduces per step: per layer 2 forward (after the attention and
    MLP row-parallel matmuls) and 2 backward (at their column-parallel inputs), 1 more when the
    backward replays the forward (remat), 2 more when a pipeline recomputes the chunk; plus the
    vocab-parallel embedding (forward) and head (backward); each of the `executions` (the
    micro-batches, or a pipeline's ticks over one chunk of `layers`: spmd.estimate.comms'
    tensor_passes)."""
    per_layer = 4 + int(remat) + 2 * int(pipelined)
    return executions * (per_layer * layers + 2)


def tensor_traffic(
    activation: float,
    tokens: float,
    norms: tuple[int, float],
    tensor: int,
    sequence_parallel: bool,
    passes: tuple[int, int, bool, bool],
    *,
    frozen_embedding: bool = False,
) -> list[tuple[str, float, float, str]]:
    """(kind, bytes per call, calls per step, purpose) of tensor parallelism's activation
    collectives, for `passes` = (executions per step, layers, remat, pipelined): the
    `tensor_parallel_calls` all-reduces of `activation` bytes; under sequence parallelism as
    many reduce-scatters of 1/tp of it and all-gathers of it, plus one more all-gather per
    layer the backward replays (remat): the replay gathers the MLP's input as well as the
    attention's, but scatters only the attention's output (the MLP's is not needed by the
    layer's backward); and per execution an all-reduce of each norm weight's gradient
    (`norms`: how many, bytes of each). A `frozen_embedding` (LoRA) takes no gradient: under
    sequence parallelism its output's backward all-gather is not made. Either way the
    vocab-parallel cross-entropy's 3 sums of its `tokens` in fp32 per execution."""
    executions, layers, remat, _ = passes
    calls = tensor_parallel_calls(*passes)
    sums = ("all-reduce", tokens * 4, 3 * executions, "cross-entropy sums")
    if not sequence_parallel:
        return [("all-reduce", activation, calls, "activations"), sums]
    count, each = norms
    gathers = calls + executions * (layers * int(remat) - int(frozen_embedding))
    return [
        ("all-gather", activation, gathers, "activations (SP)"),
        ("reduce-scatter", activation / tensor, calls, "activations (SP)"),
        ("all-reduce", each, count * executions, "norm grads (SP)"),
        sums,
    ]


# --- pipeline -----------------------------------------------------------------------------


def stage_sends(ticks: int, activation: float, tensor: int, sequence_parallel: bool) -> tuple:
    """(sends per step, bytes each) of a pipeline stage: each tick one micro-batch's residual
    stream forward and its gradient back (a ppermute each way); `activation` is the bytes of
    one micro-batch's [rows, length / cp, embed] on a device, split over tp too under
    sequence parallelism."""
    return 2 * ticks, activation / residual_split(tensor, sequence_parallel)


# --- context parallelism (ring attention) -------------------------------------------------


def kv_block_bytes(
    shape: ModelShape, rows: int, seq_len: int, context: int, tensor: int, element_bytes: int
) -> float:
    """Bytes of one ring message: this device's key (or value) block, [rows, seq_len / cp,
    kv_heads / tp (replicated, so at least 1, when tp > kv_heads), head_dim]."""
    kv_heads = max(shape.n_kv_heads // tensor, 1)
    return rows * (seq_len / context) * kv_heads * shape.head_dim * element_bytes


def ring_passes(remat: bool, pipelined: bool) -> int:
    """Passes over each layer's ring per micro-batch: the forward, the backward (its key and
    value gradients go round the other way), the forward again when the backward replays it
    (remat), and once more when a pipeline's backward slot recomputes its chunk."""
    return 2 + int(remat) + int(pipelined)


def ring_sends(context: int, layers: int, passes: int, executions: int) -> int:
    """collective-permutes of ring attention per device: 2 (key and value) x (cp − 1) per layer
    and pass, `executions` times (micro-batches; or a pipeline's ticks)."""
    return executions * layers * passes * 2 * (context - 1)


def ulysses_layer_bytes(
    shape: ModelShape, rows: int, seq_len: int, context: int, tensor: int, element_bytes: int
) -> float:
    """Result bytes of Ulysses' 4 all-to-alls of one layer and pass (spmd.parallel.ulysses):
    q and the output [rows, seq_len / cp, heads / tp, head_dim], k and v [rows, seq_len / cp,
    kv heads, head_dim] with the kv heads per tensor device (at least 1) repeated to cp where
    fewer. Each moves (cp − 1) / cp of it over the wire."""
    heads = shape.n_heads // tensor
    kv_heads = max(shape.n_kv_heads // tensor, 1)
    kv_heads = context if kv_heads % context else kv_heads  # fewer than cp: repeated to cp
    return rows * (seq_len / context) * shape.head_dim * element_bytes * 2 * (heads + kv_heads)


# --- expert parallelism -------------------------------------------------------------------


def expert_axes(sizes: Mapping[str, int]) -> list[str]:
    """The mesh axes of size > 1 that split the experts (spmd.parallel.rules: fsdp, expert)."""
    return [a for a in rules.BASE_RULES["expert"] if sizes.get(a, 1) > 1]


def all_to_all(
    shape: ModelShape,
    sizes: Mapping[str, int],
    global_batch: int,
    seq_len: int,
    accum: int,
    remat: bool,
    element_bytes: int,
    exchanged: bool = False,
) -> dict[str, int]:
    """{"count", "bytes", "bytes_per_layer", "group"} of the MoE token all-to-alls of one step per
    device ({} without experts or when no mesh axis splits them). `bytes` is the result of each
    op, summed over the step (spmd.estimate.hlo's convention); rows: this device's sequences
    per micro-batch.

    One-hot dispatch: each op moves a buffer of experts x rows x capacity x embed elements, 4
    per layer and micro-batch (dispatch and combine, forward and backward), 2 more when the
    backward replays the forward (remat).
    Sorted rows (`exchanged`, models/moe_all_to_all.py): as many ops of ways x the peer block
    (spmd.estimate.experts.exchange_rows) x embed elements, plus per forward pass one of the
    E int32 counts per expert (no gradient)."""
    axes = expert_axes(sizes)
    if not shape.n_experts or not axes:
        return {}
    rows = global_batch // math.prod(sizes.get(a, 1) for a in BATCH_AXES) // accum
    ways = math.prod(sizes[a] for a in axes)
    calls = accum * (4 + (2 if remat else 0))
    if exchanged:
        block, _ = exchange_rows(shape, seq_len, rows, ways)
        counts = accum * (1 + int(remat))
        per_layer = calls * ways * block * shape.embed_dim * element_bytes
        per_layer += counts * shape.n_experts * 4
        calls += counts
    else:
        per_layer = calls * shape.n_experts * rows * capacity(shape, seq_len) * shape.embed_dim
        per_layer *= element_bytes
    return {
        "count": calls * shape.sparse_layers,
        "bytes": per_layer * shape.sparse_layers,
        "bytes_per_layer": per_layer,
        "group": ways,
    }
