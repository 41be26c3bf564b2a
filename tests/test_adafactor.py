"""Adafactor, issue 61's oracles: on one device it is optax.adafactor on each layer's matrix
alone (the matrices reshaped as Muon's, vectors whole) within 1e-6 over 10 fp32 steps; sharded
it trains the tiny model as one device within 1e-5 (tests/test_muon_lion.py, every layout of
the oracle), and an Adafactor of the explicit executor's fsdp=4 slices would not; a resume is bitwise; the planner counts
the factored state the engine allocates (its bad flags are rows of tests/test_bad_inputs.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

from spmd.engine import adafactor, optimizers
from spmd.engine.optim import lr_schedule
from spmd.estimate import cost, memory
from spmd.io import checkpoint, checkpoint_restore, data
from spmd.run import builder
from spmd.run.config import flat
from tests import trainer
from tests.test_muon_lion import CFG, NAMES, STEPS, _max_difference, _random_tree, _updates

MIN_DIM = 32  # the tiny model's matrices are 32 to 256 wide: all factored from 32


def test_adafactor_on_one_device_is_optax_adafactor_per_layer_matrix():
    cfg = dataclasses.replace(CFG, optimizer="adafactor", adafactor_min_dim=8)
    ours = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), _random_tree(0))
    lr = lr_schedule(cfg, STEPS, 32)
    # each layer's matrix a plain 2-D param (embed by the rest, in the names' order), the
    # norm's layers apart (vectors, unfactored); the embedding [32, 16] factored
    as_matrix = {"wq": (16, 8), "wo": (8, 16), "w_down": (24, 16), "norm": (16,)}

    def theirs(tree: dict) -> dict:
        blocks = tree["blocks"]
        out = {
            f"{name}{layer}": blocks[name][layer].reshape(shape)
            for name, shape in as_matrix.items()
            for layer in range(2)
        }
        return out | {"embed": tree["embed"]}

    mask = {key: not key.startswith("norm") for key in theirs(_random_tree(0))}
    reference = optax.adafactor(
        lr,
        min_dim_size_to_factor=8,
        weight_decay_rate=lambda count: cfg.weight_decay * lr(count),
        weight_decay_mask=mask,
    )
    expected = _updates(reference, theirs(_random_tree(0)), theirs)
    for step in range(STEPS):
        got, want = theirs(ours[step]), expected[step]
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-8, err_msg=key)
    # the state is factored: a row and a column mean per layer's matrix, not one per element
    state = optimizers.make_optimizer(cfg, STEPS, 32, NAMES).init(_random_tree(0))
    factored = state.inner_states["1f"].inner_state[0]
    assert factored.v_row["blocks"]["w_down"].shape == (2, 16)  # 24 x 16: rows of 24 kept
    assert factored.v_col["blocks"]["w_down"].shape == (2, 24)


@functools.cache
def _program(mesh: str, executor: str = "auto"):
    cfg = flat(
        trainer.tiny_config(),
        optimizer="adafactor",
        adafactor_min_dim=MIN_DIM,
        steps=STEPS,
        batch=trainer.BATCH,
        seq_len=trainer.SEQ_LEN,
        warmup=2,
        lr=1e-2,
        collectives=executor,
        zero=3,
        mesh=mesh,
    )
    return builder.program(cfg, trainer.layout(mesh, 3).mesh)


@functools.cache
def _initial() -> tuple:
    return jax.device_get(tuple(_program("dp=1").init()))


@functools.cache
def _trained(mesh: str = "dp=1", executor: str = "auto"):
    return trainer.train_losses(_program(mesh, executor), STEPS, _initial())


def test_an_adafactor_of_fsdp_slices_would_differ():
    # what the explicit executor would compute if it updated each fsdp=4 device's quarter
    # of every param (split along `embed`, as ZeRO splits them) alone: row and column means,
    # clipping and param scale of a quarter are not the whole matrix's
    cfg = dataclasses.replace(CFG, optimizer="adafactor", adafactor_min_dim=4)
    embed_axis = jax.tree.map(lambda names: names.index("embed"), NAMES, is_leaf=_is_names)

    def quarter(tree: dict, k: int) -> dict:
        return jax.tree.map(lambda x, a: np.split(x, 4, a)[k], tree, embed_axis)

    whole = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), _random_tree(0))
    parts = [
        _updates(
            optimizers.make_optimizer(cfg, STEPS, 32, NAMES),
            quarter(_random_tree(0), k),
            functools.partial(quarter, k=k),
        )
        for k in range(4)
    ]
    sliced = [
        jax.tree.map(lambda a, *xs: np.concatenate(xs, a), embed_axis, *(p[step] for p in parts))
        for step in range(STEPS)
    ]
    assert _max_difference(whole[-1], sliced[-1]) > 1e-3 * _max_abs(whole[-1])


def _is_names(x: object) -> bool:
    return isinstance(x, tuple)


def _max_abs(tree: dict) -> float:
    return max(float(np.max(np.abs(x))) for x in jax.tree.leaves(tree))


def resume_is_bitwise(program, initial: tuple, folder) -> None:
    """3 steps of `program` from `initial`, a save, 3 more uninterrupted and again from the
    restored checkpoint: the losses and the whole state bitwise equal."""
    abstract = (program.abstract_params, program.abstract_opt_state, program.abstract_loss_scale)
    state = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), initial, abstract)

    def run(state: tuple, first: int, last: int) -> tuple[tuple, list[float]]:
        losses = []
        for step in range(first, last):
            ids = data.train_window_ids(0, step, trainer.BATCH, trainer.windows().n_train)
            batch = data.global_batch(trainer.windows(), ids, program.layout.batch_sharding())
            *state, metrics = program.train_step(*state, batch)
            losses.append(float(metrics["loss"]))
        return tuple(state), losses

    state, _ = run(state, 0, 3)
    manager = checkpoint.open_manager(str(folder), keep=1)
    checkpoint.save(manager, 3, program.checkpoint_view(state), {"step": 3}, {})
    manager.wait_until_finished()
    uninterrupted, expected = run(state, 3, 6)
    restored = checkpoint_restore.restore_newest(manager, program.abstract_checkpoint(), {}, print)
    manager.close()
    resumed, losses = run(tuple(program.from_checkpoint(restored.state)), 3, 6)
    assert losses == expected
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        np.testing.assert_array_equal(jax.device_get(a), jax.device_get(b))


def test_adafactor_resume_is_bitwise(tmp_path):
    program = _program("fsdp=4", "explicit")
    resume_is_bitwise(program, _initial(), tmp_path)


def test_the_planner_counts_the_factored_state_the_engine_allocates():
    model = trainer.tiny_config()
    mesh = {"data": 1, "pipeline": 1, "fsdp": 1, "tensor": 1}
    leaves = jax.tree.leaves(_program("dp=1").abstract_opt_state)
    held = sum(leaf.size for leaf in leaves if leaf.ndim > 0)  # fp32: master copy + state
    slices = sum(leaf.size for leaf in leaves if leaf.ndim > 0 and leaf.shape[-1] == 1)
    for min_dim, factored in ((MIN_DIM, True), (128, False)):
        s = cost.Setup(model.shape(), model.n_params(), mesh, 1, "fp32", "adafactor", 8, 32)
        s = dataclasses.replace(s, adafactor_min_dim=min_dim)
        planned = memory.bytes_per_param(s)["optimizer"]
        if factored:  # optax's size-1 placeholders are all the planner leaves out
            allocated = 4 * held / model.n_params()
            assert planned == pytest.approx(allocated - 4 * slices / model.n_params(), rel=1e-9)
            assert planned < 0.2  # about (m + n) / mn per matrix, the norms' whole
        else:  # the tiny model has no side of 128: every param keeps its whole moment
            assert planned == 4
    assert adafactor.state_values(s) == 1.0
