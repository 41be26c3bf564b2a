"""Context parallelism for long sequences: every activation's length split N ways over
`context`, attention as a ring (spmd.parallel.ring_attention), causal work load-balanced by
giving device i the sequence chunks i and 2N−1−i.

Collectives per step, per micro-batch: per layer, N−1 collective-permutes of this device's
key block and of its value block [batch, length/N, kv_heads, head_dim] in the forward and as
many of their gradients in the backward: 4(N−1)L * k sends of KV = A_kv/N bytes each, where
A_kv is one layer's keys (or values) for the whole sequence; plus one all-reduce of the
gradients (P) over context, as DDP does over data. Activation memory: 1/N of the tokens per
device, and the attention probabilities of 1/(2N) of the causal square. Params and optimizer
state replicated (combine with fsdp=, tp= for those).
"""

from meshes.preset import Preset

PRESET = Preset(
    name="long-context",
    mesh="cp=-1",
    zero=3,
    summary="context parallel (sequence split, ring attention)",
    collectives="4(N-1)L * k key/value block sends over context + all-reduce of P",
)
