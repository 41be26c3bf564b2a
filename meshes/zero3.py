"""ZeRO-3 / FSDP: params, gradients and Adam state all split N ways over `fsdp`.

Collectives per step: each layer's params are all-gathered just before use in the forward
and again in the backward (the gather is recomputed, so only one layer is ever whole), the
embedding, final norm and head once: 2k * P_L + (P - P_L) bytes of all-gather results (about
2P; ring (N-1)/N of that sent). The gradients are reduce-scattered, k * P/N bytes, one per param
tensor per layer in the backward loop: 1.5x DDP's traffic for 1/N of the memory. Explicit:
exactly these (`all_gather` in the model's `gather` hook; autodiff makes its transpose the
reduce-scatter). Auto on XLA:CPU: the same all-gathers, and the gradient reduction as
all-reduces of P bytes instead of the reduce-scatter. Memory per device: P/N of params plus one
gathered layer while it computes.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="zero3",
    mesh="fsdp=-1",
    zero=3,
    summary="fully sharded data parallel",
    collectives="all-gather of params fwd + bwd ~2P, reduce-scatter of grads P/N",
)
