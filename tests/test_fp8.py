"""--precision fp8 (docs/strategies/fp8.md): the blocks' matmuls lower to fp8 dots, sharded
fp8 trains like one device under both executors, ZeRO-3 gathers in e4m3 at half the bytes,
and delayed scaling's amax history resumes bitwise. Emulated on CPU (XLA:CPU's fp8 types).
Bad flags are in test_bad_inputs.py's table."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import fp8
from spmd import builder
from spmd.config import flat
from spmd.engine import precision
from spmd.engine.options import StepOptions
from spmd.estimate import hlo
from spmd.parallel.fp8_context import Fp8Settings, Site
from tests import trainer

STEPS = 3


def program(mesh: str, policy: precision.Policy, executor: str = "auto", zero: int = 3):
    train = flat(None, steps=STEPS, batch=trainer.BATCH, seq_len=trainer.SEQ_LEN, warmup=2)
    spec = builder.model_spec(trainer.tiny_config(), policy)
    options = StepOptions(executor=executor, policy=policy)
    lay = trainer.layout(mesh, zero)
    return builder.build(spec, builder.optimizer(train), lay, options, None, trainer.BATCH, 32)


def fp8_policy(recipe: str = "tensorwise", all_gather: bool = False) -> precision.Policy:
    # the tiny model's dims (64, 256) are below the default size rule: every matmul in fp8
    return precision.get("fp8", "", Fp8Settings(recipe=recipe, min_dim=0, all_gather=all_gather))


@functools.cache
def losses(mesh: str, executor: str = "auto") -> np.ndarray:
    return trainer.train_losses(program(mesh, fp8_policy(), executor), STEPS)[0]


def test_fp8_matmul_is_close_to_the_exact_one_with_its_gradients_for_every_recipe() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (32, 64)) * jnp.linspace(0.1, 10, 64)  # uneven channels
    w = jax.random.normal(keys[1], (64, 48)) / 8
    c = jax.random.normal(keys[2], (32, 48))  # the output's cotangent

    @jax.jit
    def outputs(x, w, scales, probe):
        def run(site: Site) -> tuple:
            y, vjp = jax.vjp(
                lambda x, w, p: fp8.matmul(x, w, Site(site.recipe, scales, p)), x, w, probe
            )
            return y, *vjp(c)

        exact = jax.vjp(lambda x, w: x @ w, x, w)
        return (exact[0], *exact[1](c)), [run(Site(r)) for r in fp8_recipes()]

    # a history a little above this step's amaxes; the gradient's 0: none yet, current scaling
    scales = jnp.asarray([1.2 * jnp.abs(x).max() / 448, 1.2 * jnp.abs(w).max() / 448, 0.0])
    want, got = outputs(x, w, scales, jnp.zeros(3))
    for recipe, (y, gx, gw, seen) in zip(fp8_recipes(), got, strict=True):
        for a, b in ((y, want[0]), (gx, want[1]), (gw, want[2])):
            error = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert 1e-4 < error < 0.08, (recipe, error)  # quantized, yet close
        if recipe == "delayed":  # the probe's cotangent: the amaxes seen
            amaxes = [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(c).max()]
            np.testing.assert_allclose(seen, amaxes, rtol=1e-6)


def fp8_recipes() -> tuple[str, ...]:
    return ("tensorwise", "rowwise", "delayed")


def test_the_blocks_lower_to_fp8_dots_and_sharded_fp8_trains_like_one_device() -> None:
    lowered = program("dp=1", fp8_policy()).lower_train_step(trainer.BATCH, 32).as_text()
    # 7 block matmuls forward, 2 dots backward each: e4m3 x e4m3 forward, e5m2 in backward
    assert lowered.count("xf8E4M3FN>, tensor<") >= 7
    assert "f8E5M2" in lowered
    one = losses("dp=1")
    assert np.all(np.isfinite(one)) and one[-1] < one[0]
    for executor in ("auto", "explicit"):
        sharded = losses("dp=2,fsdp=2,tp=2", executor)
        assert trainer.max_relative_difference(sharded, one) < 1e-2, executor


def gather_bytes(policy: precision.Policy) -> tuple[int, set[str]]:
    lowered = program("fsdp=4", policy, "explicit").lower_train_step(trainer.BATCH, 32)
    gathers = [c for c in hlo.collectives(lowered) if c.kind == "all-gather"]
    return sum(c.bytes * c.count for c in gathers), {c.dtype for c in gathers}


def test_fp8_all_gather_moves_half_the_bytes_of_bf16_under_zero3() -> None:
    bf16, bf16_dtypes = gather_bytes(precision.POLICIES["bf16"])
    fp8_bytes, fp8_dtypes = gather_bytes(fp8_policy(all_gather=True))
    assert "f8e4m3fn" in fp8_dtypes and "f8e4m3fn" not in bf16_dtypes
    # the blocks' matrices in e4m3 (+ 4 bytes of scale per device); embedding and norms bf16
    assert 0.50 <= fp8_bytes / bf16 <= 0.55 or pytest.fail(f"{fp8_bytes / bf16:.3f} of bf16")


def test_delayed_scaling_keeps_its_history_in_the_state_and_resumes_bitwise() -> None:
    prog = program("dp=1", fp8_policy("delayed"))
    state = prog.init()
    for step in range(2):
        state, _ = prog.step(state, batch(step))
    saved = jax.device_get(prog.checkpoint_view(state))
    history = saved["loss_scale"]["fp8"]["amax_history"]
    assert history[..., 0].max() > 0 and history[..., 1].max() > 0 and history[..., 2].max() == 0
    assert not np.array_equal(history[..., 0], history[..., 1])
    straight = run_on(prog, state)
    resumed = run_on(prog, prog.makers.from_checkpoint(saved))  # what a restore runs
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def batch(step: int) -> dict:
    win = trainer.windows()
    ids = trainer.data.train_window_ids(0, step, trainer.BATCH, win.n_train)
    return trainer.data.global_batch(win, ids, trainer.layout("dp=1").batch_sharding())


def run_on(prog, state) -> tuple:
    losses = []
    for step in (2, 3):
        state, metrics = prog.step(state, batch(step))
        losses.append(metrics["loss"])
    return jax.device_get((losses, prog.checkpoint_view(state)))
