"""x [..., *in] @ w [*in, *out] the way both XLA backends like it: one 2-D matmul of merged
rows, or features alone where the auto executor splits the length.

The 2-D form [rows, in] @ [in, out] makes the backward pass's weight gradient contract one
merged rows dim: XLA:CPU lowers an einsum's gradient, which contracts batch and length
separately, to transposed copies around the matmul, and a Llama MLP's forward + backward ran
1.9x slower that way (docs/speed.md). But where XLA's partitioner splits the length (context
parallelism under the auto executor) it cannot split the merged rows dim, and gathers the
whole sequence for it (tiny, cp=4: 10.1 MiB of all-gathers per step, none otherwise), so
there the matmul contracts the features and keeps batch and length apart.
"""

from __future__ import annotations

import math

import jax

from spmd.parallel.hooks import length_split_by_partitioner


def matmul(x: jax.Array, w: jax.Array, inputs: int = 1) -> jax.Array:
    """x [..., *in] times w [*in, *out] (its first `inputs` dims contracted) -> [..., *out], in
    x's dtype."""
    lead, ins, outs = x.shape[: x.ndim - inputs], w.shape[:inputs], w.shape[inputs:]
    matrix = w.astype(x.dtype).reshape(math.prod(ins), math.prod(outs))
    if len(lead) > 1 and length_split_by_partitioner():
        flat = x.reshape(*lead, math.prod(ins))
        y = jax.lax.dot_general(flat, matrix, (((len(lead),), (0,)), ((), ())))
    else:
        y = x.reshape(math.prod(lead), math.prod(ins)) @ matrix
    return y.reshape(*lead, *outs)
