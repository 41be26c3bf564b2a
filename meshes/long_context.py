"""Context parallelism for long sequences: every activation's length split N ways over
`context`, attention as a ring (spmd.parallel.ring_attention), causal work load-balanced by
giving device i the sequence chunks i and 2N−1−i.

Collectives per step, per micro-batch: per layer, N−1 collective-permutes of this device's
key block and of its value block [batch, length/N, kv_heads, head_dim] in the forward and as
many of their gradients in the backward: 4(N−1)L * k sends of KV = A_kv/N bytes each, where
A_kv is one layer's keys (or values) for the whole sequence; plus one all-reduce of the
gradients (P) over context, as DDP does over data. With --remat the backward replays the
forward's sends (6(N−1)L * k); inside a pipeline each backward slot recomputes its chunk's
(spmd.estimate.theory.pipelined_ring_sends). Activation memory: 1/N of the tokens per device,
and of the attention probabilities (N + 1)/(2N²) of the t x t square (its own 2c x 2c block
and N−1 visiting 2c x c blocks, c = t/2N). Params and optimizer state replicated (combine with
fsdp=, tp=, pp= for those; `python -m spmd.plan --mesh cp=N` plans it).
"""

from meshes.preset import Preset

PRESET = Preset(
    name="long-context",
    mesh="cp=-1",
    zero=3,
    summary="context parallel (sequence split, ring attention)",
    collectives="4(N-1)L * k key/value block sends over context + all-reduce of P",
)
