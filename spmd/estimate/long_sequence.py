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
token and 2 norm statistics) is split along length over `tensor` as well; everything the
matmuls produce is split over `tensor` already. Its all-gathers and reduce-scatters carry the
bytes of the all-reduces they replace.

Pure arithmetic, no JAX. `model` is anything with Llama's field names (n_layers, n_heads,
n_kv_heads, head_dim, embed_dim). Bytes are per device.
"""

from __future__ import annotations

from typing import Any


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


def residual_split(tensor: int, sequence_parallel: bool) -> int:
    """Ways the residual stream's length is split over `tensor`: tp under sequence
    parallelism, else 1 (replicated on every tensor device)."""
    return tensor if sequence_parallel else 1
