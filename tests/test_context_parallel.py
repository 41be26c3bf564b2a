"""Context parallelism (`cp=` mesh axis): every activation's length split over `context`,
attention as a load-balanced causal ring (spmd.parallel.ring_attention). One compiled program
per layout, shared by the tests here:

- fp32 20-step loss and final-params parity with one device: cp=2 and dp=2,cp=2,tp=2 (with
  sequence parallelism) under `explicit`, cp=4 under `auto`;
- the explicit steps' collective-permutes are theory's: cp−1 key and value blocks per layer
  in the forward, as many gradients back; the gradient all-reduce spans `context`;
- compiled temp memory per device at cp=4 ≤ 0.35 x cp=1 where attention dominates;
- the ring's order and the flags' checks.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from spmd.checks import check_sequence_split
from spmd.errors import UsageError
from spmd.estimate import hlo, theory
from spmd.parallel.ring_attention import balanced_order
from tests import trainer

BATCH, SEQ = trainer.BATCH, trainer.SEQ_LEN
LAYOUTS = [  # (mesh, executor, sequence parallel)
    ("cp=2", "explicit", False),
    ("cp=4", "auto", False),
    ("dp=2,cp=2,tp=2", "explicit", True),
]


@functools.cache
def compiled(mesh: str, executor: str, sequence_parallel: bool = False):
    lay = dataclasses.replace(trainer.layout(mesh), sequence_parallel=sequence_parallel)
    prog = trainer.program(lay, 1, executor)
    return prog, prog.compile_train_step(BATCH, SEQ)


def test_balanced_order_gives_device_i_chunks_i_and_its_mirror():
    order = balanced_order(16, 4).reshape(4, 2, 2)  # 4 devices x 2 chunks of 2 tokens
    assert order[0].tolist() == [[0, 1], [14, 15]]
    assert order[3].tolist() == [[6, 7], [8, 9]]
    assert sorted(balanced_order(48, 3).tolist()) == list(range(48))


def test_loss_and_params_match_one_device():
    ref_losses, ref_params = trainer.train_losses(
        trainer.compiled("dp=1")[0],
        trainer.STEPS,
        trainer.initial_state(),
        trainer.compiled("dp=1")[1],
    )
    assert ref_losses[-1] < ref_losses[0] - 0.5
    for layout in LAYOUTS:
        prog, step = compiled(*layout)
        losses, params = trainer.train_losses(prog, trainer.STEPS, trainer.initial_state(), step)
        assert trainer.max_relative_difference(losses, ref_losses) <= 1e-4, layout
        leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref_params)
        for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
            np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-3, atol=2e-5)


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]])
def test_explicit_ring_sends_match_theory(layout):
    prog, step = compiled(*layout)
    colls = hlo.collectives(step, prog.layout.mesh)
    measured = hlo.collective_summary(colls)
    shape = theory.shape_of(trainer.tiny_config(), np.float32)
    expected = theory.collectives(prog, shape, BATCH, SEQ)
    assert set(measured) == set(expected)
    for kind, want in expected.items():
        assert measured[kind]["bytes"] == pytest.approx(want["bytes"], rel=0.01), kind
        assert measured[kind]["count"] <= want["count"], kind
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert {c.axes for c in permutes} == {("context",)}
    cp, n_layers = prog.layout.mesh.shape["context"], trainer.tiny_config().n_layers
    # forward: cp-1 key blocks and cp-1 value blocks per layer; backward: their gradients
    assert sum(c.bytes for c in permutes) == 4 * (cp - 1) * n_layers * permutes[0].bytes
    grads = max((c for c in colls if c.kind == "all-reduce"), key=lambda c: c.bytes)
    assert "context" in grads.axes  # the params' gradients are averaged over context too


def test_temp_memory_at_cp4_is_at_most_035_of_one_device():
    # length 256, 8 heads: the attention probabilities (8 x 256 per token) dominate the
    # activations (about 600 floats per token otherwise)
    batch, seq = 2, 256
    temps = []
    for mesh in ("dp=1", "cp=4"):
        prog = trainer.program(trainer.layout(mesh), 1, "explicit")
        temps.append(hlo.memory(prog.compile_train_step(batch, seq))["temp"])
    assert temps[1] <= 0.35 * temps[0], temps


def test_bad_context_flags_name_the_value():
    with pytest.raises(UsageError, match="--seq-len 36 must be a multiple of 2 x cp = 8"):
        check_sequence_split(36, {"context": 4}, False)
    with pytest.raises(UsageError, match="pp > 1"):
        check_sequence_split(64, {"context": 2, "pipeline": 2}, False)
    check_sequence_split(64, {"context": 4, "tensor": 2}, True)
