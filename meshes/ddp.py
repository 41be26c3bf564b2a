"""DDP: every device holds the whole model and optimizer state and a slice of the batch.

Collectives per step: an all-reduce of the gradients over `data`, P bytes (ring: 2(N-1)/N * P
sent), once per step whatever k. Explicit: one `pmean` of all gradients, which XLA fuses into a
single all-reduce; auto: the same P bytes in a few all-reduces. Memory per device: params,
grads and Adam state, unsplit.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="ddp",
    mesh="dp=-1",
    zero=3,  # no fsdp axis, so the stage does not matter
    summary="data parallel, state replicated",
    collectives="all-reduce of grads over data: P (ring 2(N-1)/N * P)",
)
