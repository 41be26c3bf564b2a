"""The grouped matmul of the sorted MoE dispatch on GPU and TPU: rows [M, K] sorted by group,
each run of `sizes[g]` rows multiplied by its group's weights w [G, K, N] -> [M, N]. Rows past
sum(sizes) belong to no group and come out zero (the dropped pairs of a capacity factor).

Per platform (chosen while tracing, named by `kernel_name` for the run's model choices):

    hopper   jax's Pallas Mosaic GPU kernels (jax.experimental.pallas.ops.gpu): ragged_dot for
             the forward pass and the rows' gradient (transpose_rhs), transposed_ragged_dot
             for the weights' gradient, under the custom VJP below; 16-bit operands whose
             dims divide the kernels' tiles (`hopper_fits`)
    xla      jax.lax.ragged_dot, autodiff'd: TPU's grouped lowering; on a GPU XLA (jaxlib
             0.10.2) expands it densely, every row through every group (seen in the
             H100 program: a [rows, G, K] buffer), so a GPU takes it only where the Mosaic
             kernels cannot

The custom VJP is written once over a kernel triple (forward, rows' gradient, weights'
gradient), so the tests run it on CPU with jax.lax's reference kernels and check it against
autodiff of jax.lax.ragged_dot; the Mosaic kernels themselves run only on a Hopper GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# The Mosaic kernels' tiles (rows, output columns, contraction); the forward kernel also needs
# N divisible by TILE_N x GRID_BLOCK_N. Untuned: jax's own sweeps (the kernels' main()) pick
# among 64 / 128 for these on an H100; 128 x 128 x 64 fits its shared memory at 4 stages.
TILE_M, TILE_N, TILE_K, STAGES, GRID_BLOCK_N = 128, 128, 64, 4, 1
HOPPER = (9, 0)


class Kernels(NamedTuple):
    """forward(rows [M, K], w [G, K, N], sizes) -> [M, N]; rows_grad(dy [M, N], w, sizes) ->
    [M, K] (dy times each group's w transposed); weights_grad(rows, dy, sizes) -> [G, K, N]."""

    forward: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    rows_grad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
    weights_grad: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _reference_weights_grad(rows: jax.Array, dy: jax.Array, sizes: jax.Array) -> jax.Array:
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(rows, dy, sizes, numbers)


REFERENCE = Kernels(
    forward=jax.lax.ragged_dot,
    rows_grad=lambda dy, w, sizes: jax.lax.ragged_dot(dy, w.swapaxes(1, 2), sizes),
    weights_grad=_reference_weights_grad,
)


def _mosaic_kernels() -> Kernels:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    tiles: dict[str, Any] = dict(
        block_m=TILE_M,
        block_n=TILE_N,
        block_k=TILE_K,
        max_concurrent_steps=STAGES,
        grid_block_n=GRID_BLOCK_N,
    )

    def forward(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return ragged_dot_mgpu.ragged_dot(rows, w, group_sizes=sizes, **tiles)

    def rows_grad(dy: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        return ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=sizes, transpose_rhs=True, **tiles)

    def weights_grad(rows: jax.Array, dy: jax.Array, sizes: jax.Array) -> jax.Array:
        return transposed_ragged_dot_mgpu.transposed_ragged_dot(
            rows, dy, group_sizes=sizes, **tiles
        )

    return Kernels(forward, rows_grad, weights_grad)


def _in_groups(out: jax.Array, sizes: jax.Array) -> jax.Array:
    """out with the rows past every group zeroed (a kernel leaves them unwritten)."""
    return jnp.where((jnp.arange(out.shape[0]) < sizes.sum())[:, None], out, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped(rows: jax.Array, w: jax.Array, sizes: jax.Array, kernels: Kernels) -> jax.Array:
    """rows [M, K] @ w[g] for each group's run of rows -> [M, N], through `kernels`."""
    return _in_groups(kernels.forward(rows, w, sizes), sizes)


def _grouped_forward(rows: jax.Array, w: jax.Array, sizes: jax.Array, kernels: Kernels) -> tuple:
    return grouped(rows, w, sizes, kernels), (rows, w, sizes)


def _grouped_backward(kernels: Kernels, saved: tuple, dy: jax.Array) -> tuple:
    rows, w, sizes = saved
    dy = _in_groups(dy, sizes)
    d_rows = _in_groups(kernels.rows_grad(dy, w, sizes), sizes).astype(rows.dtype)
    d_w = kernels.weights_grad(rows, dy, sizes).astype(w.dtype)
    return d_rows, d_w, None


grouped.defvjp(_grouped_forward, _grouped_backward)


def hopper() -> bool:
    """Whether the first device is an NVIDIA GPU of compute capability 9.x (H100 / H200)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", "")
    return device.platform == "gpu" and str(capability).split(".")[0] == str(HOPPER[0])


def hopper_fits(k: int, n: int, dtype: jnp.dtype) -> bool:
    """Whether the Mosaic kernels take a [M, k] x [G, k, n] grouped matmul of `dtype`, its
    weights' gradient (k and n each divisible by the row and column tiles) included."""
    forward = k % TILE_K == 0 and n % (TILE_N * GRID_BLOCK_N) == 0
    rows_grad = n % TILE_K == 0 and k % (TILE_N * GRID_BLOCK_N) == 0  # contracts n, writes k
    weights_grad = k % TILE_M == 0 and n % TILE_N == 0
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return forward and rows_grad and weights_grad and sixteen_bit


def kernel_name(k: int, n: int, dtype: jnp.dtype) -> str:
    """The kernel `matmul` runs here for [M, k] x [G, k, n] of `dtype`: "pallas mosaic gpu"
    or "jax.lax.ragged_dot"."""
    if jax.default_backend() == "gpu" and hopper() and hopper_fits(k, n, dtype):
        return "pallas mosaic gpu"
    return "jax.lax.ragged_dot"


def matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows [M, K] sorted by group @ w [G, K, N] per group (`sizes` [G] int32 rows each) ->
    [M, N] in rows' dtype; rows past sum(sizes) give zero rows."""
    w = w.astype(rows.dtype)
    if kernel_name(rows.shape[1], w.shape[2], rows.dtype) == "pallas mosaic gpu":
        return grouped(rows, w, sizes, _mosaic_kernels())
    return _in_groups(jax.lax.ragged_dot(rows, w, sizes), sizes)
