"""Shared by the precision / accumulation tests: build the tiny model's program on a mesh of the
first N simulated devices and train it on real text (a few stdlib modules, byte tokens)."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from models import llama
from spmd.engine import precision
from spmd.engine.step import Program, build_program
from spmd.io import data
from spmd.parallel.layout import Layout
from spmd.parallel.mesh import build_mesh, parse_mesh
from spmd.run import config
from spmd.run.builder import optimizer
from spmd.run.config import Config, flat

BATCH, SEQ_LEN = 16, 32
# The executors a parity test runs: XLA's partitioner (jit) and hand-written collectives
# (shard_map).
EXECUTORS = ["auto", "explicit"]


def tiny_train_config(accum: int = 1, lr: float = 3e-3) -> Config:
    return flat(None, model="tiny", batch=BATCH, seq_len=SEQ_LEN, accum=accum, lr=lr, warmup=5)


def tiny_program(
    mesh: str,
    accum: int = 1,
    policy: str | precision.Policy = "fp32",
    zero: int = 3,
    executor: str = "auto",
    remat: str = "none",
    lr: float = 3e-3,
) -> Program:
    """The tiny Llama's program on `mesh` (e.g. "dp=2,tp=2") over the first devices it needs."""
    policy = precision.get(policy) if isinstance(policy, str) else policy
    sizes = parse_mesh(mesh)
    layout = Layout(build_mesh(sizes, jax.devices()[: math.prod(sizes.values())]), zero)
    model_cfg = llama.LlamaConfig(**{**config.preset("tiny"), "remat": remat})
    train = tiny_train_config(accum, lr)
    return build_program(
        lambda seed: llama.create(model_cfg, seed, policy.compute_dtype),
        llama.lm_loss,
        lambda names: optimizer(train)(names),
        layout,
        accum=accum,
        policy=policy,
        executor=executor,
    )


def text_windows() -> data.TokenWindows:
    from tests import trainer

    return trainer.windows(SEQ_LEN)


def batch_at(program: Program, windows: data.TokenWindows, step: int) -> dict[str, jax.Array]:
    ids = data.train_window_ids(0, step, BATCH, windows.n_train)
    return data.global_batch(windows, ids, program.layout.batch_sharding())


def initial_state(program: Program) -> tuple[Any, Any, Any]:
    """(params, opt_state, loss_scale) of the seed-0 init (made once per session, see
    trainer.initial_state) placed on the program's shardings, with the program's initial loss
    scale. Params and optimizer state are a function of the seed only, not of the mesh."""
    from tests import trainer

    params, opt_state, _ = trainer.initial_state()
    if program.policy.has_master:  # bf16 / fp16: 16-bit working params, fp32 master in opt_state
        return tuple(program.start(params))
    shardings = jax.tree.map(
        lambda a: a.sharding, (program.abstract_params, program.abstract_opt_state)
    )
    params, opt_state = jax.device_put((params, opt_state), shardings)
    loss_scale = jax.device_put(precision.init_loss_scale(program.policy))
    return params, opt_state, loss_scale


def train_losses(program: Program, steps: int, step_fn: Any = None) -> tuple[np.ndarray, Any]:
    """Per-step losses of `steps` optimizer steps from the seed-0 init, and the final state
    (params, opt_state, loss_scale). `step_fn` is the step to run (e.g. an AOT-compiled one
    whose HLO a test also reads); program.train_step by default."""
    step_fn = step_fn or program.train_step
    windows = text_windows()
    state = initial_state(program)
    losses = []
    for step in range(steps):
        *state, metrics = step_fn(*state, batch_at(program, windows, step))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state
