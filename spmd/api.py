"""The public library API: bring a Flax NNX model and a loss, get every layout.

    import optax, spmd

    mesh = spmd.make_mesh("dp=2,fsdp=4")
    program = spmd.build(make_model, loss_fn, optax.adamw(1e-3), mesh, zero_stage=3)
    state = program.init()                                   # sharded on the mesh
    for host_batch in batches:
        state, metrics = program.step(state, spmd.put_batch(host_batch, program))

`spmd.train` builds its Llama runs with these same functions. Shardings come from the logical
axis names the model gives its params (`nnx.Param(..., out_sharding=("embed", "mlp"))`) and the
rules of `sharding_rules`; a model that names none still runs data-parallel, with fsdp
splitting each param's largest divisible dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from spmd.engine import precision
from spmd.engine.step import Program, TrainState, build_program
from spmd.errors import UsageError
from spmd.io import checkpoint
from spmd.log import say
from spmd.parallel import mesh as mesh_lib
from spmd.parallel import rules
from spmd.parallel.layout import Layout
from spmd.sections import ParallelConfig


def make_mesh(spec: str, devices: list | None = None) -> jax.sharding.Mesh:
    """A mesh with axes (data, pipeline, fsdp, tensor) from a string such as "dp=2,tp=4"
    (aliases dp/data, fsdp, tp/tensor, pp/pipeline; one size may be -1: the rest; absent
    axes have size 1) over `devices` (default: the first jax.devices() the sizes need, all of
    them with a -1). UsageError if the sizes do not fit the devices."""
    sizes = mesh_lib.parse_mesh(spec, flag="make_mesh: spec")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    rest = -1 in sizes.values()
    if devices is None:  # a mesh of fixed sizes takes the first devices it needs
        devices = jax.devices() if rest else jax.devices()[:fixed]
    n = len(devices)
    if (n % fixed) if rest else (n != fixed):
        need = f"a multiple of {fixed}" if rest else str(fixed)
        raise UsageError(
            f"make_mesh({spec!r}) needs {need} devices and has {n} (jax.devices() holds "
            f"{len(jax.devices())}); change the sizes or the devices you pass"
        )
    return mesh_lib.build_mesh(sizes, devices)


def sharding_rules(zero_stage: int = 3) -> dict[str, dict[str, tuple[str, ...]]]:
    """The logical-axis -> mesh-axes tables of a ZeRO stage, per role: "params", "grads",
    "opt_state" and "activations" (e.g. rules["params"]["mlp"] == ("tensor",))."""
    return {role: rules.rules_for(zero_stage, role) for role in rules.ROLES}


def build(
    make_model: Callable[[int], nnx.Module],
    loss_fn: Callable[[nnx.Module, dict[str, jax.Array]], jax.Array],
    optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    mesh: jax.sharding.Mesh,
    *,
    zero_stage: int = 3,
    executor: str = "auto",
    precision_policy: str = "fp32",
    grad_reduce: str = "",
    accum: int = 1,
    seed: int = 0,
    pipeline: Any = None,
    sequence_parallel: bool = False,
    bucket_mb: float = 0.0,
    prefetch: bool = ParallelConfig.prefetch,
) -> Program:
    """Sharded, jitted steps for `make_model(seed)` trained on `loss_fn(model, batch)` (a
    scalar: the mean loss per example or token of the batch it is given) with `optimizer`.

    - zero_stage 1 / 2 / 3: what the mesh's fsdp axis splits (optimizer state; + gradients;
      + params). The data and fsdp axes split every batch leaf's dimension 0.
    - executor "auto" (XLA inserts the collectives) or "explicit" (shard_map, collectives by
      hand; a model then reads its params through `spmd.gather` and marks row-parallel
      outputs with `spmd.tp_reduce`, as models/llama.py does).
    - precision_policy "fp32", "bf16" or "fp16": under bf16 / fp16 the params the step takes
      and returns are 16-bit working params and the optimizer state holds the fp32 master
      weights (sharded over fsdp from ZeRO-1 on); pass `program.policy.compute_dtype` on to the
      model. grad_reduce "fp32" / "bf16" / "fp16" ("": the policy's compute dtype) is the dtype
      gradients are accumulated and reduced in.
    - accum: micro-batches per optimizer step (the batch's dimension 0 split accum ways),
      with one gradient reduction per step.

    - pipeline: a spmd.parallel.pipeline.Pipeline (schedule, micro-batches, virtual stages) used
    when
      the mesh's pipeline axis is over 1; the model then provides `embed_tokens(tokens)`,
      `apply_blocks(x)` (`apply_blocks(x, segments)` for batches with segment ids) and
      `head_logits(x)`, as models/llama.py does.

    - bucket_mb: under the explicit executor, reduce the gradients in buckets of about this
      many MiB, one collective each (0: one per param). Under auto XLA's combine thresholds
      decide; they are XLA flags, set before JAX starts (spmd.parallel.xla_flags).

    - prefetch: under the explicit executor with ZeRO-3, all-gather each layer's params while
      the layer before it computes, forward and backward (spmd.parallel.layer_scan); False
      gathers each layer's params inside its own iteration.

    `optimizer` may be a function of the params' logical names (e.g. for a weight-decay
    mask). `sequence_parallel` (tp > 1): Megatron-SP, the residual stream (embedding output,
    norms, residual adds) split along length over `tensor`. Returns a Program: `init()` ->
    TrainState sharded on the mesh, `step(state, batch)`
    -> (state, metrics: loss, grad_norm, loss_scale, skipped_steps), `eval_step(params,
    batch)` -> loss, `model(params)` -> the NNX module. UsageError up front if an axis does
    not divide a dimension it must split."""
    layout = Layout(mesh, zero_stage, sequence_parallel)
    return build_program(
        make_model,
        loss_fn,
        optimizer,
        layout,
        seed=seed,
        accum=accum,
        policy=precision.get(precision_policy, grad_reduce),
        executor=executor,
        pipeline=pipeline,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
    )


def put_batch(host_batch: dict[str, np.ndarray], program: Program) -> dict[str, jax.Array]:
    """A batch of this process's rows (numpy, leading dimension = this process's share of the
    global batch) as global arrays split over the mesh's data-parallel axes. On one process
    the host batch is the whole global batch."""
    sharding = program.layout.batch_sharding(ndim=1)
    return {
        key: jax.make_array_from_process_local_data(sharding, np.asarray(value))
        for key, value in host_batch.items()
    }


def checkpoints(directory: str, keep: int = 3) -> ocp.CheckpointManager:
    """An orbax manager over `directory` keeping the newest `keep` steps; saves are async
    (call `.wait_until_finished()` before exiting) and never replace a complete step."""
    return checkpoint.open_manager(directory, keep)


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: TrainState,
    metadata: dict[str, Any] | None = None,
    program: Program | None = None,
) -> float:
    """Start saving `state` as step `step`, with JSON-ready `metadata` (e.g. the data
    position). Returns the seconds the caller was blocked (copy to host memory). Under bf16 /
    fp16 pass the `program`: the checkpoint then holds the fp32 master weights as its params
    (the 16-bit working params are derived on restore), as under fp32."""
    if program is None:
        if isinstance(state.opt_state, dict) and "master" in state.opt_state:
            raise ValueError("spmd.save of a bf16 / fp16 state needs program=")
        return checkpoint.save(manager, step, state._asdict(), metadata or {}, {})
    return checkpoint.save(manager, step, program.checkpoint_view(state), metadata or {}, {})


def restore(
    manager: ocp.CheckpointManager, program: Program
) -> tuple[int, TrainState, dict[str, Any]]:
    """(step, state, metadata) of the newest readable checkpoint, read straight into the
    program's shardings (any mesh restores any checkpoint of the same model). A damaged step is
    moved aside to <step>.damaged and the next older one is used. UsageError if the shapes
    differ from the program's or nothing can be read."""
    restored = checkpoint.restore_newest(manager, program.abstract_checkpoint(), {}, say)
    return restored.step, program.from_checkpoint(restored.state), restored.data
