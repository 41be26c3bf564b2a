"""The one road from a run's config to its Program.

Every command goes through `program(cfg, mesh)`: `spmd.train`, `spmd.bench` (and its
collectives tables), `spmd.plan --measure`, `spmd.generate`, `spmd.convert` and
`spmd.run.weights`. They differ only in what they do with the Program, so a benchmark times the
step training runs and a dry run reports it. `program` ends in `build`, which `spmd.api.build`
(a library user's own model and loss) calls too: the same checks, offload and DiLoCo.

What the builder decides from the config: the layout (mesh, ZeRO stage, sequence
parallelism), the pipeline schedule when pp > 1, the precision policy, the model (its family's
`create` with the policy's compute dtype; remat is a model field), the objective
(spmd.engine.objectives), the optimizer (spmd.engine.optimizers) and its LR schedule, the
executor, gradient buckets and prefetch, DiLoCo's outer loop; and the checks that refuse a
layout the model cannot run (MoE, sequence and context parallelism, batch arithmetic) before
anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import optax
from flax import nnx

from models import family, finetune
from spmd import dpo_reference
from spmd.engine import diloco, objectives, optimizers, precision
from spmd.engine.diloco import AnyProgram
from spmd.engine.objective import PAIRS, REFERENCE
from spmd.engine.optimizers import make_optimizer, with_sign_rule
from spmd.engine.options import TOKENS, StepOptions
from spmd.engine.step import LossFn, Program, build_program, check_batch
from spmd.errors import UsageError
from spmd.estimate import long_sequence
from spmd.parallel.layout import Layout
from spmd.run.checks import check_sequence_split
from spmd.run.config import Config
from spmd.sections import LoraConfig, PreferenceConfig, RunConfig

if TYPE_CHECKING:
    from models.contract import ModelConfig
    from spmd.parallel.pipeline import Pipeline


def layout_of(cfg: Config, mesh: jax.sharding.Mesh) -> Layout:
    """Where run `cfg` keeps its state and batches on `mesh`."""
    p = cfg.parallel
    # auto: the ring (it runs every head count and computes every family's attention)
    return Layout(
        mesh, p.zero, p.sequence_parallel, "ulysses" if p.cp_mode == "ulysses" else "ring"
    )


def optimizer(cfg: Config, lr_factor: float = 1.0) -> Callable[[Any], optax.GradientTransformation]:
    """names -> the run's optax chain, its LR schedule scaled by `lr_factor` (rollbacks lower
    it; the schedule is part of the compiled step)."""
    opt = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr * lr_factor)
    return lambda names: make_optimizer(opt, cfg.run.steps, cfg.run.batch, names)


def pipeline_of(cfg: Config, layout: Layout) -> Pipeline | None:
    """The spmd.parallel.pipeline.Pipeline of a pp > 1 mesh (None at pp=1). UsageError for a
    schedule that cannot run (layers, micro-batches or batch that do not split)."""
    if layout.mesh.shape["pipeline"] == 1:
        return None
    from spmd.parallel import pipeline

    p, objective = cfg.parallel, objectives.get(cfg.run.objective)
    logits_loss = objective.logits_loss(family.of(cfg.model))
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
    return precision.from_section(cfg.precision)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the builder needs of a model, a family's or a library user's own."""

    make: Callable[[int], nnx.Module]  # seed -> the module, in its compute dtype
    loss: LossFn  # (model, batch) -> the mean loss of the batch
    # (mesh, executor) -> None, UsageError for a layout the model cannot run
    check_layout: Callable[[jax.sharding.Mesh, str], None] | None = None
    moe: bool = False  # routed experts: no sequence parallelism yet
    frozen: bool = False  # part of the model is frozen (LoRA's base): spmd.engine.frozen
    dropout: float = 0.0  # LoRA's dropout on the adapters' input (models/adapter.py)
    # (model, batch) -> figures a log record shows beside the loss (an MoE's router
    # statistics), on the module `make` builds; None: none
    metrics: Callable[[nnx.Module, dict], dict] | None = None
    # (param name, rate): those params step by -rate x sign(gradient), outside the optimizer
    # (an MoE's router_bias_rate: spmd.engine.optimizers.with_sign_rule); None: none
    sign_rule: tuple[str, float] | None = None


