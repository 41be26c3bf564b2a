"""ZeRO-1: params and grads replicated over `fsdp`, the Adam state split N ways.

Collectives per step: an all-reduce of the gradients, P bytes (ring 2(N-1)/N * P); each device
updates its 1/N slice of the params, then an all-gather of the updated params, P bytes of
result ((N-1)/N * P sent), one per param tensor. Both executors compile to these figures.
Optimizer memory per device: 1/N.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="zero1",
    mesh="fsdp=-1",
    zero=1,
    summary="optimizer state sharded",
    collectives="all-reduce of grads P, all-gather of params P",
)
