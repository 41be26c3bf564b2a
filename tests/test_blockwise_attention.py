"""The blockwise (flash) attention kernel (models/blockwise_attention.py) against the dense
reference (models.attention.grouped_causal_attention): outputs and gradients of q, k and v
within 1e-5 (fp32) for documents, static and traced windows, soft-capping, attention sinks
(their gradient too), a v head dim unlike q's (MLA's) and grouped-query heads, with blocks
small enough that every case spans many blocks, skips some and pads the length; the dense
reference's sinks against the formula; and the model's attention entry choosing it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from models.blockwise_attention import BLOCK_K, blockwise_attention
from spmd.parallel import hooks

# (documents, window, traced window, soft-cap, sinks, v head dim (q's and k's: 8), kv heads
# of 4 query heads, length)
CASES = [
    (True, 0, False, 0.0, False, 8, 4, 48),  # documents only, multi-head
    (True, 5, False, 2.0, False, 6, 2, 40),  # documents, window, soft-cap, MLA-like dims, GQA
    (False, 13, True, 1.5, False, 8, 1, 37),  # traced window, soft-cap, one kv head, padded
    (False, 0, False, 0.0, True, 8, 4, 33),  # sinks alone, padded length
    (True, 0, False, 0.0, True, 8, 2, 40),  # sinks within documents
    (True, 5, False, 2.0, True, 6, 2, 40),  # every option at once: sinks, MLA dims, GQA
    (False, 13, True, 1.5, True, 12, 1, 37),  # sinks, traced window, soft-cap, v wider than q
]


@pytest.mark.parametrize("documents, window, traced, cap, sinks, dv, kv_heads, length", CASES)
def test_blockwise_equals_the_dense_reference(
    documents, window, traced, cap, sinks, dv, kv_heads, length
):
    rng = np.random.default_rng(length)
    q = jnp.asarray(rng.normal(size=(2, length, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, length, kv_heads, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, length, kv_heads, dv)), jnp.float32)
    # sinks large enough to take a real share of the rows' weight
    sink = jnp.asarray(2.0 * rng.normal(size=4), jnp.float32) if sinks else None
    weights = jnp.asarray(rng.normal(size=(2, length, 4, dv)), jnp.float32)
    segments = jnp.asarray(np.sort(rng.integers(0, 4, (2, length)), axis=1)) if documents else None
    band = jnp.int32(window) if traced else window

    def outputs_and_gradients(kernel):
        def loss(q, k, v, sink):
            out = kernel(q, k, v, sink)
            return jnp.sum(out * weights), out

        argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
        return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sink)

    # 8 x 16 blocks: the causal and window ranges, the document skip and the padding all run
    grads, out = outputs_and_gradients(
        lambda q, k, v, s: blockwise_attention(q, k, v, segments, band, 0.3, cap, 8, 16, s)
    )
    want_grads, want = outputs_and_gradients(
        lambda q, k, v, s: attention.grouped_causal_attention(
            q, k, v, segments, band, None, 0.3, cap, s
        )
    )
    assert out.shape == (2, length, 4, dv)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        # the gradients grow with the sum over positions: 1e-5 of their largest
        atol = 1e-5 * max(1.0, float(jnp.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_a_sink_takes_its_share_of_each_rows_denominator():
    """The dense reference with sinks against the definition written in numpy: each row's
    output is the sink-free one times Z / (Z + exp(sink)), Z the row's sum of exp(logits)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(1, 6, 2, 4)) for _ in range(3))
    sinks = np.array([0.5, -1.0])
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    got = attention.grouped_causal_attention(q, k, v, sinks=jnp.asarray(sinks, jnp.float32))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bthd,bshd->bhts", q, k) * 4**-0.5
    weights = np.exp(logits) * np.tril(np.ones((6, 6)))
    plain = np.einsum("bhts,bshd->bthd", weights / weights.sum(-1, keepdims=True), v)
    share = weights.sum(-1) / (weights.sum(-1) + np.exp(sinks)[None, :, None])  # [b, h, t]
    np.testing.assert_allclose(got, plain * share.transpose(0, 2, 1)[..., None], atol=1e-6)
    # XLA's chunked kernel (the entry's within one key block) passes the sinks on to it
    long = [jnp.asarray(rng.normal(size=(1, 64, 2, 4)), jnp.float32) for _ in range(3)]
    sink = jnp.asarray(sinks, jnp.float32)
    np.testing.assert_allclose(
        attention.chunked_causal_attention(*long, sinks=sink),
        attention.grouped_causal_attention(*long, sinks=sink),
        atol=1e-6,
    )


@pytest.mark.parametrize("sinks, dv, reason", [(True, 8, "sinks"), (False, 4, "MLA head dims")])
def test_the_entry_says_why_sinks_and_mla_dims_take_the_blockwise_kernel(sinks, dv, reason):
    """Neither cuDNN nor Pallas computes sinks or a v head dim unlike q's: the entry falls back
    to the blockwise kernel and its note names the reason (shapes traced only)."""
    q = jax.ShapeDtypeStruct((1, BLOCK_K + 64, 2, 8), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, BLOCK_K + 64, 2, dv), jnp.bfloat16)
    sink = jax.ShapeDtypeStruct((2,), jnp.float32) if sinks else None
    out = jax.eval_shape(lambda q, v, s: attention.causal_attention(q, q, v, sinks=s), q, v, sink)
    assert out.shape == v.shape
    assert hooks.notes()["attention"] == f"blockwise ({reason})"


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
