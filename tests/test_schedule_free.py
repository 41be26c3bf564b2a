"""Schedule-free AdamW, issue 61's oracles: on one device it is optax's schedule_free_adamw
(weight decay on matrices only) on the same params and gradients within 1e-6 over 10 fp32
steps; the params a checkpoint exports (spmd.io.params_io, what --to-hf and generate read) and
the evals read are the average x, not the trained y; a resume is bitwise. Its refusals (a
decaying --lr-schedule, DiLoCo) are rows of tests/test_bad_inputs.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax

from spmd.engine import optimizers
from spmd.engine.optim import lr_schedule
from spmd.io import checkpoint, data, params_io
from spmd.run import builder
from spmd.run.config import flat
from tests import trainer
from tests.test_adafactor import resume_is_bitwise
from tests.test_muon_lion import CFG, NAMES, STEPS, _max_difference, _random_tree, _updates


def test_schedule_free_on_one_device_is_optax_schedule_free_adamw():
    cfg = dataclasses.replace(CFG, optimizer="schedule-free-adamw", lr_schedule="constant")
    ours = _updates(optimizers.make_optimizer(cfg, STEPS, 32, NAMES), _random_tree(0))
    lr = lr_schedule(cfg, STEPS, 32)  # 3 warm-up steps, then constant

    def sf(decay: float) -> optax.GradientTransformation:
        return optax.contrib.schedule_free_adamw(lr, b1=cfg.beta1, b2=cfg.beta2, weight_decay=decay)

    # optax's own, decaying the matrices and not the norm: its weights and LR are the same
    # in both parts, so the two states move together
    labels = {"blocks": {"wq": "d", "wo": "d", "w_down": "d", "norm": "n"}, "embed": "d"}
    reference = optax.partition({"d": sf(cfg.weight_decay), "n": sf(0.0)}, labels)
    expected = _updates(reference, _random_tree(0))
    for got, want in zip(ours, expected, strict=True):  # updates of about 1e-2: fp32 rounding
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@functools.cache
def _program():
    cfg = flat(
        trainer.tiny_config(),
        optimizer="schedule-free-adamw",
        lr_schedule="constant",
        steps=STEPS,
        batch=trainer.BATCH,
        seq_len=trainer.SEQ_LEN,
        warmup=2,
        lr=3e-3,
    )
    return builder.program(cfg, trainer.layout("dp=1").mesh)


def test_evals_and_exports_read_the_average(tmp_path):
    program = _program()
    state, windows = program.init(), trainer.windows()
    for step in range(3):
        ids = data.train_window_ids(0, step, trainer.BATCH, windows.n_train)
        state, _ = program.step(
            state, data.global_batch(windows, ids, program.layout.batch_sharding())
        )
    view = program.checkpoint_view(state)
    inner_sf = [
        s
        for s in jax.tree.leaves(
            view["opt_state"], is_leaf=lambda x: isinstance(x, optax.contrib.ScheduleFreeState)
        )
        if isinstance(s, optax.contrib.ScheduleFreeState)
    ]
    x = optax.contrib.schedule_free_eval_params(inner_sf[0], view["params"])
    assert _max_difference(view["eval_params"], x) == 0
    assert _max_difference(x, view["params"]) > 1e-4  # y and x apart after 3 steps
    assert _max_difference(program.evaluated_params(state), x) == 0  # the evals' (fp32)
    manager = checkpoint.open_manager(str(tmp_path), keep=1)
    checkpoint.save(manager, 3, view, {"step": 3}, {})
    manager.wait_until_finished()
    manager.close()
    exported = params_io.restore_params(str(tmp_path), 3, program.abstract_params)
    assert _max_difference(jax.device_get(exported), x) == 0


def test_schedule_free_resume_is_bitwise(tmp_path):
    resume_is_bitwise(_program(), jax.device_get(tuple(_program().init())), tmp_path)


def test_without_a_schedule_given_it_takes_its_own_constant_one():
    from spmd import train

    def schedule(*argv: str) -> str:
        return train.resolve_sections(["--model", "tiny", *argv])["optimizer"].lr_schedule

    assert schedule("--optimizer", "schedule-free-adamw") == "constant"
    given = ("--optimizer", "schedule-free-adamw", "--lr-schedule", "linear")
    assert schedule(*given) == "linear"  # given: kept (and refused by the run's check)
    assert schedule("--optimizer", "adamw") == "cosine"  # the section's default
