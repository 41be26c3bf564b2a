"""The one road from a run's config to its Program.

Every command and the library go through `program(cfg, mesh)`: `spmd.train`, `spmd.bench`
(and its collectives tables), `spmd.plan --measure`, `spmd.generate`, `spmd.convert`,
`spmd.weights` and `spmd.api.build`. They differ only in what they do with the Program, so a
benchmark times the step training runs and a dry run reports it.

What the builder decides from the config: the layout (mesh, ZeRO stage, sequence
parallelism), the pipeline schedule when pp > 1, the precision policy, the model (its family's
`create` with the policy's compute dtype; remat is a model field), the optimizer and its LR
schedule, the executor, gradient buckets and prefetch, DiLoCo's outer loop; and the checks
that refuse a layout the model cannot run (MoE, sequence and context parallelism, batch
arithmetic) before anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

from models import family
from spmd.checks import check_sequence_split
from spmd.config import Config
from spmd.engine import precision
from spmd.engine.optim import make_optimizer
from spmd.engine.step import Program, build_program, check_batch
from spmd.parallel.layout import Layout

TOKENS = ("inputs", "targets")


def layout_of(cfg: Config, mesh: jax.sharding.Mesh) -> Layout:
    """Where run `cfg` keeps its state and batches on `mesh`."""
    return Layout(mesh, cfg.parallel.zero, cfg.parallel.sequence_parallel)


def optimizer(cfg: Config, lr_factor: float = 1.0) -> Callable[[Any], optax.GradientTransformation]:
    """names -> the run's optax chain, its LR schedule scaled by `lr_factor` (rollbacks lower
    it; the schedule is part of the compiled step)."""
    opt = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr * lr_factor)
    return lambda names: make_optimizer(opt, cfg.run.steps, cfg.run.batch, names)


def pipeline_of(cfg: Config, layout: Layout) -> Any:
    """The spmd.parallel.pipeline.Pipeline of a pp > 1 mesh (None at pp=1). UsageError for a
    schedule that cannot run (layers, micro-batches or batch that do not split)."""
    if layout.mesh.shape["pipeline"] == 1:
        return None
    from spmd.parallel import pipeline

    p, logits_loss = cfg.parallel, family.of(cfg.model).logits_loss
    pipe = pipeline.Pipeline(p.pp_schedule, p.microbatches, p.pp_virtual, logits_loss)
    pipeline.check(pipe, layout, cfg.model.n_layers, cfg.run.batch, cfg.run.accum)
    return pipe


def pipeline_report(cfg: Config, layout: Layout) -> dict[str, Any] | None:
    """The pipeline schedule's figures (bubble, idle share, ticks, stash) of a pp > 1 run."""
    pipe = pipeline_of(cfg, layout)
    if pipe is None:
        return None
    from spmd.parallel import pipeline

    stages = layout.mesh.shape["pipeline"]
    return pipeline.report(pipeline.with_accumulation(pipe, stages, cfg.run.accum), stages)


def policy_of(cfg: Config) -> precision.Policy:
    """The run's dtype policy (compute, working params, master weights, gradient reductions)."""
    return precision.get(cfg.precision.precision, cfg.precision.grad_reduce)


def program(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    batch_fields: tuple[str, ...] = TOKENS,
    lr_factor: float = 1.0,
    train: bool = True,
) -> Any:
    """The Program of run `cfg` on `mesh` (a spmd.engine.diloco.DilocoProgram under
    --dcn-sync diloco). `batch_fields` are the keys of the batches the data gives (segment
    ids, loss weights); `train` False builds the same params and forward pass with the
    identity optimizer (no optimizer state), for loading and converting weights. UsageError
    before compiling for a layout the model or the batch cannot use."""
    fam, layout = family.of(cfg.model), layout_of(cfg, mesh)
    check_batch(cfg.run.batch, layout, cfg.run.accum)
    check_sequence_split(
        cfg.run.seq_len,
        dict(mesh.shape),
        cfg.parallel.sequence_parallel,
        moe=bool(fam.shape(cfg.model).n_experts),
        document_mask="segments" in batch_fields,
    )
    fam.check_layout(cfg.model, mesh, cfg.parallel.collectives)
    policy = policy_of(cfg)

    def make_model(seed: int) -> Any:
        return fam.create(cfg.model, seed, policy.compute_dtype)

    tx = optimizer(cfg, lr_factor) if train else optax.identity()
    common = dict(
        seed=cfg.run.seed,
        accum=cfg.run.accum,
        policy=policy,
        executor=cfg.parallel.collectives,
        batch_fields=batch_fields,
    )
    # a program without an optimizer (loading, converting weights) has no state to offload
    offload_state = cfg.parallel.offload if train else "none"
    if cfg.parallel.dcn_sync == "diloco":
        from spmd.engine import diloco

        p, o = cfg.parallel, cfg.optimizer
        sync = diloco.Sync(p.sync_every, o.outer_lr, o.outer_momentum)
        return diloco.build(
            make_model, fam.loss, tx, layout, sync, offload_state=offload_state, **common
        )
    return build_program(
        make_model,
        fam.loss,
        tx,
        layout,
        pipeline=pipeline_of(cfg, layout),
        bucket_mb=cfg.parallel.bucket_mb,
        prefetch=cfg.parallel.prefetch,
        offload_state=offload_state,
        **common,
    )


def model_program(model_cfg: Any, layout: Layout) -> Program:
    """The Program of a model alone on `layout` (params, shardings and forward pass; identity
    optimizer), as `spmd.generate` and `spmd.convert` load weights into it."""
    cfg = Config(model=model_cfg)
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel, zero=layout.zero_stage, sequence_parallel=layout.sequence_parallel
        ),
        run=dataclasses.replace(cfg.run, batch=layout.data_parallel),
    )
    return program(cfg, layout.mesh, train=False)