def build(
    spec: ModelSpec,
    tx: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    layout: Layout,
    options: StepOptions,
    sync: diloco.Sync | None = None,
    batch: int | None = None,
    seq_len: int | None = None,
) -> AnyProgram:
    """The one road's end, shared by every command and `spmd.build`: the checks that refuse a
    layout before anything compiles (the global `batch` against the data-parallel ways and
    accum, `seq_len` against context and sequence parallelism, when given; the model's own
    check_layout), then the Program, or DiLoCo's under `sync` (whose checks refuse what it
    does not support). Offload is options.offload_state, refused by the engine where it cannot
    run."""
    mesh = layout.mesh
    if batch is not None:
        check_batch(batch, layout, options.accum)
    if seq_len is not None:
        check_sequence_split(seq_len, dict(mesh.shape), layout.sequence_parallel, moe=spec.moe)
    if spec.check_layout is not None:
        spec.check_layout(mesh, options.executor)
    if spec.sign_rule is not None:  # (DiLoCo's inner steps take it too)
        tx = with_sign_rule(tx, *spec.sign_rule)
    if sync is not None:
        if spec.frozen:
            raise UsageError(
                "frozen params (LoRA's base, --dpo-reference's copy) do not run under "
                "--dcn-sync diloco yet; leave --dcn-sync out"
            )
        return diloco.build(spec.make, spec.loss, tx, layout, sync, options)
    return build_program(spec.make, spec.loss, tx, layout, options)


def lora_spec(model_cfg: ModelConfig, cfg: LoraConfig) -> finetune.LoraSpec | None:
    """The adapters `cfg` asks of the family of `model_cfg` (None: no LoRA); UsageError for a
    bad rank, alpha, dropout or target."""
    fam = family.of(model_cfg)
    return finetune.lora_spec(
        fam,
        cfg.lora_rank,
        cfg.lora_alpha,
        cfg.lora_dropout,
        cfg.lora_targets,
        cfg.lora_base_dtype,
    )


def run_model(cfg: Config) -> ModelSpec:
    """The model of run `cfg` (its family's, under its precision policy, [lora] section and
    objective): what `program` builds, and where the commands take the loss and the logged
    metrics of that model from (spmd.bench's bare step, spmd.train's router statistics)."""
    adapters = lora_spec(cfg.model, cfg.lora)
    return model_spec(cfg.model, policy_of(cfg), adapters, cfg.run.objective, cfg.preference)


