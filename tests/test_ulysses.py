"""Ulysses attention (spmd.parallel.ulysses) through the model's hook (hooks.attention under
the auto executor's layout, traced_layout.context_attention("ulysses")) against the dense
one-device reference: outputs and the gradients of q, k and v within 1e-5 (fp32) at cp=2
and cp=4, with document masks, a static or a traced (per-layer) window, soft-capping and a
query scale, and with fewer kv heads than cp (each repeated); attention sinks at cp=2,tp=2,
each device's kernel given its heads' share. The tokens arrive in the ring's load-balanced
order, as split_sequences lays them. In training, dp=2,cp=2,tp=2 with sequence parallelism
(explicit) equals one device over 20 steps (fp32; measured 2.5e-7 loss, 1.9e-7 params), and
the compiled all-to-alls are theory's (spmd.estimate.context_theory), count and bytes, there
and at cp=4 under auto with 2 kv heads repeated to 4 and --remat full. Also the refusals of
the head counts Ulysses cannot split. (Documents at cp=4, 10 steps:
tests/test_context_parallel_documents.py.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from spmd.estimate import hlo, long_sequence, theory
from spmd.parallel import hooks, traced_layout
from spmd.parallel.ring_attention import balanced_order
from tests import test_ring_documents as ring_documents
from tests import trainer
from tests.test_ring_documents import LENGTH, inputs  # the same q, k, v and documents

# (cp, documents, window, traced window, soft-cap, kv heads of 4 query heads)
CASES = [
    (2, True, 0, False, 0.0, 2),
    (4, True, 15, False, 0.0, 4),
    (4, True, 7, True, 5.0, 2),  # Gemma's: a per-layer window, soft-cap; kv repeated to 4
    (4, False, 0, False, 0.0, 1),  # one kv head repeated to 4
]


def grads_and_output(kernel, q, k, v, weights, segments, window):
    def loss(q, k, v, window):
        out = kernel(q, k, v, segments, window)
        return jnp.sum(out * weights), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, window)


def under_ulysses(local, mesh, cp: int, q, k, v, segments, sinks=None):
    """hooks.attention under an auto layout of `mesh` in Ulysses mode, with `local(q, k, v,
    segments)` as the one-device kernel (`local(q, k, v, segments, sinks)` with its heads'
    share of `sinks` where given): the inputs laid out in the balanced order the run gives
    them, the output put back in natural order."""
    order = jnp.asarray(balanced_order(LENGTH, cp))
    ins = [jnp.take(x, order, axis=1) for x in (q, k, v)]
    ids = None if segments is None else jnp.take(segments, order, axis=1)

    def kernel(q, k, v, segments=ids, sinks=None):
        return local(q, k, v, segments) if sinks is None else local(q, k, v, segments, sinks)

    with (
        traced_layout.activation_layout(mesh, 3),
        traced_layout.context_attention("ulysses"),
    ):
        out = hooks.attention(*ins, kernel, ids, 0, sinks=sinks)
    return jnp.take(out, jnp.argsort(order), axis=1)


@pytest.mark.parametrize("cp, documents, window, traced, softcap, kv_heads", CASES)
def test_ulysses_equals_the_dense_reference(cp, documents, window, traced, softcap, kv_heads):
    q, k, v, weights, segments = inputs(documents, kv_heads)
    mesh = trainer.layout(f"cp={cp}").mesh
    scale = 0.3

    def ulysses(q, k, v, segments, window):
        def local(q, k, v, segments):
            return attention.causal_attention(q, k, v, segments, window, scale, softcap)

        return under_ulysses(local, mesh, cp, q, k, v, segments)

    def dense(q, k, v, segments, window):
        return attention.grouped_causal_attention(q, k, v, segments, window, None, scale, softcap)

    band = jnp.asarray(window, jnp.int32) if traced else window
    grads, out = grads_and_output(ulysses, q, k, v, weights, segments, band)
    want_grads, want = grads_and_output(dense, q, k, v, weights, segments, band)
    assert hooks.notes()["attention"].startswith("ulysses over context (")
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        atol = 1e-5 * max(1.0, float(jnp.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_ulysses_hands_each_device_its_heads_sinks():
    """Attention sinks through hooks.attention under Ulysses at cp=2,tp=2 (auto): the heads
    split over tensor and then over cp, each device's kernel gets its one head's sink; the
    outputs and the gradients of q, k, v and the sinks equal the dense reference's."""
    q, k, v, weights, segments = inputs(True, 2)
    sinks = jnp.asarray([1.0, -0.5, 2.0, 0.0], jnp.float32)
    mesh = trainer.layout("cp=2,tp=2").mesh

    def ulysses(q, k, v, segments, sinks):
        def local(q, k, v, segments, sinks):
            return attention.causal_attention(q, k, v, segments, sinks=sinks)

        return under_ulysses(local, mesh, 2, q, k, v, segments, sinks)

    def dense(q, k, v, segments, sinks):
        return attention.grouped_causal_attention(q, k, v, segments, sinks=sinks)

    grads, out = ring_documents.grads_and_output(ulysses, q, k, v, weights, segments, sinks)
    want_grads, want = ring_documents.grads_and_output(dense, q, k, v, weights, segments, sinks)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        atol = 1e-5 * max(1.0, float(jnp.abs(expected).max()))
        np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


