"""Precision policies: bf16 computes in bf16 on fp32 master weights; fp16's dynamic loss scale
skips overflowing steps without touching the state, then training goes on."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd import train
from spmd.engine import precision
from spmd.engine.optim import lr_schedule
from spmd.engine.step import Program
from spmd.estimate import hlo
from spmd.training import loop
from tests.tiny_run import (
    BATCH,
    EXECUTORS,
    SEQ_LEN,
    batch_at,
    initial_state,
    text_windows,
    tiny_program,
    tiny_train_config,
    train_losses,
)


def lowered_step(program: Program):
    """The train step as traced and lowered, before XLA optimizes it (no compile)."""
    return program.lower_train_step(BATCH, SEQ_LEN)


def test_bf16_trains_bf16_working_params_on_fp32_master_weights():
    program = tiny_program("dp=2", policy="bf16")
    compiled = program.compile_train_step(BATCH, SEQ_LEN)
    losses, (params, opt_state, loss_scale) = train_losses(program, steps=20, step_fn=compiled)
    assert losses[-1] < losses[0] - 0.5
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    state_dtypes = {leaf.dtype for leaf in jax.tree.leaves(opt_state) if leaf.ndim}
    assert state_dtypes == {jnp.dtype(jnp.float32)}
    # The working params are the master weights rounded to bf16, leaf by leaf.
    master = jax.device_get(opt_state["master"])
    for working, fp32 in zip(
        jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(master), strict=True
    ):
        np.testing.assert_array_equal(working, fp32.astype(jnp.bfloat16))
    assert float(loss_scale["scale"]) == 1.0 and int(loss_scale["skipped_steps"]) == 0

    # What the step asks for: every matmul (forward and backward) takes bf16 input; only the
    # attention backward pairs an fp32 cotangent of its fp32 logits with a bf16 operand.
    dots = [operands for _, operands in hlo.dot_dtypes(lowered_step(program))]
    assert dots and all("bf16" in operands for operands in dots)
    assert sum(operands == ("bf16", "bf16") for operands in dots) > len(dots) * 0.8
    # (What XLA:CPU compiles differs: it upcasts bf16 dots to fp32; GPUs keep them bf16.)

    fp32 = lowered_step(tiny_program("dp=2", policy="fp32"))
    assert {operands for _, operands in hlo.dot_dtypes(fp32)} == {("f32", "f32")}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fp16_overflow_skips_the_step_halves_the_scale_then_training_continues(executor):
    policy = dataclasses.replace(precision.POLICIES["fp16"], growth_interval=3)
    program = tiny_program("dp=2", accum=2, policy=policy, executor=executor)
    step_fn = program.compile_train_step(BATCH, SEQ_LEN)
    windows = text_windows()
    params, opt_state, loss_scale = initial_state(program)
    assert float(loss_scale["scale"]) == 2.0**15

    params, opt_state, loss_scale, metrics = step_fn(
        params, opt_state, loss_scale, batch_at(program, windows, 0)
    )
    assert int(metrics["skipped_steps"]) == 0 and np.isfinite(float(metrics["loss"]))
    first_loss = float(metrics["loss"])

    # Inject an overflow: each replica's micro-batch loss is a mean over `tokens` tokens, so the
    # scaled loss's cotangent at a target logit is scale (1 - p) / tokens, beyond the largest
    # fp16 (65504) while p < 1/2: the backward pass overflows, the gradients come back inf/nan.
    tokens = BATCH // (2 * 2) * SEQ_LEN  # dp=2, accum=2
    overflow = 2.0**24
    assert overflow * 0.5 / tokens > 65504
    loss_scale = {**loss_scale, "scale": jnp.float32(overflow)}
    before = jax.device_get((params, opt_state))
    params, opt_state, loss_scale, metrics = step_fn(
        params, opt_state, loss_scale, batch_at(program, windows, 1)
    )
    assert int(metrics["skipped_steps"]) == 1
    assert float(metrics["loss_scale"]) == float(loss_scale["scale"]) == overflow / 2
    assert not np.isfinite(float(metrics["grad_norm"]))
    run = tiny_train_config()
    schedule = lr_schedule(run.optimizer, run.run.steps, run.run.batch)
    record = loop.train_record(2, jax.device_get(metrics), 0.1, schedule, BATCH * SEQ_LEN)
    assert record["loss_scale"] == overflow / 2 and record["skipped_steps"] == 1
    assert record["lr"] == float(schedule(0))  # one update applied so far: schedule held still
    after = jax.device_get((params, opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # params and Adam state as were

    # Training continues: the scale halves until the gradients fit, steps apply again, and
    # after `growth_interval` finite steps in a row the scale grows.
    scales, skipped, losses = [], [], []
    for step in range(2, 16):
        params, opt_state, loss_scale, metrics = step_fn(
            params, opt_state, loss_scale, batch_at(program, windows, step)
        )
        scales.append(float(metrics["loss_scale"]))
        skipped.append(int(metrics["skipped_steps"]))
        losses.append(float(metrics["loss"]))
    previous = zip([overflow / 2, *scales[:-1]], [1, *skipped[:-1]], strict=True)
    applied = 0
    for (scale, n_skipped), (prev_scale, prev_skipped) in zip(
        zip(scales, skipped, strict=True), previous, strict=True
    ):
        if n_skipped > prev_skipped:  # skipped again: the scale halved
            assert scale == prev_scale / 2
        else:
            applied += 1
            assert scale in (prev_scale, 2 * prev_scale)
    assert applied >= 5
    assert any(b == 2 * a for a, b in zip(scales, scales[1:], strict=False))  # grew
    assert losses[-1] < first_loss - 0.3
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.device_get(params), before[0])
    assert all(jax.tree.leaves(moved))


def test_loss_scale_dynamics():
    policy = dataclasses.replace(precision.POLICIES["fp16"], initial_scale=8.0, growth_interval=2)
    state = precision.init_loss_scale(policy)
    trajectory = []
    for finite in [True, True, True, False, False, True, True]:
        state = precision.next_loss_scale(state, jnp.array(finite), policy)
        trajectory.append((float(state["scale"]), int(state["skipped_steps"])))
    assert trajectory == [(8, 0), (16, 0), (16, 0), (8, 1), (4, 2), (4, 2), (8, 2)]

    grads = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(3.0)}
    assert bool(precision.all_finite(grads))
    assert not bool(precision.all_finite({**grads, "b": jnp.array(jnp.inf)}))
    unscaled = precision.unscale(grads, state, policy)
    np.testing.assert_array_equal(unscaled["w"], [0.125, 0.25])  # scale 8

    fp32 = precision.POLICIES["fp32"]
    same = precision.init_loss_scale(fp32)
    assert float(same["scale"]) == 1.0
    assert precision.next_loss_scale(same, jnp.array(False), fp32) is same  # no skipping


def test_unknown_precision_is_a_usage_error(capsys):
    assert train.main(["--model", "tiny", "--precision", "fp4"]) == 2
    assert "--precision 'fp4' is not one of fp32, bf16, fp16, fp8" in capsys.readouterr().err