def model_spec(
    model_cfg: ModelConfig,
    policy: precision.Policy,
    adapters: finetune.LoraSpec | None = None,
    objective: str = RunConfig.objective,
    knobs: PreferenceConfig | None = None,
) -> ModelSpec:
    """The family model of `model_cfg`, made in the policy's compute dtype, and the loss of
    `objective` (spmd.engine.objectives) on it; with `adapters` its base frozen under LoRA
    adapters (models/lora.py), the objective's loss and the family's step metrics run on the
    adapted model (the LoraModel has only the CausalLM pieces of the family's model).
    UsageError for an objective no entry of the registry names, or knobs (`knobs`: the
    [preference] section) it refuses. An objective with a reference (DPO) reads it from LoRA's
    frozen base, adapters off, or (a full fine-tune) from the frozen copy of --dpo-reference
    (spmd.dpo_reference), and is refused with neither."""
    fam = family.of(model_cfg)
    chosen, knobs = objectives.get(objective), knobs or PreferenceConfig()
    objective_loss = chosen.loss(fam, knobs)
    tensors = fam.hf.tensors if fam.hf else ()
    rank = adapters.rank if adapters is not None else 0
    dpo_reference.check_flags(objective, rank, knobs.dpo_reference)
    # a full fine-tune's frozen reference copy, in the step unless its log-probs are computed
    # before training (spmd.reference_cache reads the copy then, on a program of its own)
    precomputed = knobs.dpo_precompute_reference
    copy = bool(knobs.dpo_reference) and not precomputed

    def make(seed: int) -> nnx.Module:
        model = fam.create(model_cfg, seed, policy.compute_dtype)
        assert isinstance(model, nnx.Module)  # a family's CausalLM is an NNX module
        if copy:  # its weights come from --dpo-reference (spmd.dpo_reference.initial)
            reference = fam.create(model_cfg, seed, policy.compute_dtype)
            assert isinstance(reference, nnx.Module)
            return dpo_reference.attach(model, reference)
        return model if adapters is None else finetune.with_lora(model, adapters, tensors, seed)

    def check_layout(mesh: jax.sharding.Mesh, executor: str) -> None:
        fam.check_layout(model_cfg, mesh, executor)
        if adapters is not None and adapters.base_dtype and mesh.shape["pipeline"] > 1:
            # the pipeline's stages take gradients of every param, an integer code's too
            raise UsageError(
                f"--lora-base-dtype {adapters.base_dtype} does not run under a pipeline yet "
                f"(pp={mesh.shape['pipeline']}); use pp=1, or leave the base unquantized"
            )

    loss = objective_loss if adapters is None else finetune.lora_loss(objective_loss)
    shape = fam.shape(model_cfg)
    moe = bool(shape.n_experts)
    # an MoE family's config without experts builds the dense model: no router to report
    metrics = fam.step_metrics if moe else None
    if metrics is not None and adapters is not None:
        metrics = finetune.lora_metrics(metrics)
    if chosen.metrics is not None:
        own = chosen.metrics(fam, knobs)
        own = own if adapters is None else finetune.lora_metrics(own)
        metrics = own if metrics is None else _both(metrics, own)
    if precomputed and chosen.reference is None:
        raise UsageError(
            f"--dpo-precompute-reference computes DPO's reference log-probs, which --objective "
            f"{objective} does not read; use --objective dpo, or leave the flag out"
        )
    if chosen.reference is not None:
        if adapters is None and not knobs.dpo_reference:
            raise UsageError(
                f"--objective {objective} needs a reference model: LoRA's frozen base "
                f"(--lora-rank > 0) or, for a full fine-tune, --dpo-reference PATH_OR_HUB_ID"
            )
    if chosen.reference is not None and not precomputed:  # the step runs the reference
        reference = chosen.reference(fam, knobs)
        loss = finetune.with_reference(loss, reference, REFERENCE)
        assert metrics is not None  # a reference objective logs its rewards
        metrics = finetune.with_reference(metrics, reference, REFERENCE)
    dropout = adapters.dropout if adapters is not None else 0.0
    frozen = adapters is not None or copy
    rate = shape.router_bias_rate  # an MoE's balancing (models/moe_routing.py)
    rule = ("router_bias", rate) if moe and rate else None
    return ModelSpec(make, loss, check_layout, moe, frozen, dropout, metrics, rule)


def _both(
    first: Callable[[nnx.Module, dict], dict], second: Callable[[nnx.Module, dict], dict]
) -> Callable[[nnx.Module, dict], dict]:
    """(model, batch) -> both functions' figures in one record."""
    return lambda model, batch: {**first(model, batch), **second(model, batch)}


def options_of(
    cfg: Config, layout: Layout, batch_fields: tuple[str, ...], train: bool
) -> StepOptions:
    """The step options of run `cfg` on `layout` (UsageError for a pipeline that cannot run)."""
    p = cfg.parallel
    return StepOptions(
        seed=cfg.run.seed,
        accum=cfg.run.accum,
        policy=policy_of(cfg),
        executor=p.collectives,
        pipeline=pipeline_of(cfg, layout),
        bucket_mb=p.bucket_mb,
        prefetch=p.prefetch,
        batch_fields=batch_fields,
        # a program without an optimizer (loading, converting weights) has no state to offload
        offload_state=p.offload if train else "none",
        elementwise=optimizers.get(cfg.optimizer.optimizer).elementwise,
        eval_params=optimizers.get(cfg.optimizer.optimizer).eval_params,
    )


