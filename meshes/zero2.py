"""ZeRO-2: params replicated over `fsdp`; gradients and Adam state split N ways.

Collectives per step: a reduce-scatter of the gradients, P/N bytes of result per device
((N-1)/N * P sent), the update of the local slice, then an all-gather of the params, P bytes
((N-1)/N * P sent): the traffic of DDP's all-reduce. Explicit: exactly these, one
`psum_scatter` and one `all_gather` per param tensor. Auto on XLA:CPU: the reduce-scatter shows
as an all-reduce of P bytes (8 ops for the tiny model), the all-gather as above.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="zero2",
    mesh="fsdp=-1",
    zero=2,
    summary="gradients and optimizer state sharded",
    collectives="reduce-scatter of grads P/N, all-gather of params P",
)
