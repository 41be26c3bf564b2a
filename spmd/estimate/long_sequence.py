"""The arithmetic of long sequences, shared by the planner (spmd.estimate.cost, .memory) and the
compiled-step figures (spmd.estimate.theory): one source of each formula.

Context parallelism (cp ways over `context`, spmd.parallel.ring_attention): every activation
holds 1/cp of each sequence's tokens; attention runs as a ring that sends this device's key and
value blocks [rows, seq_len / cp, kv_heads / tp, head_dim] to the next device cp − 1 times per
layer and pass. Causal work is load-balanced (device i holds chunks i and 2cp−1−i of 2cp), so
the attention probabilities kept for the backward pass are its own 2c x 2c block (c = seq_len /
2cp) and cp − 1 visiting 2c x c blocks: 2c²(cp + 1) per head and sequence, seq_len² at cp = 1.

Sequence parallelism (Megatron-SP, `tensor` ways): the residual stream between the tensor-
parallel matmuls (block input, the norms' inputs and outputs, the residual adds: 4 x embed per
token; the embedding output and the final norm) is split along length over `tensor` as well;
what the matmuls produce is split over `tensor` already. Each activation all-reduce of tensor
parallelism becomes an all-gather of the activation and a reduce-scatter of 1/tp of it (the
same bytes on the wire), and the norm weights' gradients are summed over `tensor`.

Pure arithmetic, no JAX. `model` is anything with Llama's field names. Bytes are per device.
"""

from __future__ import annotations

from typing import Any


def split_error(seq_len: int, context: int, tensor: int, sequence_parallel: bool) -> str | None:
    """Why the mesh cannot split sequences of `seq_len` tokens (None when it can): context
    parallelism cuts each in 2·cp equal chunks; sequence parallelism needs tp > 1 and each
    device's length a multiple of tp."""
    if context > 1 and seq_len % (2 * context):
        return (
            f"--seq-len {seq_len} must be a multiple of 2 x cp = {2 * context}: context "
            f"parallelism gives each device 2 of {2 * context} equal chunks"
        )
    if sequence_parallel and tensor == 1:
        return "--sequence-parallel splits the length over tensor: it needs tp > 1"
    if sequence_parallel and seq_len % (tensor * context):
        return (
            f"--seq-len {seq_len} must be a multiple of tp x cp = {tensor * context} under "
            f"--sequence-parallel"
        )
    return None


def residual_split(tensor: int, sequence_parallel: bool) -> int:
    """Ways the residual stream's length is split over `tensor`: tp under sequence
    parallelism, else 1 (replicated on every tensor device)."""
    return tensor if sequence_parallel else 1


def kv_block_bytes(
    model: Any, rows: int, seq_len: int, context: int, tensor: int, element_bytes: int
) -> float:
    """Bytes of one ring message: this device's key (or value) block, [rows, seq_len / cp,
    kv_heads / tp (replicated, so at least 1, when tp > kv_heads), head_dim]."""
    kv_heads = max(model.n_kv_heads // tensor, 1)
    return rows * (seq_len / context) * kv_heads * model.head_dim * element_bytes


def ring_passes(remat: bool, pipelined: bool) -> int:
    """Passes over each layer's ring per micro-batch: the forward, the backward (its key and
    value gradients go round the other way), the forward again when the backward replays it
    (remat), and once more when a pipeline's backward slot recomputes its chunk."""
    return 2 + int(remat) + int(pipelined)


def ring_sends(context: int, layers: int, passes: int, executions: int) -> int:
    """collective-permutes of ring attention per device: 2 (key and value) x (cp − 1) per layer
    and pass, `executions` times (micro-batches; or a pipeline's ticks)."""
    return executions * layers * passes * 2 * (context - 1)


def score_elements(heads: float, seq_len: int, context: int) -> float:
    """Attention probabilities one device keeps per sequence and layer for the backward pass:
    heads x 2c²(cp + 1), c = seq_len / 2cp (heads x seq_len² at cp = 1)."""
    c = seq_len / (2 * context)
    return heads * 2 * c * c * (context + 1)


def ring_elements(model: Any, tokens: float, tensor: int, context: int) -> float:
    """What autodiff of the ring keeps per layer beyond the layer's own activations, for
    `tokens` tokens held: each of the cp − 1 visiting key and value blocks and each ring step's
    partial output [tokens, heads, head_dim] (0 at cp = 1)."""
    heads, kv_heads = model.n_heads / tensor, max(model.n_kv_heads // tensor, 1)
    return (context - 1) * tokens * model.head_dim * (2 * kv_heads + heads)


def tensor_traffic(
    activation: float,
    calls: float,
    micro_steps: int,
    tokens: float,
    norms: tuple[int, float],
    tensor: int,
    sequence_parallel: bool,
) -> list[tuple[str, float, float, str]]:
    """(kind, bytes per call, calls per step, purpose) of tensor parallelism's activation
    collectives: `calls` all-reduces of `activation` bytes; under sequence parallelism as
    many all-gathers of it and reduce-scatters of 1/tp of it, plus per micro-batch an
    all-reduce of each norm weight's gradient (`norms`: how many, bytes of each). Either way
    the vocab-parallel cross-entropy's 3 sums of its `tokens` in fp32 per micro-batch."""
    sums = ("all-reduce", tokens * 4, 3 * micro_steps, "cross-entropy sums")
    if not sequence_parallel:
        return [("all-reduce", activation, calls, "activations"), sums]
    count, each = norms
    return [
        ("all-gather", activation, calls, "activations (SP)"),
        ("reduce-scatter", activation / tensor, calls, "activations (SP)"),
        ("all-reduce", each, count * micro_steps, "norm grads (SP)"),
        sums,
    ]


def ring_traffic(s: Any) -> tuple[float, int]:
    """(bytes per send, sends per step) of ring attention in a planned step `s` (a
    spmd.estimate.cost.Setup): per micro-batch, layer of the stage and pass a key and a value
    block to the next device cp − 1 times; (0, 0) at cp = 1."""
    context = s.mesh.get("context", 1)
    if context == 1:
        return 0.0, 0
    block = kv_block_bytes(
        s.shape, s.micro_batch, s.seq_len, context, s.mesh["tensor"], s.bytes_of("compute")
    )
    layers = s.shape.n_layers // s.mesh["pipeline"]
    passes = ring_passes(s.remat != "none", s.pipelined)
    return block, ring_sends(context, layers, passes, s.micro_steps)
