"""Megatron tensor parallelism with sequence parallelism (Korthikanti et al. 2022): the
megatron layout, plus the residual stream (embedding output, norms, residual adds) split
along the length N ways over `tensor` instead of replicated.

Collectives per step, per micro-batch: each of megatron's (4L + 2) * k all-reduces of an
activation A becomes an all-gather of A (into a column-parallel matmul) and a reduce-scatter
to A/N (out of a row-parallel one): the same bytes on the wire (a ring all-reduce is a
reduce-scatter then an all-gather), no all-reduce of activations left. The norm weights see
1/N of the tokens per device, so their gradients are all-reduced over tensor (2L + 1 vectors
of embed). The residual stream's activation memory is 1/N per device (pipelines pass 1/N of
it between stages). Explicit: exactly these (tiny, tp=4: 18 all-gathers of 128 KiB and 18
reduce-scatters of 32 KiB). Auto (XLA:CPU): same loss, but the partitioner keeps some
all-reduces and adds all-to-alls. `python -m spmd.plan --sequence-parallel` plans it.
"""

from meshes.preset import Preset

PRESET = Preset(
    name="megatron-sp",
    mesh="tp=-1",
    zero=3,
    summary="tensor parallel + sequence parallel (norms, residuals split along length)",
    collectives="(4L + 2) * k all-gathers of A and reduce-scatters to A/N over tensor",
    sequence_parallel=True,
)
