"""Megatron tensor parallelism: attention heads, MLP columns and the vocabulary split N ways
over `tensor`.

Collectives per step, per micro-batch: per layer, all-reduces of one activation A after the
attention output and MLP down projections (row parallel, forward) and at the inputs of the
column-parallel q/k/v and gate/up projections (backward), plus one for the vocab-parallel
embedding (forward) and one for the head's input (backward): (4L + 2) * k all-reduces of A
bytes, independent of the parameter count; with --remat the backward replays the attention's
(+L). The vocab-parallel cross-entropy adds 3 all-reduces of [batch, length] scalars. With more
devices than kv heads the kv heads are replicated, adding an all-reduce of their gradients per
layer. Params and Adam state: 1/N per device (norm scales replicated). Explicit: exactly
these. Auto: about 1.26x these bytes for tiny on tp=8, with all-gathers of the replicated kv
heads' activations.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="megatron",
    mesh="tp=-1",
    zero=3,
    summary="tensor parallel (heads, MLP, vocab)",
    collectives="(4L + 2) * k all-reduces of activations A over tensor",
)
