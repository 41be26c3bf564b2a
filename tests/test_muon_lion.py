"""Lion and Muon, issue 61's oracles: on one device each is its reference on the same params
and gradients (Lion: its update written out here; Muon: optax.contrib.muon on each layer's
matrix alone, AdamW on the rest) within 1e-6 over 10 fp32 steps; sharded (fsdp=4 ZeRO-1 and
ZeRO-3, dp=2,fsdp=2,tp=2) each, and Adafactor and schedule-free AdamW, trains the tiny model as
one device does within 1e-5 over 10 steps under both executors, and a Muon that updated the
explicit executor's slices would not; a resume from a checkpoint is bitwise; the planner's
FLOPs hold Muon's Newton-Schulz matmuls as the compiled step has them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from models import llama
from spmd import plan
from spmd.engine import muon, optimizers
from spmd.engine.optim import lr_schedule
from spmd.engine.options import TOKENS
from spmd.estimate import cost, timing
from spmd.estimate.flops import hlo_dot_flops
from spmd.io import checkpoint, checkpoint_restore, data
from spmd.parallel.mesh import MESH_AXES
from spmd.run import builder
from spmd.run.config import build, flat, preset
from spmd.sections import OptimizerConfig
from tests import trainer

STEPS = 10
# a block's params as the tiny Llama names them (2 stacked layers), the embedding and a norm
NAMES = {
    "blocks": {
        "wq": ("layers", "embed", "heads", "head_dim"),
        "wo": ("layers", "heads", "head_dim", "embed"),
        "w_down": ("layers", "mlp", "embed"),
        "norm": ("layers", "embed"),
    },
    "embed": ("vocab", "embed"),
}
SHAPES = {
    "blocks": {"wq": (2, 16, 4, 2), "wo": (2, 4, 2, 16), "w_down": (2, 24, 16), "norm": (2, 16)},
    "embed": (32, 16),
}
CFG = OptimizerConfig(lr=0.02, warmup=3, grad_clip=0.0, weight_decay=0.1)


def _random_tree(key: int) -> dict:
    leaves, tree = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(key), len(leaves))
    return tree.unflatten([jax.random.normal(k, s) for k, s in zip(keys, leaves, strict=True)])


def _updates(tx: optax.GradientTransformation, params: Any, view: Callable = lambda t: t) -> list:
    """The updates of `tx` over STEPS steps of fresh gradients (`view` of them: the same
    values in another tree), params moving with them."""
    state, out, update = tx.init(params), [], jax.jit(tx.update)
    for step in range(STEPS):
        updates, state = update(view(_random_tree(100 + step)), state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def test_lion_on_one_device_is_its_update_written_out():
    cfg = dataclasses.replace(CFG, optimizer="lion", lion_beta1=0.8, lion_beta2=0.97)
    params = _random_tree(0)
    ours = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), params)
    lr = lr_schedule(cfg, STEPS, 32)
    momentum = jax.tree.map(jnp.zeros_like, params)
    for step in range(STEPS):
        grads = _random_tree(100 + step)
        # sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g; decay on matrices only
        direction = jax.tree.map(lambda m, g: jnp.sign(0.8 * m + 0.2 * g), momentum, grads)
        momentum = jax.tree.map(lambda m, g: 0.97 * m + 0.03 * g, momentum, grads)
        decay = {"blocks": {"wq": 1, "wo": 1, "w_down": 1, "norm": 0}, "embed": 1}
        rate = lr(step)
        expected = jax.tree.map(
            lambda d, p, on, r=rate: -r * (d + cfg.weight_decay * on * p), direction, params, decay
        )
        for a, b in zip(jax.tree.leaves(ours[step]), jax.tree.leaves(expected), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        params = optax.apply_updates(params, expected)


def test_muon_on_one_device_is_optax_muon_per_layer_matrix_and_adamw_on_the_rest():
    cfg = dataclasses.replace(CFG, optimizer="muon", muon_momentum=0.9, muon_ns_steps=4)
    params = _random_tree(0)
    ours = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), params)
    lr = lr_schedule(cfg, STEPS, 32)
    # optax's Muon on each layer's matrix alone, a plain 2-D (fan_in, fan_out) param; the
    # embedding and the norm on optax's AdamW with decay on matrices only
    as_matrix = {"wq": (16, 8), "wo": (8, 16), "w_down": (24, 16)}

    def theirs(tree: dict) -> dict:
        blocks = tree["blocks"]
        out = {
            f"{name}{layer}": blocks[name][layer].reshape(shape)
            for name, shape in as_matrix.items()
            for layer in range(2)
        }
        return out | {"norm": blocks["norm"], "embed": tree["embed"]}

    rest = {"norm": False, "embed": True}
    labels = {key: "adamw" if key in rest else "muon" for key in theirs(params)}
    reference = optax.partition(
        {
            "muon": optax.contrib.muon(
                lr, ns_steps=4, beta=0.9, weight_decay=cfg.weight_decay, consistent_rms=0.2
            ),
            "adamw": optax.adamw(
                lr,
                b1=cfg.beta1,
                b2=cfg.beta2,
                weight_decay=cfg.weight_decay,
                mask={key: rest.get(key, True) for key in labels},
            ),
        },
        labels,
    )
    expected = _updates(reference, theirs(params), theirs)
    for step in range(STEPS):
        got, want = theirs(ours[step]), expected[step]
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)


def test_muon_splits_hidden_matrices_from_the_rest_and_scales_to_adamw_rms():
    dims = muon.split(NAMES)
    assert dims["blocks"]["wq"] == MuonDimensionNumbers((1,), (2, 3))
    assert dims["blocks"]["wo"] == MuonDimensionNumbers((1, 2), (3,))
    assert dims["blocks"]["norm"] is None and dims["embed"] is None
    router = muon.split({"moe": {"router": ("layers", "embed", None)}})
    assert router["moe"]["router"] is None
    experts = muon.split({"w_up": ("layers", "expert", "embed", "mlp")})
    assert experts["w_up"] == MuonDimensionNumbers((2,), (3,))
    # the line the run prints: wq, wo, w_down on Muon; the embedding and the norm on AdamW
    line = muon.describe(NAMES, _random_tree(0))
    assert "muon on 1,280 params (3 stacked" in line and "adamw on 544 in 2 other" in line
    # Moonlight's scale: every matrix's update RMS near 0.2 x lr, whatever its shape
    cfg = dataclasses.replace(CFG, optimizer="muon", warmup=0, lr_schedule="constant")
    cfg = dataclasses.replace(cfg, weight_decay=0.0)
    first = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), _random_tree(0))[0]
    for name in ("wq", "wo", "w_down"):
        rms = float(jnp.sqrt(jnp.mean(first["blocks"][name] ** 2)))
        assert 0.15 * cfg.lr < rms < 0.25 * cfg.lr, (name, rms)


@functools.cache
def _program(optimizer: str, mesh: str, zero: int, executor: str, elementwise: bool | None = None):
    cfg = flat(
        trainer.tiny_config(),
        optimizer=optimizer,
        steps=STEPS,
        batch=trainer.BATCH,
        seq_len=trainer.SEQ_LEN,
        warmup=2,
        lr=3e-3,
        collectives=executor,
        zero=zero,
        mesh=mesh,
    )
    program = builder.program(cfg, trainer.layout(mesh, zero).mesh)
    if elementwise is not None:  # the same program with the update's slicing forced
        options = builder.options_of(cfg, program.layout, TOKENS, True)
        options = dataclasses.replace(options, elementwise=elementwise)
        spec = builder.run_model(cfg)
        tx = builder.optimizer(cfg)
        program = builder.build(
            spec, tx, program.layout, options, None, trainer.BATCH, trainer.SEQ_LEN
        )
    return program


@functools.cache
def _initial(optimizer: str) -> tuple:
    """The one-device program's seed-0 state, as host arrays: every layout starts from it."""
    return jax.device_get(tuple(_program(optimizer, "dp=1", 3, "auto").init()))


