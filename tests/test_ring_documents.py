"""Ring attention (spmd.parallel.ring_attention) with document masks and sliding windows
against the dense one-device reference (models.attention.grouped_causal_attention), also
with a query scale and soft-capping (Gemma's), a v head dim unlike q's (MLA's) and attention
sinks (GPT-OSS's): outputs and the gradients of q, k, v (and the sinks) within 1e-5 (fp32)
at cp=2 and cp=4 under shard_map, the inputs laid out in the ring's load-balanced order; and
the rotary positions that restart per document, computed from the balanced-order ids, equal
the one-device ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from models import attention
from spmd.parallel import hooks, traced_layout
from spmd.parallel.ring_attention import balanced_order, ring_attention
from tests import trainer

LENGTH = 48  # 2 x cp chunks of 12 (cp=2) or 6 (cp=4) positions

# (cp, documents, window, kv heads of 4 query heads, scale (None: d ** -0.5), soft-cap, v's
# head dim (q's and k's: 8), attention sinks)
CASES = [
    (2, True, 0, 2, None, 0.0, 8, False),
    (4, True, 0, 1, None, 0.0, 8, False),
    (4, False, 7, 2, None, 0.0, 8, False),  # a window shorter than a chunk: far blocks masked
    (4, True, 15, 4, None, 0.0, 8, False),
    (2, True, 7, 2, 0.9, 1.5, 8, False),  # Gemma 2's: documents, a window, scale and soft-cap
    (4, True, 0, 2, None, 0.0, 6, False),  # MLA's v head dim unlike q's and k's
    (4, True, 7, 2, None, 1.5, 6, True),  # GPT-OSS's sinks, with documents, window, MLA dims
]


def inputs(documents: bool, kv_heads: int, dv: int = 8) -> tuple:
    rng = np.random.default_rng(kv_heads)
    q = jnp.asarray(rng.normal(size=(2, LENGTH, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, LENGTH, kv_heads, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, LENGTH, kv_heads, dv)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(2, LENGTH, 4, dv)), jnp.float32)
    # several documents per sequence, some shorter than a chunk, one spanning chunks
    segments = np.sort(rng.integers(0, 7, (2, LENGTH)), axis=1) if documents else None
    return q, k, v, weights, None if segments is None else jnp.asarray(segments, jnp.int32)


def ring_mesh(cp: int) -> jax.sharding.Mesh:
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((cp,), ("context",), axis_types=auto, devices=jax.devices()[:cp])


def grads_and_output(kernel, q, k, v, weights, segments, sinks=None):
    """(gradients of q, k, v and the sinks where given; output) of kernel(q, k, v, segments,
    sinks)."""

    def loss(q, k, v, sinks):
        out = kernel(q, k, v, segments, sinks)
        return jnp.sum(out * weights), out

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    return jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)


@pytest.mark.parametrize("cp, documents, window, kv_heads, scale, cap, dv, sinks", CASES)
def test_ring_with_documents_and_windows_equals_the_dense_reference(
    cp, documents, window, kv_heads, scale, cap, dv, sinks
):
    q, k, v, weights, segments = inputs(documents, kv_heads, dv)
    sink = jnp.asarray([1.0, -0.5, 2.0, 0.0], jnp.float32) if sinks else None
    mesh = ring_mesh(cp)
    spec = PartitionSpec(None, "context")
    order = jnp.asarray(balanced_order(LENGTH, cp))

    def ring(q, k, v, segments, sinks):
        # the ring's layout: tokens (and their document ids) in the load-balanced order
        ins = [jnp.take(x, order, axis=1) for x in (q, k, v)]
        ids = () if segments is None else (jnp.take(segments, order, axis=1),)
        sink = () if sinks is None else (sinks,)  # every device holds all of them

        def kernel(q, k, v, *rest):
            segments, sinks = (rest[0] if ids else None), (rest[-1] if sink else None)
            return ring_attention(q, k, v, "context", cp, segments, window, scale, cap, sinks=sinks)

        out = jax.shard_map(
            kernel,
            mesh=mesh,
            in_specs=(spec,) * (3 + len(ids)) + (PartitionSpec(),) * len(sink),
            out_specs=spec,
            check_vma=True,
        )(*ins, *ids, *sink)
        return jnp.take(out, jnp.argsort(order), axis=1)  # back in the natural order

    def dense(q, k, v, segments, sinks):
        return attention.grouped_causal_attention(
            q, k, v, segments, window, None, scale, cap, sinks
        )

    grads, out = grads_and_output(ring, q, k, v, weights, segments, sink)
    want_grads, want = grads_and_output(dense, q, k, v, weights, segments, sink)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        atol = 1e-5 * max(1.0, float(jnp.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_the_ring_without_documents_differs_from_the_document_reference():
    """The oracle above can fail: the same ring without the ids is off the masked reference."""
    q, k, v, _, segments = inputs(True, 2)
    order = jnp.asarray(balanced_order(LENGTH, 2))
    mesh = ring_mesh(2)
    spec = PartitionSpec(None, "context")
    out = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, "context", 2),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )(*(jnp.take(x, order, axis=1) for x in (q, k, v)))
    want = attention.grouped_causal_attention(q, k, v, segments)
    assert float(jnp.abs(jnp.take(out, jnp.argsort(order), axis=1) - want).max()) > 1e-2


@pytest.mark.parametrize("manual", [True, False])
def test_document_positions_under_context_parallelism_are_the_one_device_ones(manual):
    """hooks.document_positions of the balanced-order ids (each device's own chunks under a
    shard_map manual over `context`, or the whole permuted row under the auto executor's
    jit) equal segment_positions of the natural order, permuted the same way."""
    cp = 4
    _, _, _, _, segments = inputs(True, 2)
    order = balanced_order(LENGTH, cp)
    want = np.asarray(attention.segment_positions(segments))[:, order]
    permuted = jnp.take(segments, jnp.asarray(order), axis=1)
    mesh = trainer.layout(f"cp={cp}").mesh  # every mesh axis, as the engine's
    spec = PartitionSpec(None, "context")
    opened = traced_layout.manual_context if manual else traced_layout.activation_layout
    with opened(mesh) if manual else opened(mesh, 1):
        if manual:
            got = jax.shard_map(
                lambda s: hooks.document_positions(s, attention.segment_positions),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )(jax.device_put(permuted, NamedSharding(mesh, spec)))
        else:
            got = jax.jit(lambda s: hooks.document_positions(s, attention.segment_positions))(
                permuted
            )
    np.testing.assert_array_equal(np.asarray(got), want)
    # not the positions of the permuted row read as if it were in order
    assert not np.array_equal(np.asarray(attention.segment_positions(permuted)), want)
