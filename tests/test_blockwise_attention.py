"""The blockwise (flash) attention kernel (models/blockwise_attention.py) against the dense
reference (models.attention.grouped_causal_attention): outputs and gradients of q, k and v
within 1e-5 (fp32) for documents, static and traced windows, soft-capping, a v head dim
unlike q's and grouped-query heads, with blocks small enough that every case spans many
blocks, skips some and pads the length; and the model's attention entry choosing it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.blockwise_attention import BLOCK_K, blockwise_attention
from spmd.parallel import hooks

# (documents, window, traced window, soft-cap, v head dim, kv heads of 4 query heads, length)
CASES = [
    (True, 0, False, 0.0, 8, 4, 48),  # documents only, multi-head
    (True, 5, False, 2.0, 6, 2, 40),  # documents, window, soft-cap, MLA-like dims, GQA
    (False, 13, True, 1.5, 8, 1, 37),  # traced window, soft-cap, one kv head, padded length
]


@pytest.mark.parametrize("documents, window, traced, cap, dv, kv_heads, length", CASES)
def test_blockwise_equals_the_dense_reference(documents, window, traced, cap, dv, kv_heads, length):
    rng = np.random.default_rng(length)
    q = jnp.asarray(rng.normal(size=(2, length, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, length, kv_heads, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, length, kv_heads, dv)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(2, length, 4, dv)), jnp.float32)
    segments = jnp.asarray(np.sort(rng.integers(0, 4, (2, length)), axis=1)) if documents else None
    band = jnp.int32(window) if traced else window

    def outputs_and_gradients(kernel):
        def loss(q, k, v):
            out = kernel(q, k, v)
            return jnp.sum(out * weights), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    # 8 x 16 blocks: the causal and window ranges, the document skip and the padding all run
    grads, out = outputs_and_gradients(
        lambda q, k, v: blockwise_attention(q, k, v, segments, band, 0.3, cap, 8, 16)
    )
    want_grads, want = outputs_and_gradients(
        lambda q, k, v: attention.grouped_causal_attention(q, k, v, segments, band, None, 0.3, cap)
    )
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        # the gradients grow with the sum over positions: 1e-5 of their largest
        atol = 1e-5 * max(1.0, float(jnp.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_the_model_entry_takes_the_blockwise_kernel_past_one_key_block():
    """causal_attention runs the blockwise kernel (and notes it) for a document mask that spans
    more than one key block, XLA's chunked kernel within one: shapes traced only."""
    for length, kernel in ((BLOCK_K + 64, "blockwise"), (64, "xla")):
        q = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
        segments = jax.ShapeDtypeStruct((1, length), jnp.int32)
        jax.eval_shape(lambda q, s: attention.causal_attention(q, q, q, s), q, segments)
        assert hooks.notes()["attention"] == f"{kernel} (document mask)"


def test_blockwise_runs_inside_the_explicit_executors_shard_map():
    """Split over a batch axis inside shard_map (the explicit executor's setting), the kernel
    gives the whole batch's outputs and gradients: its loop carries vary as its inputs do."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 40, h, 8)), jnp.float32) for h in (4, 2, 2))
    segments = jnp.asarray(np.sort(rng.integers(0, 3, (2, 40)), axis=1))

    def grads(q, k, v, segments):
        def loss(q, k, v):
            return jnp.sum(blockwise_attention(q, k, v, segments, 7, None, 0.0, 8, 8))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    split = jax.sharding.PartitionSpec("data")
    placed = jax.device_put((q, k, v, segments), jax.sharding.NamedSharding(mesh, split))
    sharded = jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=(split,) * 4, out_specs=(split,) * 3)
    )(*placed)
    whole = jax.jit(grads)(q, k, v, segments)
    for got, want in zip(sharded, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