@functools.cache
def _trained(
    optimizer: str, mesh: str = "dp=1", zero: int = 3, executor: str = "auto", elementwise=None
):
    """(losses, final params) of STEPS steps of the tiny model from `_initial`."""
    program = _program(optimizer, mesh, zero, executor, elementwise)
    return trainer.train_losses(program, STEPS, _initial(optimizer))


def _max_difference(a: dict, b: dict) -> float:
    return max(
        float(np.max(np.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


LAYOUTS = [("fsdp=4", 1), ("fsdp=4", 3), ("dp=2,fsdp=2,tp=2", 3)]


@pytest.mark.parametrize("executor", ["auto", "explicit"])
def test_muon_sharded_trains_as_one_device(executor):
    ref_losses, ref_params = _trained("muon")
    for mesh, zero in LAYOUTS:
        losses, params = _trained("muon", mesh, zero, executor)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert _max_difference(params, ref_params) < 1e-5, (mesh, zero)


@pytest.mark.parametrize("executor", ["auto", "explicit"])
@pytest.mark.parametrize("optimizer", ["lion", "adafactor", "schedule-free-adamw"])
def test_the_other_optimizers_sharded_train_as_one_device(optimizer, executor):
    """Lion, Adafactor (not elementwise: gathered whole under explicit ZeRO) and schedule-free
    AdamW (y and z in the state) on every layout of the oracle, as Muon above."""
    ref_losses, ref_params = _trained(optimizer)
    for mesh, zero in LAYOUTS:
        losses, params = _trained(optimizer, mesh, zero, executor)
        what = f"{optimizer} {mesh} zero {zero} {executor}"
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
        if optimizer != "lion":
            assert _max_difference(params, ref_params) < 1e-5, what
            continue
        # every Lion update is a sign: a near-zero one may flip with the reduction order
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
            trainer.assert_close_but_sign_flips(got, want, 2 * CFG.lr * STEPS, 0, 1e-5, what)


def test_a_muon_of_the_slices_would_fail_the_sharded_check():
    _, ref_params = _trained("muon")
    _, sliced = _trained("muon", "fsdp=4", 3, "explicit", elementwise=True)
    assert _max_difference(sliced, ref_params) > 1e-3


@pytest.mark.parametrize("optimizer", ["muon", "lion"])
def test_a_resume_from_a_checkpoint_is_bitwise(optimizer, tmp_path):
    # the sharded program of the tests above (explicit, fsdp=4 ZeRO-3): 3 steps, a save, the
    # rest uninterrupted and again from the restored checkpoint
    program = _program(optimizer, "fsdp=4", 3, "explicit")
    abstract = (program.abstract_params, program.abstract_opt_state, program.abstract_loss_scale)
    state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), _initial(optimizer), abstract)

    def run(state: tuple, first: int, last: int) -> tuple[tuple, list[float]]:
        losses = []
        for step in range(first, last):
            ids = data.train_window_ids(0, step, trainer.BATCH, trainer.windows().n_train)
            batch = data.global_batch(trainer.windows(), ids, program.layout.batch_sharding())
            *state, metrics = program.train_step(*state, batch)
            losses.append(float(metrics["loss"]))
        return tuple(state), losses

    state, _ = run(state, 0, 3)
    manager = checkpoint.open_manager(str(tmp_path), keep=1)
    checkpoint.save(manager, 3, program.checkpoint_view(state), {"step": 3}, {})
    manager.wait_until_finished()
    uninterrupted, expected = run(state, 3, 6)
    restored = checkpoint_restore.restore_newest(manager, program.abstract_checkpoint(), {}, print)
    manager.close()
    resumed, losses = run(tuple(program.from_checkpoint(restored.state)), 3, 6)
    assert losses == expected
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))


def test_the_planner_counts_muons_newton_schulz_flops_as_compiled():
    # tiny, one device, remat none at 256 tokens: the planner's executed FLOPs are the
    # compiled step's dots (tests/test_plan.py checks AdamW's so); Muon's add its matmuls
    model = build(llama.LlamaConfig, {**preset("tiny"), "remat": "none"}, "tiny")
    s = cost.Setup(model.shape(), model.n_params(), dict.fromkeys(MESH_AXES, 1), 1, "fp32",
                   "muon", 1, 256, remat="none")  # fmt: skip
    program, _ = plan.engine_program(s, model, jax.devices()[:1])
    dots = hlo_dot_flops(program.compile_train_step(1, 256))
    assert timing.executed_flops(s) == pytest.approx(dots, rel=1e-3)
    added = timing.executed_flops(s) - timing.executed_flops(
        dataclasses.replace(s, optimizer="adamw")
    )
    assert added == muon.newton_schulz_flops(model.shape()) > 0.1 * timing.model_flops(s)
