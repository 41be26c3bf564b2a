"""The GPU kernel for document masks (models/pallas_attention.py: jax's Pallas Triton flash
attention) against the dense reference, run in Pallas' interpreter on CPU: the same outputs
and gradients for grouped-query heads and several documents a row (fp32). On a GPU the same
kernel compiles to Triton (the H100 program: docs/strategies/long-sequences.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models import pallas_attention
from models.attention import grouped_causal_attention
from spmd.api import make_mesh
from spmd.parallel import traced_layout


def test_document_attention_equals_the_dense_reference_with_its_gradients():
    batch, length, heads, kv_heads, head_dim = 2, 256, 2, 1, 16
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim)) for key in keys[1:3])
    # documents of uneven lengths, one row a single document
    starts = jax.random.bernoulli(keys[3], 0.03, (batch, length)).at[1].set(False)
    segments = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    assert int(segments[0].max()) >= 3

    def kernel(q, k, v):
        return pallas_attention.document_attention(q, k, v, segments, interpret=True)

    def reference(q, k, v):
        return grouped_causal_attention(q, k, v, segments)

    assert pallas_attention.takes(q, k, v)
    got, got_vjp = jax.vjp(kernel, q, k, v)
    want, want_vjp = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    d_out = jax.random.normal(keys[0], got.shape)
    for g, w in zip(got_vjp(d_out), want_vjp(d_out), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)


def test_the_kernel_declines_what_it_does_not_compute():
    q = jnp.zeros((1, 200, 4, 16))  # 200: not a whole number of 128-row blocks
    assert not pallas_attention.takes(q, q, q)
    mla_q, mla_v = jnp.zeros((1, 256, 4, 24)), jnp.zeros((1, 256, 4, 16))  # unlike v dims
    assert not pallas_attention.takes(mla_q, mla_q, mla_v)


@pytest.mark.parametrize("mesh_spec", ["dp=4", "dp=2,tp=2"])
def test_under_the_auto_executor_each_device_runs_its_own_shard(mesh_spec):
    """Under the auto executor the kernel runs per shard of the batch and heads
    (hooks.per_shard): a custom call XLA cannot partition would otherwise be fed every
    operand whole. Same values as one device, and no all-gather in the compiled program."""
    mesh = make_mesh(mesh_spec)
    batch, length, heads, kv_heads, head_dim = 4, 128, 4, 2, 16
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (batch, length, heads, head_dim))
    k, v = (jax.random.normal(key, (batch, length, kv_heads, head_dim)) for key in keys[1:])
    segments = jnp.repeat(jnp.arange(4, dtype=jnp.int32)[None], batch, 0).repeat(32, axis=1)

    def kernel(q, k, v, segments):
        with traced_layout.activation_layout(mesh, 0):
            return pallas_attention.document_attention(q, k, v, segments, interpret=True)

    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), None, "tensor"))
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert")))
    step = jax.jit(kernel, in_shardings=(split, split, split, rows))
    compiled = step.lower(q, k, v, segments).compile()
    assert "all-gather" not in compiled.as_text()
    want = grouped_causal_attention(q, k, v, segments)
    np.testing.assert_allclose(step(q, k, v, segments), want, rtol=1e-5, atol=1e-5)