def test_ulysses_refuses_heads_it_cannot_split():
    assert long_sequence.ulysses_error(8, 4, 1, 4) is None
    assert long_sequence.ulysses_error(8, 2, 1, 4) is None  # kv heads repeated
    assert long_sequence.ulysses_error(8, 4, 2, 2) is None  # 4 heads, 2 kv per tp device
    assert "6 query heads do not divide" in long_sequence.ulysses_error(6, 2, 1, 4)
    assert "3 kv heads neither" in long_sequence.ulysses_error(12, 3, 1, 4)
    assert "per tensor device (tp=2)" in long_sequence.ulysses_error(8, 4, 2, 8)


@functools.cache
def compiled(mesh: str, executor: str, sequence_parallel: bool, **overrides):
    lay = dataclasses.replace(
        trainer.layout(mesh), cp_mode="ulysses", sequence_parallel=sequence_parallel
    )
    prog = trainer.program(lay, 1, executor, **overrides)
    return prog, prog.compile_train_step(trainer.BATCH, trainer.SEQ_LEN)


def assert_all_to_alls_are_theorys(prog, step, **overrides) -> None:
    measured = hlo.collective_summary(hlo.collectives(step, prog.layout.mesh))["all-to-all"]
    shape = dataclasses.replace(trainer.tiny_config(), **overrides).shape()
    want = theory.collectives(prog, shape, trainer.BATCH, trainer.SEQ_LEN)["all-to-all"]
    assert measured["axes"] == ["context"]
    assert measured["count"] == want["count"]  # 4 per layer and pass
    assert measured["bytes"] == pytest.approx(want["bytes"], rel=0.01)


def test_ulysses_with_tensor_and_sequence_parallelism_equals_one_device():
    prog, step = compiled("dp=2,cp=2,tp=2", "explicit", True)
    assert hooks.notes()["attention"] == "ulysses over context (xla)"  # traced just now
    losses, params = trainer.train_losses(prog, trainer.STEPS, trainer.initial_state(), step)
    want_losses, want_params = trainer.losses("dp=1")
    assert trainer.max_relative_difference(losses, want_losses) <= 1e-5
    for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(leaf, want, rtol=0, atol=1e-5)
    assert_all_to_alls_are_theorys(prog, step)


def test_ulysses_all_to_alls_with_repeated_kv_heads_and_remat_are_theorys():
    overrides = {"n_kv_heads": 2, "remat": "full"}  # 2 kv heads repeated to cp=4; a replay
    prog, step = compiled("cp=4", "auto", False, **overrides)
    assert_all_to_alls_are_theorys(prog, step, **overrides)


def test_a_kernel_run_per_shard_runs_inside_ulysses_under_auto():
    """The GPU's Pallas kernel maps itself over the batch and heads (hooks.per_shard); inside
    Ulysses' shard_map under auto it must run on its shard rather than map again (which
    fails: a shard_map over the whole mesh inside one manual over context). Here the dense
    kernel through per_shard at dp=2,cp=2,tp=2, gradients against one device."""
    q, k, v, weights, segments = inputs(True, 2)
    q, k, v, weights, segments = (
        jnp.concatenate([x, x[::-1]]) for x in (q, k, v, weights, segments)
    )
    mesh = trainer.layout("dp=2,cp=2,tp=2").mesh
    heads, kv = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)

    def ulysses(q, k, v, segments, window):
        def local(q, k, v, segments):
            names = (heads, kv, kv, ("batch", None))
            return hooks.per_shard(
                attention.grouped_causal_attention, q, k, v, segments, names=names
            )

        return under_ulysses(local, mesh, 2, q, k, v, segments)

    def dense(q, k, v, segments, window):
        return attention.grouped_causal_attention(q, k, v, segments)

    grads, out = grads_and_output(ulysses, q, k, v, weights, segments, 0)
    want_grads, want = grads_and_output(dense, q, k, v, weights, segments, 0)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(
            got, expected, rtol=0, atol=1e-5 * float(jnp.abs(expected).max())
        )
