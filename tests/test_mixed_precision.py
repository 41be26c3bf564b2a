"""ZeRO under mixed precision (the ZeRO paper's layout): 16-bit working params and gradients,
fp32 master weights and Adam moments in the optimizer state, sharded over fsdp from ZeRO-1 on.
Per-device state bytes equal the formula, the 16-bit reduction moves half the bytes, every
layout equals one device within 16-bit rounding, and a bf16 ZeRO-2 run resumes on another mesh."""

import functools

import jax
import numpy as np
import pytest

import spmd
from spmd.engine import precision
from spmd.engine.state_layout import state_bytes_per_device
from spmd.estimate import hlo
from tests.tiny_run import BATCH, EXECUTORS, SEQ_LEN, batch_at, text_windows, tiny_program

STAGES = [(0, "dp=8", 3), (1, "fsdp=8", 1), (2, "fsdp=8", 2), (3, "fsdp=8", 3)]


@functools.cache
def compiled_step(mesh: str, zero: int, policy: str, executor: str) -> tuple:
    """(program, its AOT-compiled train step): the state-bytes test reads the compiled program,
    and the parity test trains with the same one, traced and compiled once."""
    program = tiny_program(mesh, policy=policy, zero=zero, executor=executor)
    return program, program.compile_train_step(BATCH, SEQ_LEN)


def n_params(program) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(program.abstract_params))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("stage,mesh,zero", STAGES)
def test_state_bytes_per_device_equal_the_zero_formula(stage, mesh, zero, executor):
    program, compiled = compiled_step(mesh, zero, "bf16", executor)
    p, n = n_params(program), 8
    want_params = 2 * p / (n if stage == 3 else 1)  # bf16 working params
    want_opt = 12 * p / (n if stage >= 1 else 1)  # fp32 master + Adam m and v
    got = state_bytes_per_device(compiled, program)
    assert got["params"] == pytest.approx(want_params, rel=0.05)
    assert got["opt_state"] == pytest.approx(want_opt, rel=0.05)
    # The compiled program's own argument bytes: the state plus this device's batch rows.
    batch_bytes = 2 * BATCH * SEQ_LEN * 4 / 8
    arguments = hlo.memory(compiled)["argument"]
    assert arguments == pytest.approx(want_params + want_opt + batch_bytes, rel=0.05)


def emitted(program, kind: str) -> int:
    """Bytes per device per step of one collective kind in the program spmd emits."""
    lowered = program.lower_train_step(BATCH, SEQ_LEN)
    return hlo.collective_summary(hlo.collectives(lowered, program.layout.mesh))[kind]["bytes"]


def test_16bit_reduction_moves_half_the_bytes():
    def zero2(policy: str, grad_reduce: str = ""):
        return tiny_program(
            "fsdp=8", policy=precision.get(policy, grad_reduce), zero=2, executor="explicit"
        )

    fp32, bf16, bf16_fp32_reduce = zero2("fp32"), zero2("bf16"), zero2("bf16", "fp32")
    scatter32 = emitted(fp32, "reduce-scatter")
    assert emitted(bf16, "reduce-scatter") == pytest.approx(scatter32 / 2, rel=0.01)
    assert emitted(bf16, "all-gather") == pytest.approx(emitted(fp32, "all-gather") / 2, rel=0.01)
    # --grad-reduce fp32: fp32 gradients on the wire, 16-bit params still gathered.
    assert emitted(bf16_fp32_reduce, "reduce-scatter") == pytest.approx(scatter32, rel=0.01)
    assert emitted(bf16_fp32_reduce, "all-gather") == emitted(bf16, "all-gather")


# Each ZeRO stage's own layout in bf16 (the state-bytes test's programs), and the 3-D layout,
# whose tp and dp cover dp=2,tp=4 and dp=8 (cells dropped for the suite's time, 2026-11-27);
# fp16 on a sharded and the 3-D layout (its loss scaling: tests/test_precision.py).
PARITY = [
    ("dp=8", 3, "bf16"),
    ("fsdp=8", 1, "bf16"),
    ("fsdp=8", 2, "bf16"),
    ("fsdp=8", 3, "bf16"),
    ("dp=2,fsdp=2,tp=2", 3, "bf16"),
    ("fsdp=8", 2, "fp16"),
    ("dp=2,fsdp=2,tp=2", 3, "fp16"),
]
STEPS = 10  # enough for 16-bit rounding to show against one device; the suite's time is tight


def losses(program, steps: int = STEPS, step_fn=None) -> np.ndarray:
    from tests.tiny_run import train_losses

    return train_losses(program, steps, step_fn)[0]


@pytest.fixture(scope="module")
def one_device():
    return {policy: losses(tiny_program("dp=1", policy=policy)) for policy in ("bf16", "fp16")}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("mesh,zero,policy", PARITY)
def test_16bit_layouts_equal_one_device(one_device, mesh, zero, policy, executor):
    program, compiled = compiled_step(mesh, zero, policy, executor)
    got = losses(program, step_fn=compiled)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, one_device[policy], rtol=1e-2)


def test_bf16_pipeline_equals_one_device(one_device):
    from models import llama
    from spmd.engine.step import build_program
    from spmd.parallel.pipeline import Pipeline
    from spmd.run import config
    from spmd.run.builder import optimizer
    from tests import trainer
    from tests.tiny_run import tiny_train_config

    policy = precision.get("bf16")
    cfg = llama.LlamaConfig(**{**config.preset("tiny"), "remat": "none"})
    program = build_program(
        lambda seed: llama.create(cfg, seed, policy.compute_dtype),
        llama.lm_loss,
        lambda names: optimizer(tiny_train_config())(names),
        trainer.layout("dp=2,pp=2,tp=2"),
        policy=policy,
        pipeline=Pipeline("1f1b", 4, 1, llama.logits_loss),
    )
    np.testing.assert_allclose(losses(program), one_device["bf16"], rtol=1e-2)


def test_bf16_zero2_resumes_on_another_mesh(tmp_path):
    windows = text_windows()

    def run(built, state, first: int, last: int) -> tuple[list[float], tuple]:
        program, train_step = built  # the parity test's programs, compiled once
        out = []
        for step in range(first, last):
            *state, metrics = train_step(*state, batch_at(program, windows, step))
            out.append(float(metrics["loss"]))
        return out, tuple(state)

    from tests.tiny_run import initial_state

    built = compiled_step("fsdp=8", 2, "bf16", "auto")
    zero2 = built[0]
    straight, _ = run(built, initial_state(zero2), 0, 10)
    first_half, state = run(built, initial_state(zero2), 0, 5)
    manager = spmd.checkpoints(str(tmp_path))
    spmd.save(manager, 5, spmd.TrainState(*state), {}, program=zero2)
    manager.wait_until_finished()
    # The checkpoint holds fp32 master weights as its params.
    assert {leaf.dtype for leaf in jax.tree.leaves(zero2.checkpoint_view(state)["params"])} == {
        np.dtype(np.float32)
    }
    same_mesh = run(built, tuple(spmd.restore(manager, zero2)[1]), 5, 10)[0]
    assert first_half + same_mesh == straight  # bitwise
    other = compiled_step("dp=2,tp=4", 3, "bf16", "auto")
    moved = run(other, tuple(spmd.restore(manager, other[0])[1]), 5, 10)[0]
    np.testing.assert_allclose(moved, straight[5:], rtol=1e-2)
    manager.close()