def sync_of(cfg: Config) -> diloco.Sync | None:
    """DiLoCo's outer loop under --dcn-sync diloco, else None (every step synchronous)."""
    if cfg.parallel.dcn_sync != "diloco":
        return None
    p, o = cfg.parallel, cfg.optimizer
    return diloco.Sync(p.sync_every, o.outer_lr, o.outer_momentum)


def check_pairs(cfg: Config, layout: Layout, batch_fields: tuple[str, ...]) -> None:
    """UsageError unless the data gives preference pairs exactly when the objective reads them,
    and every device's micro-batch holds whole pairs (an even count of rows)."""
    name, pairs = cfg.run.objective, objectives.get(cfg.run.objective).pairs
    given = PAIRS in batch_fields
    if pairs and not given:
        raise UsageError(
            f"--objective {name} trains on preference pairs, and the data has none; give "
            f"JSONL / Parquet / Arrow --data with --prompt-field, --chosen-field and "
            f"--rejected-field"
        )
    if given and not pairs:
        raise UsageError(
            f"--chosen-field / --rejected-field give preference pairs, which --objective {name} "
            f"does not read; use --objective dpo or orpo, or --response-field for SFT"
        )
    # accumulation keeps a pair's rows in one micro-batch (StepOptions.row_group), and the
    # metrics' forward puts a batch in context parallelism's order as the step does
    ways = layout.data_parallel * cfg.run.accum
    if pairs and cfg.run.batch % (2 * ways):
        raise UsageError(
            f"--batch {cfg.run.batch} must be a multiple of {2 * ways} under --objective {name}: "
            f"2 rows (chosen, rejected) per pair on each of {layout.data_parallel} "
            f"data-parallel ways x --accum {cfg.run.accum}"
        )


def program(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    batch_fields: tuple[str, ...] = TOKENS,
    lr_factor: float = 1.0,
    train: bool = True,
) -> AnyProgram:
    """The Program of run `cfg` on `mesh` (a spmd.engine.diloco.DilocoProgram under
    --dcn-sync diloco). `batch_fields` are the keys of the batches the data gives (segment
    ids, loss weights); `train` False builds the same params and forward pass with the
    identity optimizer (no optimizer state), for loading and converting weights. UsageError
    before compiling for a layout the model or the batch cannot use."""
    layout = layout_of(cfg, mesh)
    if layout.cp_mode == "ulysses" and mesh.shape["context"] > 1:
        shape, sizes = cfg.model.shape(), (mesh.shape["tensor"], mesh.shape["context"])
        why = long_sequence.ulysses_error(shape.n_heads, shape.n_kv_heads, *sizes)
        if why is not None:
            raise UsageError(why)
    check_pairs(cfg, layout, batch_fields)
    dpo_reference.check(cfg)  # a full fine-tune's DPO reference, from its config
    options = options_of(cfg, layout, batch_fields, train)
    tx = optimizer(cfg, lr_factor) if train else optax.identity()
    spec = run_model(cfg)
    return build(spec, tx, layout, options, sync_of(cfg), cfg.run.batch, cfg.run.seq_len)


def model_program(
    model_cfg: ModelConfig, layout: Layout, adapters: finetune.LoraSpec | None = None
) -> Program:
    """The Program of a model alone on `layout` (params, shardings and forward pass; identity
    optimizer), as `spmd.generate` and `spmd.convert` load weights into it; with `adapters`
    the LoRA model's (frozen base and adapters)."""
    cfg = Config(model=model_cfg)
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel, zero=layout.zero_stage, sequence_parallel=layout.sequence_parallel
        ),
        run=dataclasses.replace(cfg.run, batch=layout.data_parallel),
    )
    if adapters is not None:
        lay, options = layout_of(cfg, layout.mesh), options_of(cfg, layout, TOKENS, False)
        spec = model_spec(model_cfg, options.policy, adapters)
        built = build(spec, optax.identity(), lay, options, None, cfg.run.batch, None)
        assert isinstance(built, Program)
        return built
    built = program(cfg, layout.mesh, train=False)
    assert isinstance(built, Program)  # the default config synchronises every step
    return built
