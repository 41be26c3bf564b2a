"""Gradient accumulation: accum k trains like one batch k times larger, and the compiled step
reduces the gradients over the replica axes once per optimizer step, not once per micro-batch."""

import functools
import math

import jax
import numpy as np
import pytest

from spmd.engine.accumulate import replica_axes
from spmd.engine.step import Program
from spmd.estimate import hlo
from spmd.parallel import rules
from spmd.parallel.mesh import build_mesh, parse_mesh
from tests.tiny_run import BATCH, EXECUTORS, SEQ_LEN, tiny_program, train_losses


def reductions_over_replicas(program: Program, compiled) -> list[hlo.Collective]:
    """Reductions in `compiled` whose groups span a replica axis (data; fsdp at ZeRO-1)."""
    replicas = set(replica_axes(program.layout.mesh, program.layout.zero_stage))
    return [
        c
        for c in hlo.collectives(compiled, program.layout.mesh)
        if c.kind in ("all-reduce", "reduce-scatter") and set(c.axes) & replicas
    ]


def grad_bytes_per_device(program: Program) -> int:
    layout = program.layout
    shardings = rules.tree_shardings(
        program.names, program.abstract_params, layout.mesh, layout.zero_stage, "grads"
    )
    return sum(
        math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf, sharding in zip(
            jax.tree.leaves(program.abstract_params), jax.tree.leaves(shardings), strict=True
        )
    )


def assert_one_gradient_reduction(program: Program, compiled) -> None:
    """Every collective over a replica axis runs once per step (outside the micro-batch and the
    layer loops) and together they move exactly the gradients and the fp32 loss."""
    over_replicas = reductions_over_replicas(program, compiled)
    assert over_replicas
    assert [c.count for c in over_replicas] == [1] * len(over_replicas)
    assert sum(c.bytes for c in over_replicas) == grad_bytes_per_device(program) + 4


@functools.cache
def one_big_batch_losses() -> np.ndarray:
    """The reference: 20 steps of accum 1 (the whole global batch at once) on one device."""
    program = tiny_program("dp=1", accum=1)
    return train_losses(program, steps=20, step_fn=program.compile_train_step(BATCH, SEQ_LEN))[0]


@pytest.mark.parametrize("executor", EXECUTORS)
# dp=2,fsdp=2 is dp and fsdp at once (HSDP: the gradients reduced once over `data`, ZeRO-3
# sharded over `fsdp` inside each replica); tp=2 is the tensor axis. Each compile costs ~10 CPU
# seconds here, so these two cover the three axes and every accumulation code path.
@pytest.mark.parametrize("mesh", ["dp=2,fsdp=2", "tp=2"])
def test_accum_4_matches_accum_1_at_the_same_global_batch(mesh, executor):
    # accum 1 on one device is the reference for every layout: the parity oracle says layouts
    # agree, so one reference run serves all and each layout compiles one program, not two.
    program = tiny_program(mesh, accum=4, executor=executor)
    compiled = program.compile_train_step(BATCH, SEQ_LEN)
    losses, _ = train_losses(program, steps=20, step_fn=compiled)
    reference = one_big_batch_losses()
    assert reference[-1] < reference[0] - 0.5  # it trains, so the comparison means something
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    if replica_axes(program.layout.mesh, program.layout.zero_stage):
        assert_one_gradient_reduction(program, compiled)


def test_replica_axes_are_the_batch_axes_gradients_are_replicated_over():
    hsdp = build_mesh(parse_mesh("dp=2,fsdp=2,tp=2"))
    assert [replica_axes(hsdp, zero) for zero in (1, 2, 3)] == [
        ("data", "fsdp"),  # ZeRO-1: grads replicated over fsdp too, so reduced once
        ("data",),  # ZeRO-2/3: grads sharded over fsdp, reduce-scattered per micro-batch
        ("data",),
    ]
    assert replica_axes(build_mesh(parse_mesh("fsdp=4,tp=2")), 3) == ()
