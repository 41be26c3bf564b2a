"""The public library API: bring a Flax NNX model and a loss, get every layout.

    import optax, spmd

    mesh = spmd.make_mesh("dp=2,fsdp=4")
    program = spmd.build(make_model, loss_fn, optax.adamw(1e-3), mesh, zero_stage=3)
    state = program.init()                                   # sharded on the mesh
    for host_batch in batches:
        state, metrics = program.step(state, spmd.put_batch(host_batch, program))

`build` goes through spmd.run.builder, the road `spmd.train` and every other command take.
Shardings come from the logical axis names the model gives its params (`nnx.Param(...,
out_sharding=("embed", "mlp"))`) and the rules of `sharding_rules`; a model that names none
still runs data-parallel, with fsdp splitting each param's largest divisible dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from spmd.engine import fp8_state, precision
from spmd.engine.diloco import AnyProgram, DilocoProgram, Sync
from spmd.engine.options import StepOptions
from spmd.engine.step import LossFn, Program, TrainState
from spmd.errors import UsageError
from spmd.io import checkpoint, checkpoint_restore
from spmd.log import say
from spmd.parallel import mesh as mesh_lib
from spmd.parallel import rules
from spmd.parallel.layout import Layout
from spmd.run import builder
from spmd.sections import ParallelConfig

if TYPE_CHECKING:
    from spmd.parallel.pipeline import Pipeline


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


@overload
def build(
    make_model: Callable[[int], nnx.Module],
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    mesh: jax.sharding.Mesh,
    *,
    zero_stage: int = ...,
    executor: str = ...,
    precision_policy: str = ...,
    grad_reduce: str = ...,
    accum: int = ...,
    seed: int = ...,
    pipeline: Pipeline | None = ...,
    sequence_parallel: bool = ...,
    bucket_mb: float = ...,
    prefetch: bool = ...,
    offload: str = ...,
    diloco: None = None,
    batch: int | None = ...,
    seq_len: int | None = ...,
    check_layout: Callable[[jax.sharding.Mesh, str], None] | None = ...,
) -> Program: ...


@overload
def build(
    make_model: Callable[[int], nnx.Module],
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    mesh: jax.sharding.Mesh,
    *,
    zero_stage: int = ...,
    executor: str = ...,
    precision_policy: str = ...,
    grad_reduce: str = ...,
    accum: int = ...,
    seed: int = ...,
    pipeline: Pipeline | None = ...,
    sequence_parallel: bool = ...,
    bucket_mb: float = ...,
    prefetch: bool = ...,
    offload: str = ...,
    diloco: Sync,
    batch: int | None = ...,
    seq_len: int | None = ...,
    check_layout: Callable[[jax.sharding.Mesh, str], None] | None = ...,
) -> DilocoProgram: ...


def build(
    make_model: Callable[[int], nnx.Module],
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    mesh: jax.sharding.Mesh,
    *,
    zero_stage: int = 3,
    executor: str = "auto",
    precision_policy: str = "fp32",
    grad_reduce: str = "",
    accum: int = 1,
    seed: int = 0,
    pipeline: Pipeline | None = None,
    sequence_parallel: bool = False,
    bucket_mb: float = 0.0,
    prefetch: bool = ParallelConfig.prefetch,
    offload: str = "none",
    diloco: Sync | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
    check_layout: Callable[[jax.sharding.Mesh, str], None] | None = None,
) -> AnyProgram:
    """Sharded, jitted steps for `make_model(seed)` trained on `loss_fn(model, batch)` (a
    scalar: the mean loss per example or token of the batch it is given) with `optimizer`.
    Built by spmd.run.builder, the road every command takes, with the same checks.

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
    - pipeline: a spmd.parallel.pipeline.Pipeline (schedule, micro-batches, virtual stages)
      used when the mesh's pipeline axis is over 1; the model then provides
      `embed_tokens(tokens)`, `apply_blocks(x)` (`apply_blocks(x, segments)` for batches with
      segment ids) and `head_logits(x)`, as models/llama.py does.
    - bucket_mb: under the explicit executor, reduce the gradients in buckets of about this
      many MiB, one collective each (0: one per param). Under auto XLA's combine thresholds
      decide; they are XLA flags, set before JAX starts (spmd.parallel.xla_flags).
    - prefetch: under the explicit executor with ZeRO-3, all-gather each layer's params while
      the layer before it computes, forward and backward (spmd.parallel.layer_scan); False
      gathers each layer's params inside its own iteration.
    - offload: "none", "optimizer" (the optimizer state with the master weights in host memory
      between steps) or "params" (the params too); UsageError where it cannot run.
    - diloco: a spmd.engine.diloco.Sync (inner steps per round, outer lr and momentum) makes
      every way of the mesh's data axis a replica that syncs once per round; the result is a
      DilocoProgram, whose `step(state, batch, step)` takes the 1-based step number.
      UsageError for what DiLoCo does not support (dp=1, the explicit executor, fp16, pp > 1).
    - batch, seq_len: the global batch (rows) and sequence length the steps will take; when
      given, checked up front against the data-parallel ways x accum and against context /
      sequence parallelism (2·cp chunks, tp), as the commands check theirs.
    - check_layout(mesh, executor): the model's own refusals (UsageError), called before
      anything is traced.

    `optimizer` may be a function of the params' logical names (e.g. for a weight-decay
    mask). `sequence_parallel` (tp > 1): Megatron-SP, the residual stream (embedding output,
    norms, residual adds) split along length over `tensor`. Returns a Program: `init()` ->
    TrainState sharded on the mesh, `step(state, batch)` -> (state, metrics: loss, grad_norm,
    loss_scale, skipped_steps), `eval_step(params, batch)` -> loss, `model(params)` -> the NNX
    module. UsageError up front if an axis does not divide a dimension it must split."""
    options = StepOptions(
        seed=seed,
        accum=accum,
        policy=precision.get(precision_policy, grad_reduce),
        executor=executor,
        pipeline=pipeline,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        offload_state=offload,
    )
    spec = builder.ModelSpec(make_model, loss_fn, check_layout)
    layout = Layout(mesh, zero_stage, sequence_parallel)
    return builder.build(spec, optimizer, layout, options, diloco, batch, seq_len)


def put_batch(host_batch: dict[str, np.ndarray], program: AnyProgram) -> dict[str, jax.Array]:
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
    program: AnyProgram | None = None,
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
    manager: ocp.CheckpointManager, program: AnyProgram
) -> tuple[int, TrainState, dict[str, Any]]:
    """(step, state, metadata) of the newest readable checkpoint, read straight into the
    program's shardings (any mesh restores any checkpoint of the same model). A damaged step is
    moved aside to <step>.damaged and the next older one is used. UsageError if the shapes
    differ from the program's or nothing can be read."""
    restored = checkpoint_restore.restore_newest(
        manager, program.abstract_checkpoint(), {}, say, optional=fp8_state.CHECKPOINT_OPTIONAL
    )
    return restored.step, program.from_checkpoint(restored.state), restored.data
