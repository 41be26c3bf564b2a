"""The arithmetic of long sequences, shared by the planner (spmd.estimate.cost, .memory) and the
compiled-step figures (spmd.estimate.theory): one source of each formula.

Context parallelism (cp ways over `context`, spmd.parallel.ring_attention): every activation
holds 1/cp of each sequence's tokens; attention runs as a ring that sends this device's key and
value blocks [rows, seq_len / cp, kv_heads / tp, head_dim] to the next device cp − 1 times per
layer and pass. Causal work is load-balanced (device i holds chunks i and 2cp−1−i of 2cp), so
the attention probabilities of one layer on one device are its own 2c x 2c block (c = seq_len /
2cp) and cp − 1 visiting 2c x c blocks: 2c²(cp + 1) per head and sequence, seq_len² at cp = 1.
The backward pass recomputes them block by block rather than keeping them.

Under --cp-mode ulysses (spmd.parallel.ulysses) attention runs instead as the one-device
kernel on whole sequences of heads / cp heads between all-to-alls: its scores are the
one-device kernel's for heads / cp heads (the causal share, one key block at a time past
ATTENTION_BLOCK), and it holds the gathered q, k, v and output (`ulysses_elements`) where
the ring holds its visiting blocks (`ring_elements`).

Sequence parallelism (Megatron-SP, `tensor` ways): the residual stream between the tensor-
parallel matmuls (block input, the norms' inputs and outputs, the residual adds: 4 x embed per
token; the embedding output and the final norm) is split along length over `tensor` as well;
what the matmuls produce is split over `tensor` already. Each activation all-reduce of tensor
parallelism becomes an all-gather of the activation and a reduce-scatter of 1/tp of it (the
same bytes on the wire), and the norm weights' gradients are summed over `tensor`.

The collectives' volumes (the ring's sends, the tensor-parallel traffic) are
spmd.estimate.volumes'. Pure arithmetic, no JAX. `model` is a spmd.model_shape.ModelShape.
"""

from __future__ import annotations

from spmd.model_shape import ATTENTION_BLOCK, ModelShape, causal_score_share

# Buffers of [tokens, heads, head_dim] the ring keeps per visiting step: fitted to the compiled
# temp memory of the tiny model at cp=4 (lengths 256 and 1024), which autodiff's merges keep.
RING_STEP_BUFFERS = 6


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


def ulysses_error(heads: int, kv_heads: int, tensor: int, context: int) -> str | None:
    """Why --cp-mode ulysses cannot split the heads over cp = `context` (None when it can):
    the query heads each tensor device holds (heads / tp) must divide by cp, and its kv heads
    (kv_heads / tp, or the one its query heads read where tp exceeds kv_heads) divide by cp
    or divide cp (each then repeated cp / kv_heads times; spmd.parallel.ulysses)."""
    local = heads // tensor
    group = heads // kv_heads  # query heads per kv head
    local_kv = kv_heads // tensor if kv_heads % tensor == 0 else max(local // group, 1)
    per = f" per tensor device (tp={tensor})" if tensor > 1 else ""
    if local % context:
        return (
            f"--cp-mode ulysses with cp={context}: the {local} query heads{per} do not divide "
            f"by cp; use a cp that divides them, or --cp-mode ring"
        )
    if local_kv % context and context % local_kv:
        return (
            f"--cp-mode ulysses with cp={context}: the {local_kv} kv heads{per} neither divide "
            f"by cp nor divide it (to be repeated); use --cp-mode ring"
        )
    return None


def residual_split(tensor: int, sequence_parallel: bool) -> int:
    """Ways the residual stream's length is split over `tensor`: tp under sequence
    parallelism, else 1 (replicated on every tensor device)."""
    return tensor if sequence_parallel else 1


def kernel_context(heads: float, context: int, mode: str) -> tuple[float, int]:
    """(heads, context) as the attention kernel sees them: the ring's own under cp_mode ring;
    under ulysses heads / cp heads of whole sequences (context 1)."""
    return (heads / context, 1) if mode == "ulysses" else (heads, context)


def score_elements(heads: float, seq_len: int, context: int) -> float:
    """Attention probabilities one device computes per sequence and layer (and recomputes in
    its backward pass): heads x 2c²(cp + 1), c = seq_len / 2cp; at cp = 1 the chunked causal
    kernel's heads x seq_len² x (n + 1) / 2n (spmd.model_shape.causal_score_share)."""
    if context == 1:
        return heads * seq_len * seq_len * causal_score_share(seq_len)
    c = seq_len / (2 * context)
    return heads * 2 * c * c * (context + 1)


def live_score_elements(heads: float, seq_len: int, context: int, mode: str = "ring") -> float:
    """Attention probabilities one device holds at once per sequence and layer: past one key
    block (cp = 1, or Ulysses' whole sequences: `mode` "ulysses") the blockwise kernel's one
    [heads, block, block] block at a time, else all it computes (score_elements)."""
    heads, context = kernel_context(heads, context, mode)
    if context == 1 and seq_len > ATTENTION_BLOCK:
        return heads * ATTENTION_BLOCK * ATTENTION_BLOCK
    return score_elements(heads, seq_len, context)


def score_share(seq_len: int, context: int, mode: str = "ring") -> float:
    """The share of each sequence's length x length attention scores the devices compute
    together (score_elements over cp devices, per head): the causal kernel's at cp = 1
    (spmd.model_shape.causal_score_share) and under Ulysses (`mode` "ulysses": that kernel on
    whole sequences), (cp + 1) / 2cp for the ring's unmasked blocks."""
    context = kernel_context(1, context, mode)[1]
    return score_elements(1, seq_len, context) * context / seq_len**2


def ring_elements(model: ModelShape, tokens: float, tensor: int, context: int) -> float:
    """What autodiff of the ring keeps per layer beyond the layer's own activations, for
    `tokens` tokens held: each of the cp − 1 visiting key and value blocks, and per ring step
    RING_STEP_BUFFERS buffers of [tokens, heads, head_dim] (the query slice, the blocks'
    partial outputs, the merged output and its rescaled halves); 0 at cp = 1."""
    heads, kv_heads = model.n_heads / tensor, max(model.n_kv_heads // tensor, 1)
    per_step = 2 * kv_heads + RING_STEP_BUFFERS * heads
    return (context - 1) * tokens * model.head_dim * per_step


def ulysses_elements(model: ModelShape, tokens: float, tensor: int, context: int) -> float:
    """What Ulysses holds per layer beyond the layer's own activations, for `tokens` tokens
    held: the all-to-alls' results, q and the output of heads / cp heads and k and v of the
    kv heads repeated to cp where fewer (spmd.estimate.volumes.ulysses_layer_bytes' shapes),
    over whole sequences: as many elements as the local q, output, k and v; 0 at cp = 1."""
    if context == 1:
        return 0.0
    heads, kv_heads = model.n_heads / tensor, max(model.n_kv_heads // tensor, 1)
    kv_heads = context if kv_heads % context else kv_heads
    return tokens * model.head_dim * 2 * (heads + kv_heads)
